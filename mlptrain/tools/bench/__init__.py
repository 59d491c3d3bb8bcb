"""The benchmark harness: what ``scripts/bench*.py``, ``benchmarks/`` and ``python -m mlptrain.bench`` share.

* :mod:`.medians`: CUDA-event medians after warm-up, CUDA-graph replays, the tables' number format;
* :mod:`.step_trainer`: a GPU trainer on random data, its configuration composed through Hydra's
  compose API (:func:`mlptrain.cli.main.compose_config`) as a user's command line would make it;
* :mod:`.layer_timing`, :mod:`.step_timing`: one layer and whole training steps, fused, naive and
  PyTorch (``scripts/bench.py`` sections a to c);
* :mod:`.memory_vs_torch`, :mod:`.largest_model`: peak memory against PyTorch eager and the widest
  model that trains (sections m and l);
* :mod:`.predict_timing`: the timing helpers of the prediction benchmarks;
* :mod:`.suite`: ``python -m mlptrain.bench`` (what ``scripts/bench.py`` runs).

Everything that touches the GPU gets CuPy through :func:`mlptrain.base.backend.get_backend` when it
runs; importing the harness needs neither CuPy nor a GPU.
"""

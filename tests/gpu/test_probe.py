"""The measured bias-gradient strategy (mlptrain.step.cuda.bgrad, execution.bgrad=auto)."""

import json

import pytest
from gpu_helpers import cp, gpu_trainer

pytestmark = pytest.mark.gpu


def test_bgrad_probe_times_the_step_and_remembers_its_choice(tmp_path):
    from mlptrain.step.cuda.bgrad import choose_bgrad

    tr = gpu_trainer(**{"execution.bgrad": "bgradb", "precision.name": "fp16"})
    x, y = next(iter(tr.train_loader.epoch(0)))
    calls = []

    def forward_backward():
        calls.append(list(tr.model.bgrad))
        return tr.forward_backward(x, y)

    store = tmp_path / "bgrad.json"
    with tr.stream:
        chosen = choose_bgrad(tr.model, forward_backward, "k", reps=3, store=store)
    hidden = len(tr.model.layers) - 1
    assert len(chosen) == hidden and set(chosen) <= {"drelu_bgrad", "bgradb"}
    assert tr.model.bgrad == chosen
    # each hidden layer was timed both ways (a warm-up and a capture each), the layer above first, and no
    # whole-model choice twice: layer i's first option is the model the layer above was timed as
    tried = [tuple(c) for i, c in enumerate(calls) if i % 2 == 0]
    assert len(tried) == hidden + 1 and len(set(tried)) == hidden + 1, tried
    assert {t[-1] for t in tried[:2]} == {"drelu_bgrad", "bgradb"}
    assert {t[0] for t in tried} == {"drelu_bgrad", "bgradb"}
    assert json.loads(store.read_text()) == {"k": chosen}
    calls.clear()
    tr.model.set_bgrad("drelu_bgrad" if chosen[0] == "bgradb" else "bgradb")
    again = choose_bgrad(tr.model, forward_backward, "k", store=store)
    assert again == chosen and not calls  # remembered: not timed again


def test_bgrad_auto_probes_only_models_whose_step_is_worth_timing(monkeypatch):
    """PROBE_MIN_FLOPS: the default digits model (10 MFLOP per step) takes bgradb untimed; 784-wide layers
    at batch 256 (GFLOPs per step) are timed."""
    from mlptrain.step import bgrad as bgrad_module
    from mlptrain.step.cuda import bgrad as probe

    timed = []
    real = probe.choose_bgrad
    monkeypatch.setattr(probe, "choose_bgrad", lambda *a, **k: timed.append(a[2]) or real(*a, **k))
    small = gpu_trainer(**{"execution.bgrad": "auto", "execution.plan_cache": False})
    assert small.model.bgrad == ["bgradb"] * (len(small.widths) - 2) and timed == []
    monkeypatch.setattr(bgrad_module, "PROBE_MIN_FLOPS", 1.0)  # everything is worth timing now
    gpu_trainer(**{"execution.bgrad": "auto", "execution.plan_cache": False})
    assert len(timed) == 1


def test_bgrad_auto_takes_drelu_bgrad_untimed_in_fp8(monkeypatch):
    """precision=fp8: the mask kernel sums the bias gradient, BGRADB would be a pass of its own: no probe."""
    from mlptrain.step import bgrad as bgrad_module
    from mlptrain.step.cuda import bgrad as probe

    if int(cp.cuda.Device().compute_capability) < 89:
        pytest.skip("FP8 needs compute capability 8.9 or higher")
    timed = []
    monkeypatch.setattr(probe, "choose_bgrad", lambda *a, **k: timed.append(a[2]))
    monkeypatch.setattr(bgrad_module, "PROBE_MIN_FLOPS", 1.0)  # worth timing, were it not fp8
    tr = gpu_trainer(
        **{
            "execution.bgrad": "auto",
            "execution.plan_cache": False,
            "precision.name": "fp8",
            "model.hidden": [256, 256],
        }
    )
    assert tr.model.bgrad == ["drelu_bgrad", "drelu_bgrad"] and timed == []

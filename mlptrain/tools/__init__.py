"""Developer tools shipped with the package: the benchmark harness and the comparison report.

=================== ================================================================
module              what it owns
=================== ================================================================
``bench/``          ``python -m mlptrain bench``: fused vs naive vs PyTorch timings, memory
``compare/``        ``python -m mlptrain compare``: the report of a comparison sweep
=================== ================================================================
"""

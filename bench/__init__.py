"""minidi's benchmarks (speed, and the numerics harness ``numerics.py``: how far compiled steps are from eager;
pass / fail correctness lives in ``tests/``). Shared harness: ``bench/common.py``.

Each benchmark runs as a script (``python bench/bench_prefill.py``, ``torchrun --nproc-per-node N
bench/bench_prefill.py``) or as a module (``python -m bench.bench_prefill``).
"""

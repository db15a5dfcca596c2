import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ["TRITON_INTERPRET"] == "1":
    from tests.triton_interpreter import skip_repatching_inside_launches

    skip_repatching_inside_launches()


# The test files that take longest on the 2-core CPU, longest first (seconds summed over a file's tests, from
# ``pytest --durations=0`` of the whole suite, round 22: 164, 132, 127, 127, 118, 107, 102, 93, 48; the next file
# takes 26). They run first: pytest-xdist's ``--dist loadfile`` hands out files in collection order as workers free
# up, so a long file collected last ran alone at the end while the other worker idled. Only the order changes.
LONGEST_FILES = ("tests/passes/test_models.py", "tests/runtime/test_compile_cache.py", "tests/runtime/test_compile.py",
                 "tests/passes/test_regional.py", "tests/bench/test_bench_prefill.py", "tests/runtime/test_engine.py",
                 "tests/ops/test_backends.py", "tests/bench/test_bench_cli.py", "tests/bench/test_numerics.py")


def _longest_first(items: list) -> None:
    """Stable: the files of ``LONGEST_FILES`` first in that order, then the rest as collected; tests inside a file
    keep their order (every worker sorts the same collection the same way, as xdist requires)."""
    rank = {f: i for i, f in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))


def pytest_collection_modifyitems(config, items):
    """``gpu`` tests need a CUDA device; ``slow`` tests (each minutes on 2 CPU cores, and covered in the default suite
    by a cheaper test that their docstring names) run only with ``MINIDI_SLOW_TESTS=1``. The longest files run
    first (``LONGEST_FILES``)."""
    _longest_first(items)
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    skip_slow = pytest.mark.skip(reason="slow: MINIDI_SLOW_TESTS=1 runs it")
    cuda, slow = torch.cuda.is_available(), os.environ.get("MINIDI_SLOW_TESTS", "") not in ("", "0")
    for item in items:
        if "gpu" in item.keywords and not cuda:
            item.add_marker(skip_gpu)
        if "slow" in item.keywords and not slow:
            item.add_marker(skip_slow)


@pytest.fixture
def no_tf32():
    """fp32 matmuls in full fp32 (TF32 off) for the test, restored after: the references of fp32-accurate ops."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old

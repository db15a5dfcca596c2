import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ["TRITON_INTERPRET"] == "1":
    from tests.triton_interpreter import skip_repatching_inside_launches

    skip_repatching_inside_launches()


def pytest_collection_modifyitems(config, items):
    """``gpu`` tests need a CUDA device; ``interpreter`` tests run minidi's kernels on CPU tensors, so they need
    ``TRITON_INTERPRET=1`` (the default here; a GPU run sets 0 and runs the CUDA variants); ``slow`` tests (each
    minutes on 2 CPU cores, and covered in the default suite by a cheaper test that their docstring names) run only
    with ``MINIDI_SLOW_TESTS=1``."""
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    skip_interp = pytest.mark.skip(reason="runs kernels on CPU tensors: needs TRITON_INTERPRET=1")
    skip_slow = pytest.mark.skip(reason="slow: MINIDI_SLOW_TESTS=1 runs it")
    cuda, slow = torch.cuda.is_available(), os.environ.get("MINIDI_SLOW_TESTS", "") not in ("", "0")
    interpreting = os.environ.get("TRITON_INTERPRET") == "1"
    for item in items:
        if "gpu" in item.keywords and not cuda:
            item.add_marker(skip_gpu)
        if "interpreter" in item.keywords and not interpreting:
            item.add_marker(skip_interp)
        if "slow" in item.keywords and not slow:
            item.add_marker(skip_slow)


@pytest.fixture
def no_tf32():
    """fp32 matmuls in full fp32 (TF32 off) for the test, restored after: the references of fp32-accurate ops."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old

"""minidi.formats: the one definition of the checkpoint formats' math, shared by the model and the ops.

Value-level checks of the decoders live in tests/model/test_quant.py (through the model's re-exports); the kernels'
``@triton.jit`` twins are held equal to these functions by the op tests (test_fp4_grouped_gemm.py::
test_decode_matches_formats, test_moe_activation.py::test_pow2_ceil_twin)."""

from __future__ import annotations

import ast
from pathlib import Path

import torch

import minidi.model.quant as quant
import minidi.ops.fp4_grouped_gemm as fp4_gemm
import minidi.ops.moe_activation as moe_activation
from minidi import formats

ROOT = Path(__file__).resolve().parents[1]


def test_a_leaf_that_imports_torch_only():
    tree = ast.parse((ROOT / "minidi" / "formats.py").read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert imported <= {"__future__", "torch"}, imported


def test_model_and_ops_share_the_definitions():
    """No second copy: the model's names are these objects, and the ops' references call them."""
    for name in ("E2M1_GRID", "E2M1_MAX", "E4M3_MAX", "e8m0_to_float", "float_to_e8m0", "pow2_ceil", "e2m1_grid",
                 "unpack_fp4_codes", "dequant_fp4", "hadamard", "hadamard_matrix", "round_e2m1", "fq4_ue8m0",
                 "float_blocks"):
        assert getattr(quant, name) is getattr(formats, name), name
    assert moe_activation.E4M3_MAX is formats.E4M3_MAX and fp4_gemm.FP4_BLOCK == formats.FP4_BLOCK


def test_constants_match_torch_and_the_spec():
    assert formats.E4M3_MAX == torch.finfo(torch.float8_e4m3fn).max
    assert formats.e2m1_grid().tolist() == [0, .5, 1, 1.5, 2, 3, 4, 6, -0.0, -.5, -1, -1.5, -2, -3, -4, -6]
    assert formats.E2M1_MAX == max(formats.E2M1_GRID)
    bits = torch.tensor([formats.E8M0_MIN_BITS, formats.E8M0_NAN_BITS], dtype=torch.int32).view(torch.float32)
    assert bits[0].item() == 2.0**-127 and bits[1].isnan()


def test_e8m0_edge_codes_and_round_trip():
    codes = torch.arange(256, dtype=torch.uint8)
    v = formats.e8m0_to_float(codes)
    assert v[0].item() == 2.0**-127 and v[127].item() == 1.0 and v[254].item() == 2.0**127 and v[255].isnan()
    assert torch.equal(formats.float_to_e8m0(v[:255]).view(torch.uint8), codes[:255])
    assert torch.equal(v[:255], formats.e8m0_to_float(codes[:255].view(torch.float8_e8m0fnu)))


def test_dequant_fp4_every_byte():
    packed = torch.arange(256, dtype=torch.uint8).view(2, 128)  # [2, 128] bytes -> [2, 256] values
    scale = torch.tensor([[127] * 8, [128] * 8], dtype=torch.uint8).view(torch.float8_e8m0fnu)  # 1 and 2
    w = formats.dequant_fp4(packed, scale, torch.float32)
    grid = formats.e2m1_grid()
    b = torch.arange(256).view(2, 128)
    want = torch.stack([grid[b & 15], grid[b >> 4]], dim=-1).flatten(-2) * torch.tensor([[1.0], [2.0]])
    assert torch.equal(w, want)
    assert w.shape == (2, 256) and formats.dequant_fp4(packed, scale, torch.bfloat16).dtype == torch.bfloat16


def test_pow2_ceil():
    y = torch.tensor([1.0, 1.5, 3.0, 4.0, 2.0**-126, 1e-4 / 448, 1000.0])
    assert formats.pow2_ceil(y).tolist() == [1.0, 2.0, 4.0, 4.0, 2.0**-126, 2.0**-22, 1024.0]

"""The Hopper Gluon path of minidi::fp8_fp4_grouped_mm (``minidi/ops/fp8_grouped_gemm_sm90.py``).

CPU: the per-row weight-scale fold (``fold_fp4_rows``) and its lossless decode (``fold_ref``: every code x every
exponent offset it admits, a row that cannot fold, edge codes), the kernel's PTX decode replayed in Python against
``fold_ref`` (all 16 codes x all 12 offsets), and (Triton 3.6 only) the kernel compiling for sm_90a with pipelined
wgmma. GPU (``gpu`` marker): the kernel vs the fp64 product on fresh random inputs, poisoned outputs, ragged and empty
experts, rows past offs[-1] untouched, odd K-step counts, N not a multiple of the tile; weights that do not fold
falling back to the exact Triton kernel; a wrong fold base poisoning the output (NaN) instead of a silent error.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from minidi import formats
from minidi.ops import fp8_grouped_gemm_sm90 as sm90
from minidi.ops.fp8_grouped_gemm import fp8_fp4_grouped_mm, fp8_fp4_grouped_mm_ref

from .gluon_compile import compile_sm90
from .test_fp8_grouped_gemm import POISON, abs_mass, assert_close, fp64_reference, make

gpu = pytest.mark.gpu


def _codes_rows(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """[n, k] uint8 codes: random, with all 16 codes in every 32-block of every row."""
    c = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    for j in range(16):
        c[:, j::32][:, :] = j
    return c


def _pack(codes: torch.Tensor) -> torch.Tensor:
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).view(torch.int8)


# ---- the fold (plain torch) ----------------------------------------------------------------------------------------
def test_fold_base_keeps_every_offset_in_range():
    gen = torch.Generator().manual_seed(1)
    lo = torch.randint(0, 244, (3, 17, 1), generator=gen)
    span = torch.randint(0, 12, (3, 17, 1), generator=gen)
    c = lo + (torch.rand(3, 17, 10, generator=gen) * (span + 1)).long().clamp(max=11)
    c[..., 0] = lo[..., 0]
    c = c.clamp(max=254).to(torch.uint8)
    base = sm90.fold_fp4_rows(c.view(torch.float8_e8m0fnu))
    assert base is not None and base.dtype == torch.int32 and base.shape == (3, 17)
    d = c.to(torch.int32) - base[..., None]
    assert bool(((d >= -5) & (d <= 6)).all())
    assert int(base.max()) <= 254 and int(base.min()) >= 5  # 2^(base - 127): a normal fp32 number


@pytest.mark.parametrize("row,ok", [([100, 111], True), ([100, 112], False), ([0, 11], True), ([243, 254], True),
                                    ([250, 254], True), ([254, 255], False), ([7, 7], True), ([0, 127], False)])
def test_fold_accepts_exactly_the_rows_that_fold(row, ok):
    c = torch.full((2, 3, 4), 120, dtype=torch.uint8)
    c[1, 2, :2] = torch.tensor(row, dtype=torch.uint8)
    c[1, 2, 2:] = row[0]
    base = sm90.fold_fp4_rows(c.view(torch.float8_e8m0fnu))
    assert (base is not None) == ok
    if ok:
        d = c[1, 2].to(torch.int32) - base[1, 2]
        assert bool(((d >= -5) & (d <= 6)).all())


def test_fold_ref_is_lossless_for_every_code_and_offset():
    """e4m3(w') * 2^(base - 127) == dequant_fp4 for all 16 codes at every offset d = c - base in [-5, 6], fresh
    random codes around them."""
    gen = torch.Generator().manual_seed(2)
    e, n, k = 2, 24, 12 * 32
    codes = _codes_rows(e * n, k, gen).reshape(e, n, k)
    packed = _pack(codes)
    base = torch.randint(5, 249, (e, n), generator=gen, dtype=torch.int32)
    scale = (base[..., None] + torch.arange(-5, 7)[None, None, :]).to(torch.uint8)  # block b has d = b - 5
    w8 = sm90.fold_ref(packed, scale.view(torch.float8_e8m0fnu), base)
    got = w8.view(torch.float8_e4m3fn).double() * torch.exp2(base.double() - 127)[..., None]
    want = formats.dequant_fp4(packed, scale.view(torch.float8_e8m0fnu), torch.float32).double()
    assert torch.equal(got, want)


def test_fold_ref_poisons_offsets_out_of_range():
    codes = torch.arange(16, dtype=torch.uint8).repeat(1, 1, 4)  # [1, 1, 64]
    base = torch.tensor([[120]], dtype=torch.int32)
    scale = torch.tensor([[[114, 127]]], dtype=torch.uint8)  # d = -6 (too small), d = 7 (too large)
    w8 = sm90.fold_ref(_pack(codes), scale.view(torch.float8_e8m0fnu), base)
    assert bool(((w8 & 0x7F) == 0x7F).all())  # e4m3 NaN (either sign) in every byte of both blocks


def _prmt(a: int, b: int, sel: int) -> int:
    """PTX prmt.b32 (default mode): byte i of the result = byte (sel >> 4i) & 7 of {b, a}, or its sign replicated
    when bit 3 of that selector nibble is set."""
    src = (b << 32) | a
    out = 0
    for i in range(4):
        nib = (sel >> (4 * i)) & 0xF
        byte = (src >> (8 * (nib & 7))) & 0xFF
        if nib & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def _decode_word(p: int, l0: int, l1: int) -> tuple[int, int]:
    """Python replay of ``_DECODE_ASM`` (register by register)."""
    m = p & 0x77777777
    mh = m >> 16
    a = _prmt(l0, l1, m)
    b = _prmt(l0, l1, mh)
    q = (p << 4) & 0xFFFFFFFF
    s0 = _prmt(p, q, 0x1504)
    s1 = _prmt(p, q, 0x3726)
    return (s0 & 0x80808080) | a, (s1 & 0x80808080) | b


def _tables(u: int) -> tuple[int, int]:
    """The decoder's per-(row, block) tables (its Gluon code, replayed), NaN bytes outside u in [0, 11]."""
    dd = (u * 0x08080808) & 0xFFFFFFFF
    l0 = (sm90._LUT0 + (dd & 0xFFFFFF00)) & 0xFFFFFFFF
    l1 = (sm90._LUT1 + dd) & 0xFFFFFFFF
    if u < 0 or u > 11:
        return 0x7F7F7F7F, 0x7F7F7F7F
    return l0, l1


def test_kernel_decode_matches_fold_ref_on_all_codes_and_offsets():
    gen = torch.Generator().manual_seed(3)
    codes = _codes_rows(14, 64, gen)  # 14 rows, 2 blocks each
    packed = _pack(codes).view(torch.uint8)
    base = torch.full((1, 14), 130, dtype=torch.int32)
    u = torch.arange(-1, 13)  # one offset per row, two of them out of range
    scale = (base[0, :, None] + (u[:, None] - 5)).repeat(1, 2).to(torch.uint8)[None]
    want = sm90.fold_ref(packed.view(torch.int8)[None], scale.view(torch.float8_e8m0fnu), base)[0]
    words = packed.view(torch.int32)  # [14, 8]: 8 codes per word, code j in nibble j
    for r in range(14):
        l0, l1 = _tables(int(u[r]))
        got = []
        for w in words[r].tolist():
            lo, hi = _decode_word(w & 0xFFFFFFFF, l0, l1)
            got += [(lo >> (8 * i)) & 0xFF for i in range(4)] + [(hi >> (8 * i)) & 0xFF for i in range(4)]
        assert got == want[r].tolist(), f"row {r}, u {int(u[r])}"


def test_module_is_inert_without_a_hopper_gpu():
    q = torch.zeros(4, 128, dtype=torch.float8_e4m3fn)
    wp = torch.zeros(2, 8, 64, dtype=torch.int8)
    assert sm90.can_run(q, wp) is False
    assert isinstance(sm90.gluon_supported(), bool)


# ---- compiles for sm_90a on the CPU (Triton's compiler and ptxas need no GPU) -----------------------------------
@pytest.mark.skipif(not sm90.gluon_supported(), reason="Gluon API of a tested Triton version (3.6) not installed")
@pytest.mark.parametrize("cfg", [sm90.EP4, sm90.EP1], ids=["EP4", "EP1"])
def test_kernel_compiles_for_sm90a_with_pipelined_wgmma(cfg):
    pytest.importorskip("triton.backends.nvidia.compiler")
    e, n, k, r = 4, 256, 512, 512
    q = torch.empty(r, k, dtype=torch.float8_e4m3fn)
    wp = torch.empty(e, n, k // 2, dtype=torch.int8)
    descs = dict(zip(("q_desc", "w_desc"), sm90.descriptors(q, wp, cfg)))
    ptrs = dict(s_ptr=torch.float32, ws_ptr=torch.uint8, base_ptr=torch.int32, offs_ptr=torch.int32,
                out_ptr=torch.bfloat16)
    consts = dict(BM=cfg.BM, BN=cfg.BN, NS=cfg.NS, E_POW2=512, WM=cfg.WM, WN=cfg.WN, PIPE=cfg.PIPE, ABLATE=0, U=2,
                  DW=cfg.dec_warps,
                  DEC_REGS=cfg.dec_regs, DECODE_ASM=sm90._DECODE_ASM, LUT0=sm90._LUT0, LUT1=sm90._LUT1)
    kern = compile_sm90(sm90._fp8_fp4_grouped_mm_sm90, descs, ptrs, consts, num_warps=4 * cfg.WM * cfg.WN,
                        maxnreg=cfg.maxnreg)
    ptx = kern.asm["ptx"]
    assert len(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n64k32\.f32\.e4m3\.e4m3", ptx)) == 16
    assert "wgmma.wait_group.sync.aligned 1;" in ptx  # each wait leaves the next MMA in flight
    assert "setmaxnreg" in ptx and "prmt.b32" in ptx


# ---- GPU -----------------------------------------------------------------------------------------------------------
def _gpu_ready() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if torch.cuda.get_device_capability() != (9, 0) or not sm90.gluon_supported():
        pytest.skip("needs sm_90 and Triton 3.6's Gluon")


GPU_CASES = {  # experts, N, K, rows per expert, rows past offs[-1]
    "uniform": (8, 384, 512, [256] * 8, 0),  # 4 K-steps: two stages per iteration
    "ragged": (8, 200, 384, [0, 300, 1, 77, 0, 130, 2, 500], 11),  # odd K-steps, N not a multiple of the tile
    "one_expert_rows": (3, 256, 1024, [0, 64, 0], 5),
}


@gpu
@pytest.mark.parametrize("cfg", [sm90.EP4, sm90.EP1, dataclasses.replace(sm90.EP4, PIPE=False)],
                         ids=["EP4", "EP1", "EP4_sync"])
@pytest.mark.parametrize("case", list(GPU_CASES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_sm90_matches_fp64(case, cfg, dtype):
    _gpu_ready()
    e, n, k, counts, extra = GPU_CASES[case]
    x, q, s, wp, ws, offs = make(e, n, k, counts, extra, seed=11 + len(case), device="cuda")
    base = sm90.fold_fp4_rows(ws)
    assert base is not None
    out = torch.full((q.shape[0], n), POISON, dtype=dtype, device="cuda")
    sm90.launch_sm90(q, s, wp, ws, base, offs, out, cfg)
    end = int(offs[-1])
    assert_close(out[:end], fp64_reference(q, s, wp, ws, offs)[:end], dtype, mass=abs_mass(q, s, wp, ws, offs)[:end])
    assert (out[end:] == POISON).all()  # rows past offs[-1]: never written


@gpu
def test_gpu_op_takes_the_sm90_path_and_falls_back_for_weights_that_do_not_fold():
    _gpu_ready()
    x, q, s, wp, ws, offs = make(4, 256, 512, [100, 0, 37, 200], 0, seed=21, device="cuda")
    ref = fp64_reference(q, s, wp, ws, offs)
    mass = abs_mass(q, s, wp, ws, offs)
    base = sm90.fold_fp4_rows(ws)
    for w_row_base in (None, base):
        assert_close(fp8_fp4_grouped_mm(q, s, wp, ws, offs, torch.float32, w_row_base=w_row_base), ref,
                     torch.float32, mass=mass)
    ws2 = ws.view(torch.uint8).clone()
    ws2[2, 5, 0] = 100  # one row's codes now span far more than 11
    ws2[2, 5, 1] = 130
    ws2 = ws2.view(torch.float8_e8m0fnu)
    assert sm90.fold_fp4_rows(ws2) is None
    out = fp8_fp4_grouped_mm(q, s, wp, ws2, offs, torch.float32)  # the exact Triton kernel
    assert_close(out, fp64_reference(q, s, wp, ws2, offs), torch.float32, mass=abs_mass(q, s, wp, ws2, offs))
    torch.testing.assert_close(out, fp8_fp4_grouped_mm_ref(q, s, wp, ws2, offs, torch.float32).cuda(),
                               rtol=1e-4, atol=1e-4 * float(out.abs().max()))


@gpu
def test_gpu_wrong_base_poisons_instead_of_silently_wrong():
    _gpu_ready()
    x, q, s, wp, ws, offs = make(2, 128, 256, [64, 64], 0, seed=31, device="cuda")
    base = sm90.fold_fp4_rows(ws).clone()
    base[1, 7] += 9  # no longer covers this row's codes
    out = torch.full((128, 128), POISON, dtype=torch.float32, device="cuda")
    sm90.launch_sm90(q, s, wp, ws, base, offs, out)
    assert torch.isnan(out[64:, 7]).all()  # expert 1's rows, column 7
    good = torch.ones(128, 128, dtype=torch.bool, device="cuda")
    good[64:, 7] = False
    ref = fp64_reference(q, s, wp, ws, offs)
    mass = abs_mass(q, s, wp, ws, offs)
    assert_close(torch.where(good, out, 0).cpu(), torch.where(good.cpu(), ref, 0), torch.float32,
                 mass=torch.where(good.cpu(), mass, 0))

"""The register-operand Hopper kernel of minidi::fp4_grouped_mm (``minidi/ops/fp4_grouped_gemm_sm90_rs.py``): the
MMA warpgroups decode FP4 weights into the registers of a register-operand wgmma.

CPU: the PTX decode replayed in Python (register by register, with its constant tables and a bf16 multiply) equals
``dequant_fp4`` bit for bit for every byte value and every E8M0 code the kernel takes (2..252; 255 gives NaN); the
packed layout gives each thread the bytes of its wgmma fragment; configs over the register file or shared memory
are refused clearly; (Triton 3.6 only) the kernel compiles for sm_90a with the decoded operand converted to the
dot-operand layout without data movement (checked by Gluon at compile time) and its wgmma left in flight. GPU
(``gpu`` marker): the kernel vs the fp64 product on fresh random inputs, poisoned outputs, ragged and empty experts,
rows past offs[-1] untouched, N not a multiple of the tile; repeated runs bitwise equal (no race on the in-flight
register operand); NaN codes (255) giving NaN columns (``test_fp4_grouped_gemm_sm90.py``, both Hopper kernels).
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from minidi import formats
from minidi.ops import fp4_grouped_gemm_hopper as hopper
from minidi.ops import fp4_grouped_gemm_sm90_rs as rs

from .gluon_compile import compile_sm90, inflight_a_writes, sass
from .test_fp4_grouped_gemm_sm90 import _assert_close, _gpu_ready, _reference
from .test_fp8_grouped_gemm import POISON, make
from .test_fp8_grouped_gemm_sm90 import _prmt

gpu = pytest.mark.gpu


# ---- the decode, replayed ------------------------------------------------------------------------------------------
def _bf16_mul(a: int, b: int) -> int:
    """bf16 bits of a * b (``mul.rn.bf16x2`` on one half): exact here, the product of an e2m1 value and a power of
    two in bf16's normal range; NaN in, NaN out."""
    va = torch.tensor([a - (2**16 if a >= 2**15 else 0)], dtype=torch.int16).view(torch.bfloat16).float()
    vb = torch.tensor([b - (2**16 if b >= 2**15 else 0)], dtype=torch.int16).view(torch.bfloat16).float()
    prod = (va * vb).to(torch.bfloat16)
    return int(prod.view(torch.int16).item()) & 0xFFFF


def _decode_word(p: int, scales: list[int]) -> list[int]:
    """Python replay of ``_DECODE_ASM``: 4 packed bytes -> 4 bf16x2 words (word j: byte j's two weights times its
    scale ``scales[j]``, a bf16x2 pattern)."""
    tl0, tl1, th0, th1 = (t & 0xFFFFFFFF for t in rs.TABLES)
    m = p & 0x77777777
    mh = m >> 16
    l0, h0 = _prmt(tl0, tl1, m), _prmt(th0, th1, m)
    l1, h1 = _prmt(tl0, tl1, mh), _prmt(th0, th1, mh)
    q = (p << 4) & 0xFFFFFFFF
    h0 |= _prmt(p, q, 0x1504) & 0x80808080
    h1 |= _prmt(p, q, 0x3726) & 0x80808080
    words = [_prmt(l0, h0, 0x5140), _prmt(l0, h0, 0x7362), _prmt(l1, h1, 0x5140), _prmt(l1, h1, 0x7362)]
    out = []
    for w, s in zip(words, scales):
        out.append(_bf16_mul(w & 0xFFFF, s & 0xFFFF) | (_bf16_mul(w >> 16, s >> 16) << 16))
    return out


def _scale_word(c: int) -> int:
    """The kernel's ``_scales``: bf16x2 2^(c - 127) as c * 0x800080, NaN for c = 255."""
    return rs.NAN_SCALE if c == 255 else (c << 7) | (c << 23)


def test_table_words_are_the_e2m1_grid_in_bf16():
    bits = torch.tensor(formats.E2M1_GRID, dtype=torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
    assert tuple(bits.tolist()) == rs.E2M1_BF16


@pytest.mark.parametrize("c", [2, 3, 100, 127, 128, 200, 251, 252, 255])
def test_kernel_decode_matches_dequant_on_every_byte(c):
    """Every byte value (both nibbles, all 16 codes each) in each of the 4 positions of a word, against the
    reference dequant with E8M0 code c."""
    byte_vals = torch.arange(256, dtype=torch.int64)
    wp = byte_vals.to(torch.uint8).view(torch.int8).reshape(1, 1, 256)  # one row, K = 512
    ws = torch.full((1, 1, 16), c, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    want = formats.dequant_fp4(wp, ws, torch.bfloat16)[0, 0]  # [512]
    s = _scale_word(c)
    got = []
    for w in range(64):
        word = int(byte_vals[4 * w]) | int(byte_vals[4 * w + 1]) << 8 | int(byte_vals[4 * w + 2]) << 16 | \
            int(byte_vals[4 * w + 3]) << 24
        for out in _decode_word(word, [s] * 4):
            got += [out & 0xFFFF, out >> 16]
    got_t = torch.tensor([g - (2**16 if g >= 2**15 else 0) for g in got], dtype=torch.int16).view(torch.bfloat16)
    if c == 255:
        assert torch.isnan(got_t).all() and torch.isnan(want).all()
    else:
        assert torch.equal(got_t.view(torch.int16), want.view(torch.int16))  # bitwise: signed zeros too


def test_packed_layout_gives_each_thread_its_fragment_bytes():
    """Thread 4 g + t of warp w holds rows 16 w + g (+ 8) and bytes t + 4 j: the k pairs 2 t, 2 t + 1 of every
    8-wide chunk, the register-operand wgmma's A fragment (m64 x k16, bf16) of rows g, g + 8."""
    pytest.importorskip("triton.experimental.gluon")
    p2, p3 = rs.packed_layouts(2)

    def coord(bases, idx):
        r = [0] * len(bases[0])
        for bit, b in enumerate(bases):
            if idx >> bit & 1:
                r = [x ^ y for x, y in zip(r, b)]
        return r

    for warp in range(8):
        for lane in range(32):
            g, t = lane // 4, lane % 4
            held = set()
            for reg in range(16):
                row, byte = (a ^ b ^ c for a, b, c in zip(coord(p2.reg_bases, reg), coord(p2.lane_bases, lane),
                                                          coord(p2.warp_bases, warp)))
                held.add((row, byte))
            want = {(16 * warp + g + 8 * h, t + 4 * j) for h in range(2) for j in range(8)}
            assert held == want, (warp, lane)
    assert p3.shape == [128, 2, 16]


def test_configs_are_checked_clearly():
    rs.EP4_FIXED.check()
    rs.EP1_FIXED.check()
    with pytest.raises(ValueError, match="exceed the 65,536 registers"):
        dataclasses.replace(rs.EP4_FIXED, maxnreg=184).check()
    with pytest.raises(ValueError, match="shared memory"):
        dataclasses.replace(rs.EP4_FIXED, NS=12).check()
    with pytest.raises(ValueError, match="BT must be"):
        dataclasses.replace(rs.EP4_FIXED, BT=96).check()


def test_default_config_by_rows_per_expert():
    assert rs.default_config(256) == rs.EP4 and rs.default_config(64) == rs.EP1


# ---- compiles for sm_90a on the CPU (Triton's compiler and ptxas need no GPU) -----------------------------------
@pytest.mark.skipif(not hopper.gluon_supported(), reason="Gluon API of a tested Triton version (3.6) not installed")
@pytest.mark.parametrize("cfg", [rs.EP4_FIXED, rs.EP1_FIXED], ids=["EP4", "EP1"])
def test_kernel_compiles_for_sm90a_with_register_operand_wgmma(cfg):
    pytest.importorskip("triton.backends.nvidia.compiler")
    e, n, k, r = 4, 512, 512, 512
    x = torch.empty(r, k, dtype=torch.bfloat16)
    wp = torch.empty(e, n, k // 2, dtype=torch.int8)
    descs = dict(zip(("x_desc", "w_desc"), rs.descriptors(x, wp, cfg)))
    ptrs = dict(ws_ptr=torch.uint8, offs_ptr=torch.int32, out_ptr=torch.bfloat16)
    # (the decoded operand's conversion to the wgmma layout is asserted trivial by the kernel itself)
    kern = compile_sm90(rs._fp4_grouped_mm_sm90_rs, descs, ptrs, rs.constexprs(cfg, 96), num_warps=4 * cfg.WG,
                        maxnreg=cfg.maxnreg)
    ptx = kern.asm["ptx"]
    wgmma = re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n{cfg.BT}k16\.f32\.bf16\.bf16 \{{[^}}]*\}}, \{{", ptx)
    assert len(wgmma) == 8  # 2 stages x 4 x k16 a loop step, A from registers ("{" registers, not a descriptor)
    assert "mul.rn.bf16x2" in ptx and kern.metadata.shared <= rs.SMEM_BYTES
    groups, bad = inflight_a_writes(sass(kern))
    assert groups >= 2 and not bad, bad[:5]  # no register of an in-flight A operand rewritten before its wait


SASS_HAZARD = """
        /*0100*/                   HGMMA.64x128x16.F32.BF16 R24, R88, gdesc[UR12], R24, gsb0 ;
        /*0110*/                   IADD3 R5, R6, R7, RZ ;
        /*0120*/              @P1 BRA 0x0100 ;
        /*0130*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
"""


def test_inflight_check_finds_a_clobbered_operand():
    """The SASS check fires on a write to an in-flight A register (through a loop back-edge) and not otherwise."""
    assert inflight_a_writes(SASS_HAZARD) == (1, [])
    clobber = SASS_HAZARD.replace("IADD3 R5,", "IADD3 R90,")
    assert inflight_a_writes(clobber) == (1, ["IADD3 R90, R6, R7, RZ"])
    waited = clobber.replace("/*0110*/                   IADD3", "/*0110*/ WARPGROUP.DEPBAR.LE gsb0, 0x0 ; IADD3")
    assert inflight_a_writes(waited)[1] == []


def test_k_must_be_a_multiple_of_128():
    x = torch.zeros(4, 192, dtype=torch.bfloat16)
    assert rs.can_run(x, torch.zeros(2, 8, 96, dtype=torch.int8)) is False  # (and no GPU here)


# ---- GPU -----------------------------------------------------------------------------------------------------------
GPU_CASES = {  # experts, N, K, rows per expert, rows past offs[-1]
    "uniform": (8, 512, 512, [256] * 8, 0),
    "ragged": (8, 200, 384, [0, 300, 1, 77, 0, 130, 2, 500], 11),  # N not a multiple of the tile
    "one_expert_rows": (3, 256, 1024, [0, 64, 0], 5),
    "long_k": (4, 256, 5120, [200, 256, 0, 130], 3),  # the V4.1 w1 / w3 K: 40 loop steps of 2 stages
}


@gpu
@pytest.mark.parametrize("cfg", [rs.EP4_FIXED, rs.EP1_FIXED, rs.EP4_CHUNKED, rs.EP1_CHUNKED],
                         ids=["EP4", "EP1", "EP4_chunked", "EP1_chunked"])
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_gpu_rs_matches_fp64_and_repeats_bitwise(case, cfg):
    _gpu_ready()
    e, n, k, counts, extra = GPU_CASES[case]
    x, q, s, wp, ws, offs = make(e, n, k, counts, extra, seed=71 + len(case), device="cuda")
    out = torch.full((x.shape[0], n), POISON, dtype=torch.bfloat16, device="cuda")
    rs.launch_sm90_rs(x, wp, ws, offs, out, cfg)
    end = int(offs[-1])
    ref, mass = _reference(x, wp, ws, offs)
    _assert_close(out[:end], ref[:end], mass[:end])
    assert (out[end:] == POISON).all()  # rows past offs[-1]: never written
    for _ in range(4):  # the in-flight register operand: a race would change bits from run to run
        again = torch.full_like(out, POISON)
        rs.launch_sm90_rs(x, wp, ws, offs, again, cfg)
        assert torch.equal(again.view(torch.int16), out.view(torch.int16))


@gpu
def test_gpu_rs_at_v41_ep4_shape_repeats_bitwise():
    """The served shape (96 experts x 256 rows, w1/w3), several launches: bitwise equal every time and to the
    fp64 product's bound."""
    _gpu_ready()
    x, q, s, wp, ws, offs = make(96, 2304, 5120, [256] * 96, 0, seed=81, device="cuda")
    out = torch.empty(x.shape[0], 2304, dtype=torch.bfloat16, device="cuda")
    rs.launch_sm90_rs(x, wp, ws, offs, out)
    ref, mass = _reference(x[:4096], wp[:16], ws[:16], offs[:16])
    _assert_close(out[:4096], ref, mass)
    for _ in range(8):
        again = torch.empty_like(out)
        rs.launch_sm90_rs(x, wp, ws, offs, again)
        assert torch.equal(again.view(torch.int16), out.view(torch.int16))


def test_constexpr_arguments_are_plain_values():
    """Launch hooks (the compile pool's, round 15) serialise a kernel's arguments to JSON: no layout objects."""
    import json

    json.dumps(rs.constexprs(rs.EP4_FIXED, 96))

"""The Hopper Gluon path of minidi::fp4_grouped_mm (``minidi/ops/fp4_grouped_gemm_sm90.py``): bf16 activations, FP4
weights decoded to exact bf16 in shared memory, bf16 wgmma over the whole K.

CPU: the decode (``decode_ref``) equals ``dequant_fp4`` for all 16 codes x every E8M0 code it takes (2..252, 255 = NaN)
and gives NaN for the others; the kernel's PTX decode and its Gluon table arithmetic replayed in Python against it; the
device-side code-range flag (interpreter); which kernels the op launches on sm_90 (the range read on the host once per
weight tensor, the device gate while a graph is captured; launches stubbed, interpreter); (Triton 3.6 only) the kernel
compiling for sm_90a with pipelined wgmma. GPU (``gpu`` marker): the kernel vs the fp64 product on fresh random inputs,
poisoned outputs, ragged and empty experts, rows past offs[-1] untouched, N not a multiple of the tile; the op taking
this path and handing weights with an out-of-range code to the Triton kernel; NaN codes (255) giving NaN columns.
"""

from __future__ import annotations

import re

import pytest
import torch

from minidi import formats
from minidi.ops import fp4_grouped_gemm_hopper as hopper
from minidi.ops import fp4_grouped_gemm_sm90 as sm90
from minidi.ops import fp4_grouped_gemm_sm90_rs as rs
from minidi.ops.fp4_fold_device import code_range_flag
from minidi.ops.fp4_grouped_gemm import fp4_grouped_mm

from .gluon_compile import compile_sm90
from .test_fp8_grouped_gemm import POISON, abs_mass, fp64_reference, make
from .test_fp8_grouped_gemm_sm90 import _codes_rows, _pack, _prmt

gpu = pytest.mark.gpu
GOOD_CODES = list(range(hopper.CODE_LO, hopper.CODE_HI + 1)) + [hopper.CODE_NAN]
BAD_CODES = [0, 1, 253, 254]


# ---- the decode (plain torch) --------------------------------------------------------------------------------------
def _weights(codes_per_row: list[int], k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One expert, a row per E8M0 code (every 32-block of the row takes it), all 16 FP4 codes in every block."""
    codes = _codes_rows(len(codes_per_row), k, torch.Generator().manual_seed(seed))
    scale = torch.tensor(codes_per_row, dtype=torch.uint8)[:, None].repeat(1, k // 32)
    return _pack(codes)[None], scale.view(torch.float8_e8m0fnu)[None]


def test_decode_ref_equals_dequant_for_every_code_it_takes():
    wp, ws = _weights(GOOD_CODES, 64, seed=1)
    got = sm90.decode_ref(wp, ws)
    want = formats.dequant_fp4(wp, ws, torch.bfloat16)
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan) and bool(nan[0, -1].all()) and not nan[0, :-1].any()  # 255: all NaN
    assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))  # bitwise: signed zeros too


def test_decode_ref_poisons_codes_outside_its_range():
    wp, ws = _weights(BAD_CODES, 64, seed=2)
    assert torch.isnan(sm90.decode_ref(wp, ws)).all()


def _decode_word(p: int, tables: tuple[int, int, int, int]) -> list[int]:
    """Python replay of ``_DECODE_ASM`` (register by register): 8 codes -> 4 bf16x2 words."""
    lo0, lo1, hi0, hi1 = tables
    m = p & 0x77777777
    mh = m >> 16
    l0, h0 = _prmt(lo0, lo1, m), _prmt(hi0, hi1, m)
    l1, h1 = _prmt(lo0, lo1, mh), _prmt(hi0, hi1, mh)
    q = (p << 4) & 0xFFFFFFFF
    h0 |= _prmt(p, q, 0x1504) & 0x80808080
    h1 |= _prmt(p, q, 0x3726) & 0x80808080
    return [_prmt(l0, h0, 0x5140), _prmt(l0, h0, 0x7362), _prmt(l1, h1, 0x5140), _prmt(l1, h1, 0x7362)]


def _kernel_tables(c: int) -> tuple[int, int, int, int]:
    """The decoder's ``_tables`` (its Gluon integer code, replayed with int32 wrap-around)."""
    b7 = c << 7
    v = [b7 - 128, b7, b7 + 64, b7 + 128, b7 + 192, b7 + 256, b7 + 320]

    def byte(x: int, j: int) -> int:
        return (x & 0xFF) << (8 * j)

    lo0 = byte(v[0], 1) | byte(v[1], 2) | byte(v[2], 3)
    lo1 = byte(v[3], 0) | byte(v[4], 1) | byte(v[5], 2) | byte(v[6], 3)
    hi0 = byte(v[0] >> 8, 1) | byte(v[1] >> 8, 2) | byte(v[2] >> 8, 3)
    hi1 = byte(v[3] >> 8, 0) | byte(v[4] >> 8, 1) | byte(v[5] >> 8, 2) | byte(v[6] >> 8, 3)
    if c < hopper.CODE_LO or c > hopper.CODE_HI:
        return 0xC0C0C0C0, 0xC0C0C0C0, 0x7F7F7F7F, 0x7F7F7F7F
    return lo0 & 0xFFFFFFFF, lo1 & 0xFFFFFFFF, hi0 & 0xFFFFFFFF, hi1 & 0xFFFFFFFF


@pytest.mark.parametrize("c", [0, 1, 2, 3, 100, 127, 128, 251, 252, 253, 254, 255])
def test_kernel_tables_match_decode_tables(c):
    want = [int(t) & 0xFFFFFFFF for t in sm90.decode_tables(torch.tensor(c))]
    assert list(_kernel_tables(c)) == want


def test_kernel_decode_matches_decode_ref_on_all_codes():
    rows = [2, 3, 64, 126, 127, 128, 200, 251, 252, 255, 0, 1, 253, 254]
    wp, ws = _weights(rows, 64, seed=3)
    want = sm90.decode_ref(wp, ws)[0].view(torch.int16).to(torch.int32) & 0xFFFF  # [rows, 64] bf16 bit patterns
    words = wp[0].view(torch.uint8).contiguous().view(torch.int32)  # [rows, 8]: 8 codes per word, code j in nibble j
    for r, c in enumerate(rows):
        tables = _kernel_tables(c)
        got = []
        for w in words[r].tolist():
            for out in _decode_word(w & 0xFFFFFFFF, tables):
                got += [out & 0xFFFF, out >> 16]
        assert got == want[r].tolist(), f"row {r}, E8M0 code {c}"


# ---- the device-side range flag (interpreter on the CPU) -----------------------------------------------------------
@pytest.mark.parametrize("bad", [None, 0, 1, 253, 254])
@pytest.mark.interpreter
def test_code_range_flag(bad):
    ws = torch.full((3, 40, 9), 120, dtype=torch.uint8)
    ws[0, 0, 0], ws[2, 39, 8] = 2, 255  # in range: the extremes and NaN
    if bad is not None:
        ws[1, 17, 4] = bad
    flag = code_range_flag(ws.view(torch.float8_e8m0fnu), hopper.CODE_LO, hopper.CODE_HI)
    assert flag.dtype == torch.int32 and int(flag) == (bad is not None)
    fast, exact = hopper.range_gate(ws.view(torch.float8_e8m0fnu), torch.tensor([5, 9, 9], dtype=torch.int32))
    assert (fast.tolist(), exact.tolist()) == (([0, 0, 0], [5, 9, 9]) if bad is not None else ([5, 9, 9], [0, 0, 0]))


# ---- which kernels the op launches on sm_90 (both kernels' launches recorded; interpreter on the CPU) -------------
class _Launches:
    """Stand-ins for the op's launches: the Gluon kernel's (records the offs it got; fills its rows with GLUON) and
    the Triton kernel's (records its offs, then runs the real kernel), and a count of the host reads of the range."""

    GLUON = 7.0

    def __init__(self, monkeypatch):
        from minidi.ops import fp4_fold_device
        from minidi.ops import fp4_grouped_gemm as op_mod

        self.gluon, self.triton, self.reads = [], [], 0
        self.real_triton = real_triton = op_mod._launch_with_fallback
        real_flag = fp4_fold_device.code_range_flag

        def gluon(x, w_packed, w_scale, offs, out, config=None):
            self.gluon.append(offs.tolist())
            out[: int(offs[-1])] = self.GLUON

        def triton(x, w_packed, w_scale, offs, out):
            self.triton.append(offs.tolist())
            return real_triton(x, w_packed, w_scale, offs, out)

        def flag(*args):
            self.reads += 1
            return real_flag(*args)

        monkeypatch.delenv(hopper.ENV, raising=False)
        monkeypatch.setattr(hopper, "can_run", lambda x, w: True)
        monkeypatch.setattr(rs, "can_run", lambda x, w: True)
        monkeypatch.setattr(rs, "launch_sm90_rs", gluon)
        monkeypatch.setattr(op_mod, "_launch_with_fallback", triton)
        monkeypatch.setattr(fp4_fold_device, "code_range_flag", flag)


@pytest.mark.interpreter
def test_op_launches_only_the_gluon_kernel_once_the_range_is_known(monkeypatch):
    launches = _Launches(monkeypatch)
    x, q, s, wp, ws, offs = make(3, 64, 128, [5, 0, 11], 2, seed=71)
    for _ in range(3):
        out = fp4_grouped_mm(x, wp, ws, offs)
        assert (out[:16] == _Launches.GLUON).all()
    assert launches.gluon == [[5, 5, 16]] * 3 and launches.triton == []
    assert launches.reads == 1  # one host read for the weight tensor, none after
    ws.view(torch.uint8)[1, 3, 2] = 0  # in place: the version moves, the range is read again
    fp4_grouped_mm(x, wp, ws, offs)
    assert launches.reads == 2 and launches.gluon == [[5, 5, 16]] * 3 and launches.triton == [[5, 5, 16]]


@pytest.mark.interpreter
def test_op_gives_every_row_to_triton_when_a_code_is_out_of_range(monkeypatch):
    launches = _Launches(monkeypatch)
    x, q, s, wp, ws, offs = make(3, 64, 128, [5, 0, 11], 2, seed=72)
    ws.view(torch.uint8)[2, 63, 3] = 1  # (2^-126: below the exact decodes)
    out = fp4_grouped_mm(x, wp, ws, offs)
    assert launches.gluon == [] and launches.triton == [[5, 5, 16]]
    want = torch.full_like(out, POISON)
    launches.real_triton(x, wp, ws, offs, want)  # the Triton kernel's own numerics: tests/ops/test_fp4_grouped_gemm.py
    assert torch.equal(out[:16], want[:16])


@pytest.mark.interpreter
@pytest.mark.parametrize("bad", [False, True])
def test_op_gates_on_the_device_while_a_graph_is_captured(monkeypatch, bad):
    from minidi.ops import fp4_fold_device

    launches = _Launches(monkeypatch)
    monkeypatch.setattr(fp4_fold_device, "_capturing", lambda t: True)
    x, q, s, wp, ws, offs = make(3, 64, 128, [5, 0, 11], 2, seed=73)
    if bad:
        ws.view(torch.uint8)[0, 0, 0] = 1
    fp4_grouped_mm(x, wp, ws, offs)
    fast, exact = ([0, 0, 0], [5, 5, 16]) if bad else ([5, 5, 16], [0, 0, 0])
    assert launches.gluon == [fast] and launches.triton == [exact] and launches.reads == 1  # the device flag's pass


def test_range_is_not_read_on_the_host_for_an_inference_tensor():
    from minidi.ops import fp4_fold_device

    with torch.inference_mode():
        ws = torch.full((2, 8, 4), 120, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    assert fp4_fold_device.code_range_known(ws, hopper.CODE_LO, hopper.CODE_HI) is None


def test_module_is_inert_without_a_hopper_gpu():
    x = torch.zeros(4, 128, dtype=torch.bfloat16)
    assert hopper.can_run(x, torch.zeros(2, 8, 64, dtype=torch.int8)) is False


@pytest.mark.parametrize("cfg", [sm90.EP4, sm90.EP1], ids=["EP4", "EP1"])
def test_default_configs_fit_the_register_file(cfg):
    cfg.check()  # threads (worker warps padded to warpgroups) x maxnreg <= 64K: the H200 launches it
    assert cfg.threads() == 512


def test_a_config_over_the_register_file_is_refused_clearly():
    import dataclasses

    with pytest.raises(ValueError, match="exceed the 65,536 registers"):
        dataclasses.replace(sm90.WIDE, maxnreg=184).check()  # 12 warps x 184: Triton's "out of resource: threads"
    sm90.WIDE.check()  # 12 warps x 168


def test_opt_out_switch(monkeypatch):
    monkeypatch.delenv(hopper.ENV, raising=False)
    assert hopper.enabled() and hopper.hopper_kernel() == "rs"  # the register-operand kernel by default (round 18)
    for value, kernel in (("rs", "rs"), ("1", "rs"), ("ws", "ws"), ("0", None)):
        monkeypatch.setenv(hopper.ENV, value)
        assert hopper.hopper_kernel() == kernel and hopper.enabled() == (kernel is not None)
    monkeypatch.setenv(hopper.ENV, "fast")
    with pytest.raises(ValueError, match="MINIDI_FP4_GEMM_SM90='fast'"):
        hopper.hopper_kernel()


# ---- compiles for sm_90a on the CPU (Triton's compiler and ptxas need no GPU) -----------------------------------
@pytest.mark.skipif(not hopper.gluon_supported(), reason="Gluon API of a tested Triton version (3.6) not installed")
@pytest.mark.parametrize("cfg", [sm90.EP4, sm90.EP1, sm90.WIDE], ids=["EP4", "EP1", "WIDE"])
def test_kernel_compiles_for_sm90a_with_pipelined_wgmma(cfg):
    pytest.importorskip("triton.backends.nvidia.compiler")
    e, n, k, r = 4, 512, 512, 512
    x = torch.empty(r, k, dtype=torch.bfloat16)
    wp = torch.empty(e, n, k // 2, dtype=torch.int8)
    descs = dict(zip(("x_desc", "w_desc"), sm90.descriptors(x, wp, cfg)))
    ptrs = dict(ws_ptr=torch.uint8, offs_ptr=torch.int32, out_ptr=torch.bfloat16)
    consts = dict(BM=cfg.BM, BN=cfg.BN, NS=cfg.NS, E_POW2=512, WM=cfg.WM, WN=cfg.WN, DW=cfg.dec_warps,
                  DEC_REGS=cfg.dec_regs, RPT=cfg.dec_rows, DECODE_ASM=sm90._DECODE_ASM, LO=hopper.CODE_LO,
                  HI=hopper.CODE_HI)
    kern = compile_sm90(sm90._fp4_grouped_mm_sm90, descs, ptrs, consts, num_warps=4 * cfg.WM * cfg.WN,
                        maxnreg=cfg.maxnreg)
    ptx = kern.asm["ptx"]
    shape = f"m64n{cfg.BN // cfg.WN}k16"
    assert len(re.findall(rf"wgmma\.mma_async\.sync\.aligned\.{shape}\.f32\.bf16\.bf16", ptx)) == 4  # 4 x k16
    assert "wgmma.wait_group.sync.aligned 1;" in ptx  # one stage left in flight
    assert "setmaxnreg" in ptx and "prmt.b32" in ptx
    assert kern.metadata.shared <= 232448  # the H200's shared memory per block


# ---- GPU -----------------------------------------------------------------------------------------------------------
def _gpu_ready() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if torch.cuda.get_device_capability() != (9, 0) or not hopper.gluon_supported():
        pytest.skip("needs sm_90 and Triton 3.6's Gluon")


GPU_CASES = {  # experts, N, K, rows per expert, rows past offs[-1]
    "uniform": (8, 512, 512, [256] * 8, 0),
    "ragged": (8, 200, 384, [0, 300, 1, 77, 0, 130, 2, 500], 11),  # N not a multiple of the tile
    "one_expert_rows": (3, 256, 1024, [0, 64, 0], 5),
}


def _reference(x: torch.Tensor, wp: torch.Tensor, ws: torch.Tensor, offs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """fp64 product of x itself (bf16, exact; the FP8 tests' helpers take fq8 splits, here every scale is 1) and
    its sum |x| |w|."""
    ones = torch.ones(x.shape[0], x.shape[1] // 32, dtype=torch.float32, device=x.device)
    return fp64_reference(x, ones, wp, ws, offs), abs_mass(x, ones, wp, ws, offs)


def _assert_close(out: torch.Tensor, ref: torch.Tensor, mass: torch.Tensor) -> None:
    """bf16 output: its rounding (2^-8 relative) plus the tensor core's fp32 accumulation (2^-16 of sum |x| |w|, a
    bound far above fp32's and far below any indexing or decode error)."""
    err = (out.double().cpu() - ref).abs()
    bound = 2**-8 * ref.abs() + 2**-16 * mass + 1e-30
    assert bool((err <= bound).all()), float((err / bound).max())


@gpu
@pytest.mark.parametrize("cfg", [sm90.EP4, sm90.EP1, sm90.WIDE], ids=["EP4", "EP1", "WIDE"])
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_gpu_sm90_matches_fp64(case, cfg):
    _gpu_ready()
    e, n, k, counts, extra = GPU_CASES[case]
    x, q, s, wp, ws, offs = make(e, n, k, counts, extra, seed=41 + len(case), device="cuda")
    out = torch.full((x.shape[0], n), POISON, dtype=torch.bfloat16, device="cuda")
    sm90.launch_sm90(x, wp, ws, offs, out, cfg)
    end = int(offs[-1])
    ref, mass = _reference(x, wp, ws, offs)
    _assert_close(out[:end], ref[:end], mass[:end])
    assert (out[end:] == POISON).all()  # rows past offs[-1]: never written


@gpu
def test_gpu_op_takes_the_sm90_path_and_hands_out_of_range_codes_to_triton(monkeypatch):
    _gpu_ready()
    monkeypatch.delenv(hopper.ENV, raising=False)
    assert hopper.enabled()
    x, q, s, wp, ws, offs = make(4, 256, 512, [100, 0, 37, 200], 0, seed=51, device="cuda")
    _assert_close(fp4_grouped_mm(x, wp, ws, offs), *_reference(x, wp, ws, offs))
    ws2 = ws.view(torch.uint8).clone()
    ws2[2, 5, 0] = 1  # one tiny block: the exponent-add decode would not be exact
    ws2 = ws2.view(torch.float8_e8m0fnu)
    assert int(code_range_flag(ws2, hopper.CODE_LO, hopper.CODE_HI)) == 1
    out = fp4_grouped_mm(x, wp, ws2, offs)  # the Triton kernel, every row
    _assert_close(out, *_reference(x, wp, ws2, offs))


@gpu
@pytest.mark.parametrize("launch", [sm90.launch_sm90, rs.launch_sm90_rs], ids=["ws", "rs"])
def test_gpu_nan_code_gives_nan_columns(launch):
    _gpu_ready()
    x, q, s, wp, ws, offs = make(2, 128, 256, [64, 64], 0, seed=61, device="cuda")
    ws2 = ws.view(torch.uint8).clone()
    ws2[1, 7, 3] = 255
    out = torch.full((128, 128), POISON, dtype=torch.bfloat16, device="cuda")
    launch(x, wp, ws2.view(torch.float8_e8m0fnu), offs, out)
    assert torch.isnan(out[64:, 7]).all() and not torch.isnan(out[:64]).any()
    good = torch.ones(128, 128, dtype=torch.bool)
    good[64:, 7] = False
    ref, mass = _reference(x, wp, ws, offs)
    _assert_close(torch.where(good.cuda(), out, 0), torch.where(good, ref, 0), torch.where(good, mass, 0))

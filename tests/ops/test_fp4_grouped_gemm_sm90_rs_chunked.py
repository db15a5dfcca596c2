"""Chunked tiles of the register-operand Hopper kernel (``fp4_grouped_gemm_sm90_rs.py``, ``RsConfig.chunked``, round
25): a tile holds ceil(rows / 64) 64-row chunks of one expert (up to BT), the loader fetches only those, the MMA
partition runs a K loop specialised to the chunk count, and with ``ahead`` one MMA group stays queued (wgmma wait(1))
while the next stage decodes.

CPU: configs are checked clearly and give the MMA warps the registers the compile needs; (Triton 3.6 only) the kernel
compiles for sm_90a with an asynchronous wgmma group per chunk count (no serialisation), no local-memory spills, and no
write to the A registers of a group still in flight, counting the groups a wait(N) leaves running
(``gluon_compile.inflight_a_writes`` with ``count_waits``, checked here on hand-written hazards). GPU (``gpu`` marker):
every chunk count and tile boundary (0, 1, 63, 64, 65, 255, 256, 257, 300, 511, 513 rows per expert), empty experts, N
not a multiple of the tile, rows past offs[-1] never written (poisoned), repeated launches bitwise equal, against the
fp64 product of the dequantised weights; the V4.1 EP4 shape on balanced loads.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from minidi.ops import fp4_grouped_gemm_hopper as hopper
from minidi.ops import fp4_grouped_gemm_sm90_rs as rs

from .gluon_compile import compile_sm90, inflight_a_writes, sass
from .test_fp4_grouped_gemm_sm90 import _assert_close, _gpu_ready, _reference
from .test_fp8_grouped_gemm import POISON, make

gpu = pytest.mark.gpu
CHUNKED = {"EP4": rs.EP4_CHUNKED, "EP1": rs.EP1_CHUNKED, "BT64": dataclasses.replace(rs.EP1_CHUNKED, BT=64, NS=10),
           "EP4_waits": dataclasses.replace(rs.EP4_CHUNKED, ahead=False),
           "EP4_S5": dataclasses.replace(rs.EP4_CHUNKED, NS=5)}


# ---- the SASS walk (``gluon_compile.inflight_a_writes`` with ``count_waits``) ------------------------------------
SASS_AHEAD = """
        /*0100*/                   HGMMA.64x128x16.F32.BF16 R24, R88, gdesc[UR12], R24, gsb0 ;
        /*0110*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;
        /*0120*/                   IADD3 R5, R6, R7, RZ ;
        /*0130*/                   HGMMA.64x128x16.F32.BF16 R24, R100, gdesc[UR12], R24, gsb0 ;
        /*0140*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;
        /*0150*/                   IADD3 R89, R6, R7, RZ ;
"""


def test_wait_counting_walk_finds_a_clobbered_operand():
    """A wait(1) right after a group leaves it running: a write to its A registers there is a hazard; after the next
    group's wait(1) it is not (the first group is done)."""
    assert inflight_a_writes(SASS_AHEAD, count_waits=True) == (2, [])
    clobber = SASS_AHEAD.replace("IADD3 R5,", "IADD3 R90,")
    assert inflight_a_writes(clobber, count_waits=True) == (2, ["IADD3 R90, R6, R7, RZ"])
    second = SASS_AHEAD.replace("IADD3 R89,", "IADD3 R101,")  # the second group is still running there
    assert inflight_a_writes(second, count_waits=True)[1] == ["IADD3 R101, R6, R7, RZ"]


# ---- configs -------------------------------------------------------------------------------------------------------
def test_chunked_configs_are_checked_clearly():
    for cfg in CHUNKED.values():
        cfg.check()
    assert rs.EP4_CHUNKED.mma_regs() == 240 and rs.EP4_FIXED.mma_regs() == 208
    with pytest.raises(ValueError, match="BT must be"):
        dataclasses.replace(rs.EP4_FIXED, BT=256).check()  # (fixed 256-row tiles: not built)
    with pytest.raises(ValueError, match="always overlap"):
        dataclasses.replace(rs.EP4_CHUNKED, overlap=False).check()
    with pytest.raises(ValueError, match="chunked kernel's"):
        dataclasses.replace(rs.EP4_FIXED, ahead=True).check()
    with pytest.raises(ValueError, match="shared memory"):
        dataclasses.replace(rs.EP4_CHUNKED, NS=6).check()


def test_constexprs_are_plain_values():
    import json

    json.dumps(rs.constexprs(rs.EP4_CHUNKED, 96))


# ---- compiles for sm_90a on the CPU --------------------------------------------------------------------------------
def _groups_per_k_loop(bt: int) -> int:
    """Commit groups in the SASS: per chunk count 1..BT/64, two stages a loop step, one group a stage (two for three
    chunks: N 128 + 64)."""
    return sum(2 * (2 if c == 3 else 1) for c in range(1, bt // 64 + 1))


@pytest.mark.skipif(not hopper.gluon_supported(), reason="Gluon API of a tested Triton version (3.6) not installed")
@pytest.mark.parametrize("name", list(CHUNKED))
def test_chunked_kernel_compiles_async_without_spills_or_hazards(name):
    pytest.importorskip("triton.backends.nvidia.compiler")
    cfg = CHUNKED[name]
    x = torch.empty(512, 512, dtype=torch.bfloat16)
    wp = torch.empty(4, 512, 256, dtype=torch.int8)
    descs = dict(zip(("x_desc", "w_desc"), rs.descriptors(x, wp, cfg)))
    ptrs = dict(ws_ptr=torch.uint8, offs_ptr=torch.int32, out_ptr=torch.bfloat16)
    kern = compile_sm90(rs.kernel_for(cfg), descs, ptrs, rs.constexprs(cfg, 96), num_warps=4 * cfg.WG,
                        maxnreg=cfg.maxnreg)
    ptx, code = kern.asm["ptx"], sass(kern)
    shapes = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16\.f32\.bf16\.bf16 \{[^}]*\}, \{", ptx))
    assert shapes == {str(n) for n in (64, 128, 256) if n <= cfg.BT}  # A from registers ("{"), every chunk count
    assert re.search(rf"setmaxnreg\.\w+\.sync\.aligned\.u32\s+{cfg.mma_regs()};", ptx)  # the MMA warps' budget
    assert "LDL" not in code and "STL" not in code  # no local memory: no spills
    groups, bad = inflight_a_writes(code, count_waits=True)
    assert groups == _groups_per_k_loop(cfg.BT)  # (ptxas serialising the wgmmas makes one group per instruction)
    assert not bad, bad[:5]
    assert kern.metadata.shared <= cfg.smem_bytes() <= rs.SMEM_BYTES  # (the config's bound holds)


# ---- GPU -----------------------------------------------------------------------------------------------------------
EDGE_ROWS = [0, 1, 63, 64, 65, 255, 256, 257, 300, 511, 513]  # every chunk count, tile boundaries of 64 / 128 / 256


@gpu
@pytest.mark.parametrize("name", list(CHUNKED))
@pytest.mark.parametrize("n, k", [(200, 384), (256, 1024)], ids=["n200_k384", "n256_k1024"])
def test_gpu_chunked_matches_fp64_on_edge_rows_and_repeats_bitwise(name, n, k):
    _gpu_ready()
    cfg = CHUNKED[name]
    counts = EDGE_ROWS + [0, 7]  # (an empty expert between loaded ones, a last small one)
    x, q, s, wp, ws, offs = make(len(counts), n, k, counts, 13, seed=91 + n + k, device="cuda")
    out = torch.full((x.shape[0], n), POISON, dtype=torch.bfloat16, device="cuda")
    rs.launch_sm90_rs(x, wp, ws, offs, out, cfg)
    end = int(offs[-1])
    ref, mass = _reference(x, wp, ws, offs)
    _assert_close(out[:end], ref[:end], mass[:end])
    assert (out[end:] == POISON).all()  # rows past offs[-1]: never written
    for _ in range(4):  # a race on the in-flight register operands or the chunk loads would change bits
        again = torch.full_like(out, POISON)
        rs.launch_sm90_rs(x, wp, ws, offs, again, cfg)
        assert torch.equal(again.view(torch.int16), out.view(torch.int16))


@gpu
@pytest.mark.parametrize("name", ["EP4", "EP1"])
def test_gpu_chunked_all_experts_empty_but_one(name):
    _gpu_ready()
    counts = [0, 0, 0, 129, 0]
    x, q, s, wp, ws, offs = make(5, 128, 256, counts, 4, seed=5, device="cuda")
    out = torch.full((x.shape[0], 128), POISON, dtype=torch.bfloat16, device="cuda")
    rs.launch_sm90_rs(x, wp, ws, offs, out, CHUNKED[name])
    ref, mass = _reference(x, wp, ws, offs)
    _assert_close(out[:129], ref[:129], mass[:129])
    assert (out[129:] == POISON).all()


@gpu
def test_gpu_chunked_at_v41_ep4_shape_on_balanced_loads():
    """The served shape (96 experts, w1/w3) with the step's ragged loads (cv ~0.15): the first 16 experts against the
    fp64 product, several launches bitwise equal."""
    _gpu_ready()
    gen = torch.Generator().manual_seed(3)
    p = torch.exp(0.14 * torch.randn(96, generator=gen))
    counts = torch.multinomial(p / p.sum(), 96 * 256, replacement=True, generator=gen).bincount(minlength=96)
    x, q, s, wp, ws, offs = make(96, 2304, 5120, counts.tolist(), 0, seed=82, device="cuda")
    out = torch.empty(x.shape[0], 2304, dtype=torch.bfloat16, device="cuda")
    rs.launch_sm90_rs(x, wp, ws, offs, out, rs.EP4_CHUNKED)
    end16 = int(offs[15])
    ref, mass = _reference(x[:end16], wp[:16], ws[:16], offs[:16])
    _assert_close(out[:end16], ref, mass)
    for _ in range(6):
        again = torch.empty_like(out)
        rs.launch_sm90_rs(x, wp, ws, offs, again, rs.EP4_CHUNKED)
        assert torch.equal(again.view(torch.int16), out.view(torch.int16))

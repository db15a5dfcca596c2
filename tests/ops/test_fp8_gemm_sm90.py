"""The Hopper Gluon block-scaled FP8 dense GEMM (``minidi/ops/fp8_gemm_sm90.py``).

CPU: the module is inert without a Hopper GPU; the plain-torch reference equals the model's path
(``F.linear(fq8(x), dequant_fp8(w))``) on fq8 inputs; argument checks; and (Triton 3.6 only) the kernel compiles for
sm_90a with the wgmmas intended (m64nBNk32 e4m3, one in flight at each wait), setmaxnreg, the promotion as FFMAs and
no local memory. GPU (``gpu`` marker): the kernel vs the fp64 product on fresh random inputs, poisoned outputs, ragged
M and N, both block sizes, both pipeline modes; repeated launches bitwise identical; E8M0 code 255 makes its columns
NaN.

Tolerance (GPU): every product is exact (e4m3 x e4m3 times powers of two); the fp32 sums run in another order and
the FP8 tensor core sums a block's products in a narrower accumulator than fp32 (DeepGEMM measured ~14 bits), so an
element may be off by a fraction of sum |x| |w| over its products, plus its one rounding to the output dtype (2^-8
relative for bf16; 1e-5 for fp32). Measured on the H100 (fp32 output, 4 shapes up to 4096 x 1280 x 5120): max
|err| / sum |x| |w| = 9.8e-5 (2^-13.3) with 32-blocks (one k32 wgmma per block) and 2.3e-4 (2^-12.1) with 128-blocks
(4 chained k32 wgmmas accumulate inside the tensor core). Bounds: 2^-12 and 2^-11 (2x margin).
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
import torch.nn.functional as F

from minidi import formats
from minidi.ops import fp8_gemm_sm90 as g
from minidi.ops.fp8_gemm import fp8_gemm_ref

gpu = pytest.mark.gpu
POISON = 12345.0


def make(m: int, n: int, k: int, block: int, seed: int, device: str = "cpu"):
    """x [M, K] bf16 with per-block magnitudes spread over 2^-6..2^5, its fq8 split, and a weight [N, K] e4m3 with
    random E8M0 codes 118..133 per block x block tile."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=gen)
         * torch.exp2(torch.randint(-6, 6, (m, k // block), generator=gen).float()).repeat_interleave(block, 1))
    q, s = formats.fq8_split(x.bfloat16(), block)
    w = (torch.randn(n, k, generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    codes = torch.randint(118, 134, (-(-n // block), k // block), generator=gen, dtype=torch.uint8)
    return [t.to(device) for t in (x.bfloat16(), q, s, w, codes)]


def fp64_ref_and_mass(q, s, w, codes, block):
    """(sum_k x w, sum_k |x| |w|) in fp64 on the CPU."""
    n = w.shape[0]
    x = q.cpu().double() * s.cpu().double().repeat_interleave(block, 1)
    sw = formats.e8m0_to_float(codes.cpu()).double().repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)
    wd = w.cpu().double() * sw
    return x @ wd.t(), x.abs() @ wd.abs().t()


MASS_BOUND = {32: 2**-12, 128: 2**-11}


def assert_close(out, ref, mass, dtype, block):
    rtol = 1e-5 if dtype == torch.float32 else 2**-8
    err = (out.double().cpu() - ref).abs()
    bound = rtol * ref.abs() + MASS_BOUND[block] * mass + 1e-30
    ratio = float((err / bound).max())
    assert bool((err <= bound).all()), f"max err / bound {ratio:.3g}"
    return ratio


# ---- CPU -----------------------------------------------------------------------------------------------------------
def test_module_is_inert_without_a_hopper_gpu():
    q = torch.zeros(4, 128, dtype=torch.float8_e4m3fn)
    w = torch.zeros(8, 128, dtype=torch.float8_e4m3fn)
    assert g.can_run(q, w, 32) is False
    assert isinstance(g.gluon_supported(), bool)


@pytest.mark.parametrize("block", [32, 128])
def test_reference_equals_the_models_bf16_path(block):
    """fp8_gemm_ref on the split = F.linear(fq8(x), dequant_fp8(w)) up to the order of the sums (fp32 here)."""
    x, q, s, w, codes = make(37, 72, 256, block, seed=block)
    ref = fp8_gemm_ref(q, s, w, codes, block, torch.float32)
    xq = formats.fq8_split(x, block)
    xf = (xq[0].float() * xq[1].repeat_interleave(block, 1))
    want = F.linear(xf, formats.dequant_fp8(w, codes, block, torch.float32))
    torch.testing.assert_close(ref, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    assert torch.equal(fp8_gemm_ref(q, s, w, formats.e8m0_to_float(codes), block, torch.float32), ref)


def test_reference_propagates_nan_scale_code():
    x, q, s, w, codes = make(5, 64, 128, 32, seed=3)
    codes[1, 2] = 255  # weight rows 32..63, K block 2
    ref = fp8_gemm_ref(q, s, w, codes, 32, torch.float32)
    assert torch.isnan(ref[:, 32:64]).all() and not torch.isnan(ref[:, :32]).any()


@pytest.mark.parametrize("what,args,msg", [
    ("block", dict(block=64), "block must be one of"),
    ("q dtype", dict(q=torch.zeros(4, 128)), "q must be"),
    ("w dtype", dict(w=torch.zeros(8, 128, dtype=torch.bfloat16)), "w must be"),
    ("K mismatch", dict(w=torch.zeros(8, 256, dtype=torch.float8_e4m3fn)), "is not w's K"),
    ("s_x shape", dict(s_x=torch.zeros(4, 3)), "s_x must be"),
    ("s_x dtype", dict(s_x=torch.zeros(4, 4, dtype=torch.bfloat16)), "s_x must be"),
    ("w_scale shape", dict(w_scale=torch.zeros(2, 4, dtype=torch.uint8)), "w_scale must be"),
    ("w_scale dtype", dict(w_scale=torch.zeros(1, 4, dtype=torch.int32)), "w_scale must be"),
    ("out dtype", dict(out_dtype=torch.int8), "out_dtype must be"),
])
def test_argument_checks_name_what_is_wrong(what, args, msg):
    base = dict(q=torch.zeros(4, 128, dtype=torch.float8_e4m3fn), s_x=torch.zeros(4, 4),
                w=torch.zeros(8, 128, dtype=torch.float8_e4m3fn), w_scale=torch.zeros(1, 4, dtype=torch.uint8),
                block=32, out_dtype=torch.bfloat16)
    base.update(args)
    with pytest.raises(ValueError, match=msg):
        fp8_gemm_ref(**base)
    with pytest.raises(ValueError, match=msg):
        g.fp8_gemm_sm90(**base)


def test_launcher_refuses_cpu_tensors_clearly():
    x, q, s, w, codes = make(4, 32, 128, 32, seed=1)
    with pytest.raises(ValueError, match="cannot run here"):
        g.fp8_gemm_sm90(q, s, w, codes, 32)


# ---- compiles for sm_90a on the CPU (Triton's compiler and ptxas need no GPU) -----------------------------------
C = g.Fp8GemmSm90Config
COMPILE_CASES = {"b32": (32, C(EPI_TMA=False)), "b128": (128, C(EPI_TMA=False)),
                 "b32_sync": (32, C(EPI_TMA=False, PIPE=False)), "b32_tma_store": (32, C(EPI_TMA=True)),
                 "b128_prefetch": (128, C(EPI_TMA=False, PREFETCH=True))}


@pytest.mark.skipif(not g.HAVE_GLUON, reason="no Gluon in this Triton")
def test_descriptor_layouts_are_the_defaults_built_once():
    """The host side of a call: the TMA boxes' shared layouts are Gluon's defaults for each box, and the same objects
    on every call (kept: building them was most of ``descriptors``' host time)."""
    gl = g.gl
    q, w = torch.empty(256, 512, dtype=torch.float8_e4m3fn), torch.empty(384, 512, dtype=torch.float8_e4m3fn)
    sx, sw, out = torch.empty(256, 16), torch.empty(16, 12), torch.empty(256, 384, dtype=torch.bfloat16)
    first = g.descriptors(q, sx, w, sw, 32, g.DEFAULT, out)
    again = g.descriptors(q, sx, w, sw, 32, g.DEFAULT, out)
    want = [([g.BM, g.BKC], gl.float8e4nv), ([g.DEFAULT.BN, g.BKC], gl.float8e4nv), None, None,
            ([g.BM, g.DEFAULT.BN], gl.bfloat16)]
    for d, d2, box in zip(first, again, want):
        if box is not None:
            assert d.layout == gl.NVMMASharedLayout.get_default_for(*box) and d.layout is d2.layout
            assert list(d.block_shape) == box[0]


@pytest.mark.skipif(not g.gluon_supported(), reason="Gluon API of a tested Triton version (3.6) not installed")
@pytest.mark.parametrize("case", list(COMPILE_CASES))
def test_kernel_compiles_for_sm90a_with_pipelined_wgmma(case):
    pytest.importorskip("triton.backends.nvidia.compiler")
    import subprocess
    import tempfile

    from triton import knobs

    from .gluon_compile import compile_sm90, sass

    block, cfg = COMPILE_CASES[case]
    m, n, k = 512, 384, 1024
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn)
    w = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    sx = torch.empty(m, k // block)
    sw = torch.empty(k // block, 16)
    out = torch.empty(m, n, dtype=torch.bfloat16) if cfg.EPI_TMA else None
    names = ("a_desc", "b_desc", "sx_desc", "sw_desc", "c_desc")
    descs = dict(zip(names, g.descriptors(q, sx, w, sw, block, cfg, out)))
    ptrs = dict(sx_ptr=torch.float32, sw_ptr=torch.float32, out_ptr=torch.bfloat16)
    consts = dict(BN=cfg.BN, NS=cfg.NS, GROUP_M=cfg.GROUP_M, BLK=block, U=cfg.U, PIPE=cfg.PIPE, ABLATE=cfg.ABLATE,
                  EPI_TMA=cfg.EPI_TMA, PREFETCH=cfg.PREFETCH)
    kern = compile_sm90(g._fp8_gemm_sm90_gluon, descs, ptrs, consts, num_warps=8, maxnreg=cfg.maxnreg)
    ptx = kern.asm["ptx"]
    blocks = cfg.U * 128 // block  # K blocks per loop iteration
    mmas = re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n{cfg.BN}k32\.f32\.e4m3\.e4m3", ptx)
    assert len(mmas) == blocks * block // 32
    # PIPE: each block's wait leaves the next block's MMA in flight; the iteration's last wait drains
    assert len(re.findall(r"wgmma\.wait_group\.sync\.aligned 1;", ptx)) == (blocks - 1 if cfg.PIPE else 0)
    assert ("cp.async.bulk.tensor.2d.global.shared" in ptx) == cfg.EPI_TMA
    assert "setmaxnreg.inc.sync.aligned.u32" in ptx and "setmaxnreg.dec.sync.aligned.u32" in ptx
    text = sass(kern)
    assert len(re.findall(r"QGMMA\.64x\d+x32\.F32\.E4M3\.E4M3", text)) == len(mmas)
    # one FFMA per accumulator element per block: 64 x BN / 128 per thread per block
    assert len(re.findall(r"\bFFMA\b", text)) == blocks * cfg.BN // 2
    assert not re.search(r"\b(LDL|STL)\b", text)  # no local memory (spills)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kern.asm["cubin"])
        f.flush()
        res = subprocess.run([knobs.nvidia.cuobjdump.path, "-res-usage", f.name], capture_output=True, text=True,
                             check=True).stdout
    assert re.search(r"STACK:0 ", res) and re.search(r"LOCAL:0 ", res), res


# ---- GPU -----------------------------------------------------------------------------------------------------------
def _gpu_ready() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if torch.cuda.get_device_capability() != (9, 0) or not g.gluon_supported():
        pytest.skip("needs sm_90 and Triton 3.6's Gluon")


GPU_SHAPES = [(1, 256, 512), (77, 200, 384), (300, 1280, 1280), (4096, 384, 2304), (129, 96, 1024)]


@gpu
@pytest.mark.parametrize("cfg", [g.Fp8GemmSm90Config(EPI_TMA=False), g.Fp8GemmSm90Config(EPI_TMA=False, PIPE=False),
                                 g.Fp8GemmSm90Config(EPI_TMA=True, U=1, PREFETCH=True)],
                         ids=["masked_store", "sync", "tma_store_prefetch"])
@pytest.mark.parametrize("block", [32, 128])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=[f"{m}x{n}x{k}" for m, n, k in GPU_SHAPES])
def test_gpu_matches_fp64(shape, block, cfg):
    _gpu_ready()
    m, n, k = shape
    x, q, s, w, codes = make(m, n, k, block, seed=m + n + k + block, device="cuda")
    ref, mass = fp64_ref_and_mass(q, s, w, codes, block)
    # output rows of n + 1 .. n + 8 columns: 16-byte aligned (the bulk-store epilogue runs) or not (masked stores)
    for dtype, width in [(d, wd) for d in (torch.bfloat16, torch.float32) for wd in (-(-(n + 1) // 8) * 8, n + 5)]:
        pad = torch.full((m + 3, width), POISON, dtype=dtype, device="cuda")
        out = pad[:m, :n]
        g.fp8_gemm_sm90(q, s, w, codes, block, dtype, config=cfg, out=out)
        torch.cuda.synchronize()
        assert_close(out, ref, mass, dtype, block)
        assert (pad[m:] == POISON).all() and (pad[:, n:] == POISON).all()  # rows >= M, columns >= N untouched


@gpu
@pytest.mark.parametrize("block", [32, 128])
def test_gpu_fp32_scales_and_bitwise_repeatable(block):
    _gpu_ready()
    x, q, s, w, codes = make(1000, 640, 2560, block, seed=5, device="cuda")
    y0 = g.fp8_gemm_sm90(q, s, w, codes, block, config=dataclasses.replace(g.DEFAULT, EPI_TMA=False))
    sw = formats.e8m0_to_float(codes)
    for _ in range(3):
        assert torch.equal(g.fp8_gemm_sm90(q, s, w, sw, block), y0)
    ref, mass = fp64_ref_and_mass(q, s, w, codes, block)
    assert_close(y0, ref, mass, torch.bfloat16, block)
    if block == 32:  # the bulk-store epilogue (contiguous output) gives the same bits
        assert torch.equal(g.fp8_gemm_sm90(q, s, w, codes, block, config=dataclasses.replace(g.DEFAULT, EPI_TMA=True)),
                           y0)


@gpu
@pytest.mark.parametrize("block", [32, 128])
def test_gpu_nan_scale_code_propagates(block):
    _gpu_ready()
    x, q, s, w, codes = make(130, 3 * block + 8, 512, block, seed=9, device="cuda")
    codes[1, 2] = 255  # weight rows block..2 block-1, K block 2
    codes[0, 1] = 0  # 2^-127: finite
    out = g.fp8_gemm_sm90(q, s, w, codes, block, torch.float32)
    assert torch.isnan(out[:, block:2 * block]).all()
    assert not torch.isnan(out[:, :block]).any() and not torch.isnan(out[:, 2 * block:]).any()
    ref, mass = fp64_ref_and_mass(q, s, w, codes, block)
    keep = torch.ones(out.shape[1], dtype=torch.bool)
    keep[block:2 * block] = False
    assert_close(out[:, keep.cuda()], ref[:, keep], mass[:, keep], torch.float32, block)


@gpu
def test_gpu_matches_the_bf16_path_within_its_rounding():
    """The op it replaces: F.linear(fq8(x), dequant_fp8(w)) in bf16 (the same products, other sum order)."""
    _gpu_ready()
    from minidi.ops.fp8_quant import fq8_split

    x, _, _, w, codes = make(512, 1280, 5120, 32, seed=13, device="cuda")
    q, s = fq8_split(x, 32)
    y = g.fp8_gemm_sm90(q, s, w, codes, 32)
    y16 = F.linear(q.bfloat16() * s.repeat_interleave(32, 1).bfloat16(), formats.dequant_fp8(w, codes, 32,
                                                                                               torch.bfloat16))
    err = (y.float() - y16.float()).abs().max() / y16.float().abs().max()
    assert float(err) < 2**-7

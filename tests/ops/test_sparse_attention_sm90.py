"""The sm_90 Gluon kernel of minidi::sparse_attention (``minidi/ops/sparse_attention_sm90.py``) vs the op's references.

GPU tests (marker ``gpu``) run only where the kernel can run (an sm_90 device, Triton 3.6 with Gluon); elsewhere they
skip, and the CPU test checks that the dispatch never picks the kernel there. Tolerances as
``test_sparse_attention.py``: bf16 vs ``sparse_attention_ref`` |out - ref| <= 2^-7 |ref| + 4e-3; the rounding fixture
(padded to D 512 and 64 heads with zeros, which add nothing) to 1e-4 on its cancelling outputs; the folded rotations
bit-equal to eager's ``apply_rope`` around the kernel without them. Outputs are poisoned (NaN) before each run.
"""

from __future__ import annotations

import os
import re

import pytest
import torch

from minidi.model.layers import apply_rope, rms_norm
from minidi.ops import _triton_utils
from minidi.ops import sparse_attention_sm90 as sm90
from minidi.ops import sparse_attention_sm90_stagger as stagger
from minidi.ops.sparse_attention import (ROPE_OUT, ROPE_Q, SM90_DEFAULT, SM90_KERNELS, encode_slots, launch,
                                         sparse_attention_ref)

from .test_sparse_attention import BF16_TOL, _angles, _case, _rounding_fixture


def _runs() -> bool:
    return (torch.cuda.is_available() and sm90.gluon_supported()
            and torch.cuda.get_device_capability() == (9, 0))


needs_sm90 = pytest.mark.skipif(not _runs(), reason="needs an sm_90 GPU and Triton 3.6 with Gluon")
# every Gluon kernel and the launcher options the bench compares: the same contract
KERNELS = {impl: (impl, {}) for impl in SM90_KERNELS} | {
    "gluon_split_hoisted": ("gluon_split", dict(zq=False)),
    "gluon_stagger_qload": ("gluon_stagger", dict(qasync=False)),
    "gluon_stagger_grid": ("gluon_stagger", dict(persistent=False)),
    "gluon_stagger_bk32": ("gluon_stagger", dict(bk=32)),
    "gluon_stagger_stores": ("gluon_stagger", dict(otma=False)),  # the output by 4-byte stores (before round 26)
    # who rotates q (QROPE), without the next item's angles prefetched (QANG, the default since round 39)
    "gluon_stagger_qrope0": ("gluon_stagger", dict(qrope=0, angles_ahead=False)),  # Q's whole half 1 first (< 36)
    "gluon_stagger_qrope1": ("gluon_stagger", dict(qrope=1, angles_ahead=False)),  # the rotated chunks only (36-38)
    "gluon_stagger_qrope2": ("gluon_stagger", dict(qrope=2, angles_ahead=False))}  # ... by consumer 0
KERNELS |= {f"{name}_ang": ("gluon_stagger", opts | dict(angles_ahead=True))  # the next item's angles prefetched
            for name, (impl, opts) in list(KERNELS.items()) if name.startswith("gluon_stagger_qrope")}
each_kernel = pytest.mark.parametrize("impl", list(KERNELS))


def _gluon(impl, q, wkv, widx, ckv, cidx, sink, scale, cos=None, sin=None, mode=0) -> torch.Tensor:
    """The Gluon kernel ``impl`` (a key of ``KERNELS``) alone, into a NaN-poisoned output (every element must be
    written)."""
    comp_off = (ckv.data_ptr() - wkv.data_ptr()) // 2 if ckv is not None else 0
    assert sm90.can_run(q, wkv, comp_off, cos.shape[-1] if mode else 0)
    code = encode_slots(widx, cidx, wkv.shape[0], ckv.shape[0] if ckv is not None else 0)
    out = torch.full_like(q, float("nan"))
    name, options = KERNELS[impl]
    SM90_KERNELS[name](q, wkv, code, sink, out, comp_off, scale, cos, sin, mode, **options)
    torch.cuda.synchronize()
    assert not out.isnan().any(), "unwritten (poisoned) outputs"
    return out


def test_cpu_never_picks_the_sm90_kernel():
    q, wkv, widx, ckv, cidx, sink = _case(3, 64, 512, 4, 3, dtype=torch.bfloat16)
    assert not sm90.can_run(q, wkv, 0, 0)
    if _triton_utils.interpreting():  # the CPU run of the op (the interpreter): the Triton kernel
        info: dict = {}
        launch(q, wkv, widx, ckv, cidx, sink, 0.1, info=info)
        assert info.get("impl") not in ("gluon_sm90", "gluon_sm90_split")


@pytest.mark.gpu
@needs_sm90
@each_kernel
@pytest.mark.parametrize("t,h,w,k,comp", [(512, 64, 128, 512, True), (37, 128, 17, 45, True), (65, 64, 128, 0, False),
                                          (9, 64, 5, 3, True), (300, 128, 17, 45, True)])
def test_gpu_matches_reference(impl, t, h, w, k, comp):
    """Ragged T, 64 / 128 heads, -1 slots anywhere (25 %), a query with no compressed key, fewer keys than a block
    (W+K 62 and 8), window-only layers, more (token, head block) items than SMs (persistent grids loop over them);
    fresh random inputs per case."""
    args = _case(t, h, 512, w, max(k, 1), nw=t + w + 3, nc=4096, dtype=torch.bfloat16, seed=t + h, device="cuda",
                 comp=comp)
    out = _gluon(impl, *args, 512**-0.5)
    ref = sparse_attention_ref(*args, 512**-0.5)
    torch.testing.assert_close(out.float(), ref.float(), **BF16_TOL)
    again = _gluon(impl, *args, 512**-0.5)
    assert torch.equal(again, out)  # no race: a second launch gives the same bits
    info: dict = {}
    auto = launch(*args, 512**-0.5, info=info)  # the op's default dispatch picks the default Gluon kernel here
    assert info.get("impl") == {"gluon": "gluon_sm90", "gluon_split": "gluon_sm90_split",
                                "gluon_stagger": "gluon_sm90_stagger"}[SM90_DEFAULT]
    if impl == SM90_DEFAULT:
        assert torch.equal(auto, out)


@pytest.mark.gpu
@needs_sm90
@each_kernel
def test_gpu_fewer_valid_keys_and_empty_rows(impl):
    """Most slots empty, out-of-range indices, NaN rows where empty slots point, queries with no valid key (-> 0)."""
    t, h, d, w, k = 40, 64, 512, 128, 512
    q, wkv, widx, ckv, cidx, sink = _case(t, h, d, w, k, nw=t + w + 3, nc=4096, dtype=torch.bfloat16, seed=7,
                                          device="cuda")
    g = torch.Generator(device="cuda").manual_seed(8)
    cidx[torch.rand(t, k, device="cuda", generator=g) < 0.9] = -1
    cidx[2, :5] = ckv.shape[0] + 3  # out of range = empty
    widx[3], cidx[3] = -1, -1  # no valid key at all
    ckv[0] = float("nan")  # index 0 is never referenced below: a NaN there must not leak through masked slots
    cidx = torch.where(cidx == 0, 1, cidx)
    out = _gluon(impl, q, wkv, widx, ckv, cidx, sink, 0.05)
    ref = sparse_attention_ref(q, wkv, widx, ckv, torch.where(cidx >= ckv.shape[0], -1, cidx), sink, 0.05)
    assert torch.equal(out[3], torch.zeros_like(out[3]))
    keep = torch.arange(t, device="cuda") != 3
    torch.testing.assert_close(out[keep].float(), ref[keep].float(), **BF16_TOL)


@pytest.mark.gpu
@needs_sm90
@each_kernel
def test_gpu_rounding_fixture(impl):
    """The bf16 probability rounding and the sink outside the max, at the kernel's shape: the fixture's 3 heads and
    36 channels padded with zeros to 64 heads x 512 (zero channels and heads add nothing to the other outputs)."""
    q, wkv, widx, ckv, cidx, sink = _rounding_fixture("cuda")
    t, h, d = q.shape
    qp = torch.zeros(t, 64, 512, dtype=q.dtype, device="cuda")
    qp[:, :h, :d] = q
    wp = torch.zeros(wkv.shape[0], 512, dtype=q.dtype, device="cuda")
    wp[:, :d] = wkv
    cp = torch.zeros(ckv.shape[0], 512, dtype=q.dtype, device="cuda")
    cp[:, :d] = ckv
    sp = torch.full((64,), -30.0, device="cuda")
    sp[:h] = sink
    out = _gluon(impl, qp, wp, widx.cuda(), cp, cidx.cuda(), sp, 1.0)[:, :h, :d].float()
    ref = sparse_attention_ref(q, wkv, widx, ckv, cidx, sink, 1.0).float()
    torch.testing.assert_close(out[:, :, 1], ref[:, :, 1], rtol=0, atol=1e-4)
    torch.testing.assert_close(out, ref, **BF16_TOL)


@pytest.mark.gpu
@needs_sm90
@each_kernel
@pytest.mark.parametrize("mode", [ROPE_Q, ROPE_OUT, ROPE_Q | ROPE_OUT])
def test_gpu_rotations_equal_the_model_chain(impl, mode):
    """V4.1's shape (rope on the last 64 of 512 channels): bit-equal to eager's rotations around the kernel."""
    t, h, d, w, k = 256, 64, 512, 128, 512
    args = _case(t, h, d, w, k, nw=t + w, nc=4096, dtype=torch.bfloat16, seed=3, device="cuda")
    cos, sin = _angles(t, 32, device="cuda")
    out = _gluon(impl, *args, d**-0.5, cos, sin, mode)
    q = apply_rope(args[0], cos, sin) if mode & ROPE_Q else args[0]
    base = _gluon(impl, q, *args[1:], d**-0.5)
    assert torch.equal(out, apply_rope(base, cos, sin, inverse=True) if mode & ROPE_OUT else base)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("mode", [0, ROPE_Q | ROPE_OUT])
def test_gpu_stagger_output_paths_bit_equal(mode):
    """The staggered kernel's output through shared memory and bulk stores (``otma``, the default) gives the same bits
    as the 4-byte stores from the accumulators, the output's rotation included, with more items than SMs and ragged
    key lists."""
    t, h, d, w, k = 300, 128, 512, 17, 45
    args = _case(t, h, d, w, k, nw=t + w + 3, nc=4096, dtype=torch.bfloat16, seed=11, device="cuda")
    cos, sin = _angles(t, 32, device="cuda")
    new = _gluon("gluon_stagger", *args, d**-0.5, cos, sin, mode)
    assert torch.equal(new, _gluon("gluon_stagger_stores", *args, d**-0.5, cos, sin, mode))


@pytest.mark.gpu
@needs_sm90
@each_kernel
@pytest.mark.parametrize("mode", [0, ROPE_Q | ROPE_OUT])
def test_gpu_q_scale_equals_the_model_norm(impl, mode):
    """q's row scales (pass A's fold of V4's q RMSNorm; in the Q load of the staggered kernel with Q copied ahead, q
    scaled first by the op for the others) give the bits of the kernel on rms_norm's output: row norms of 1e-3 to 1e3,
    more items than SMs, ragged key lists."""
    t, h, d, w, k = 300, 128, 512, 17, 45
    args = _case(t, h, d, w, k, nw=t + w + 3, nc=4096, dtype=torch.bfloat16, seed=21, device="cuda")
    q = args[0] * torch.logspace(-3, 3, h, device="cuda").view(1, h, 1).bfloat16()
    qs = torch.rsqrt(q.float().square().mean(-1, keepdim=True) + 1e-6)
    cos, sin = _angles(t, 32, device="cuda")
    rope = dict(rope_cos=cos, rope_sin=sin, rope_mode=mode) if mode else {}
    name, options = KERNELS[impl]
    out = launch(q, *args[1:], d**-0.5, q_scale=qs, impl=name, **rope, **options)
    assert not out.isnan().any()
    assert torch.equal(out, launch(rms_norm(q, None, 1e-6), *args[1:], d**-0.5, impl=name, **rope, **options))


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("ang", ["", "_ang"])
@pytest.mark.parametrize("qrope", [0, 1, 2])
@pytest.mark.parametrize("r2", [4, 32, 40, 128])
def test_gpu_stagger_q_rotation_owners_bit_equal(qrope, r2, ang):
    """Whoever rotates the copied Q (``qrope``; 1 and 2 over only the 64-column chunks holding the 2 r2 rotated
    channels: one chunk at r2 4 and 32, two at 40, the whole half at 128), with or without the next item's angles
    prefetched (``ang``), the result is eager's rotation before the kernel, bit for bit, with more items than SMs and
    ragged key lists."""
    t, h, d, w, k = 300, 128, 512, 17, 45
    args = _case(t, h, d, w, k, nw=t + w + 3, nc=4096, dtype=torch.bfloat16, seed=12 + r2, device="cuda")
    cos, sin = _angles(t, r2, device="cuda")
    out = _gluon(f"gluon_stagger_qrope{qrope}{ang}", *args, d**-0.5, cos, sin, ROPE_Q)
    assert torch.equal(out, _gluon("gluon_stagger", apply_rope(args[0], cos, sin), *args[1:], d**-0.5))


# ---- compiles for sm_90a on the CPU (Triton's compiler and ptxas need no GPU) -----------------------------------
def _compile_report(impl: str, pipe: bool, opt: int = 0, qrope: int = stagger.QROPE, qnorm: bool = False,
                    qang: bool = False) -> dict:
    """Compile one Gluon kernel for sm_90a, both rotations on, as the launchers specialise it (16-byte aligned pointers
    and comp_off): its wgmma instruction counts by shape, setmaxnreg, shared memory, local-memory (spill) accesses,
    global stores and bulk tensor stores in its SASS. ``pipe``: "gluon" / "gluon_split" PIPE, "gluon_stagger" OTMA;
    ``opt``: "gluon_split" ZQ, "gluon_stagger" the keys per block; ``qrope`` / ``qnorm`` / ``qang``:
    "gluon_stagger"'s QROPE / QNORM / QANG (and the L1 prefetches in its PTX)."""
    from minidi.ops import sparse_attention_sm90_split as split

    from .gluon_compile import compile_sm90, sass

    ptrs = dict(q_ptr=torch.bfloat16, kv_ptr=torch.bfloat16, code_ptr=torch.int32, sink_ptr=torch.float32,
                out_ptr=torch.bfloat16, cos_ptr=torch.float32, sin_ptr=torch.float32)
    consts = dict(D=512, PW=sm90.PW, ROPE_Q=True, ROPE_OUT=True, R2=32)
    descs: dict = {}
    if impl == "gluon":
        fn, consts = sm90._sparse_attention_sm90, consts | dict(BK=sm90.BK, NS=sm90.NS, XPAD=sm90.XPAD, PIPE=pipe,
                                                               P_REGS=sm90.P_REGS, C_REGS=sm90.C_REGS)
    elif impl == "gluon_split":
        fn, consts = split._sparse_attention_sm90_split, consts | dict(
            BK=split.BK, NS=split.NS, P_REGS=split.P_REGS, C_REGS=split.C_REGS, PIPE=pipe, ZQ=bool(opt))
    else:  # with 64-key blocks the output's bulk stores (a descriptor of out [T H, D]); with 32, out's pointer again
        otma = pipe and opt == stagger.OC
        fn, consts = stagger._sparse_attention_sm90_stagger, consts | dict(
            BK=opt, NS=stagger.STAGES[opt], P_REGS=stagger.P_REGS, C_REGS=stagger.C_REGS, QASYNC=stagger.QASYNC,
            OTMA=otma, OC=stagger.OC, QROPE=qrope, QNORM=qnorm, QANG=qang)
        ptrs["qs_ptr"] = torch.float32
        if otma:
            descs = dict(o_desc=stagger.TensorDescriptor(torch.empty(64, 512, dtype=torch.bfloat16), [64, 512],
                                                         [512, 1], [64, stagger.OC], stagger.out_layout()))
        else:
            ptrs["o_desc"] = torch.bfloat16
    kern = compile_sm90(fn, descs, ptrs, consts, aligned=(*ptrs, "comp_off"), num_warps=4, maxnreg=sm90.MAXNREG)
    ptx = kern.asm["ptx"]
    shapes = re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)\.f32\.bf16\.bf16", ptx)
    text = sass(kern)
    local = len(re.findall(r"\s(?:LDL|STL)[\s.]", text))
    return dict(wgmma={sh: shapes.count(sh) for sh in set(shapes)}, setmaxnreg="setmaxnreg" in ptx,
                shared=kern.metadata.shared, local=local, stg=len(re.findall(r"\sSTG[\s.]", text)),
                tma_stores=len(re.findall(r"\sUTMASTG[\s.]", text)), prefetch=ptx.count("prefetch.global.L1"))


@pytest.mark.skipif(not sm90.gluon_supported(), reason="Gluon API of a tested Triton version (3.6) not installed")
@pytest.mark.parametrize("impl,pipe,opt,qrope", [
    ("gluon", False, 0, 0), ("gluon_split", False, 0, 0), ("gluon_split", True, 0, 0), ("gluon_split", False, 1, 0),
    ("gluon_stagger", False, 64, 0), ("gluon_stagger", True, 64, 0), ("gluon_stagger", False, 32, 0),
    ("gluon_stagger", True, 64, 1), ("gluon_stagger", True, 64, 2), ("gluon_stagger", True, 64, "norm"),
    ("gluon_stagger", True, 64, "ang"), ("gluon_stagger", True, 64, "norm_ang")])
def test_kernels_compile_for_sm90a(impl, pipe, opt, qrope):
    """The Gluon kernels compile, with the wgmma shapes of each design (one instruction per MMA of a key block) and
    shared memory within the H200's 227 KB; the staggered kernel and the split one with ZQ (almost) without spills; the
    staggered one with OTMA stores its output only by bulk tensor stores, whoever rotates its Q (``qrope``), and with
    q's row scales in its Q load ("norm"), and with the next item's angles prefetched into L1 ("ang": QROPE 1, QANG;
    "norm_ang": both, the V4 step's build since QANG is the default; the others have no prefetch).
    Compiled in a fresh process: a Triton kernel run by the interpreter in this process (other tests) patches the
    language and the Gluon front end then fails."""
    import json
    import subprocess
    import sys

    pytest.importorskip("triton.backends.nvidia.compiler")
    qr = qrope if isinstance(qrope, int) else {"norm": 0, "ang": 1, "norm_ang": 1}[qrope]
    norm, ang = qrope in ("norm", "norm_ang"), qrope in ("ang", "norm_ang")
    code = ("import json; from tests.ops.test_sparse_attention_sm90 import _compile_report; "
            f"print(json.dumps(_compile_report({impl!r}, {pipe}, {opt}, {qr}, {norm}, {ang})))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert run.returncode == 0, run.stderr[-3000:]
    rep = json.loads(run.stdout.strip().splitlines()[-1])
    if impl == "gluon":  # per consumer: S over its D half (16 x k16), P V over 64 keys (4 x k16)
        want = {"m64n64k16": 2 * 16, "m64n256k16": 2 * 4}
    elif impl == "gluon_split":  # per consumer and pair: S over all of D (32 x k16), P V for both blocks (2 x 2 x
        # k16); PIPE: loop + tail
        want = {"m64n32k16": 2 * 32 * (2 if pipe else 1), "m64n256k16": 2 * 4 * (2 if pipe else 1)}
    else:  # S over all of D (32 x k16): consumer 0 before and in its loop, consumer 1 in its loop; P V of both blocks
        # (2 x BK / 16 x k16): consumer 0 in its loop and its last pair, consumer 1 in its loop
        want = {f"m64n{opt}k16": 3 * 32, "m64n256k16": 3 * 2 * opt // 16}
    assert rep["wgmma"] == want
    assert rep["setmaxnreg"]
    assert rep["shared"] <= 232448  # the H200's shared memory per block
    if impl == "gluon_split" and opt:
        assert rep["local"] == 0  # no spills: the wgmma descriptors are not hoisted out of the loop
    elif impl == "gluon_stagger":  # none in the key loops (the descriptors stay in them); a few per work item
        assert rep["local"] <= 16
        if pipe:  # OTMA: the output only through bulk tensor stores, 4 chunks per consumer
            assert (rep["stg"], rep["tma_stores"]) == (0, 8)
        assert (rep["prefetch"] > 0) == ang  # cos and sin rows, by the rotating consumer


def test_q_scale_routing_and_stagger_launcher_refusals():
    """Which sm_90 kernels apply q's row scales themselves (the staggered one with Q copied ahead; the op scales q
    first for the others), and the staggered launcher's clear refusals: a scale without Q copied ahead, an unknown
    q-rotation owner (both before any device work)."""
    assert stagger.scales_q("gluon_stagger", {}) and stagger.scales_q("gluon_stagger", dict(qrope=2))
    assert not stagger.scales_q("gluon_stagger", dict(qasync=False))
    assert not any(stagger.scales_q(name, {}) for name in ("gluon", "gluon_split"))
    q, out, sink = torch.zeros(2, 64, 512, dtype=torch.bfloat16), torch.zeros(2, 64, 512, dtype=torch.bfloat16), \
        torch.zeros(64)
    code, qs = torch.zeros(2, 3, dtype=torch.int32), torch.ones(2, 64)
    with pytest.raises(ValueError, match="q_scale needs qasync=True"):
        stagger.launch_sm90_stagger(q, q[0], code, sink, out, 0, 1.0, qasync=False, q_scale=qs)
    with pytest.raises(ValueError, match="qrope must be 0, 1 or 2, got 3"):
        stagger.launch_sm90_stagger(q, q[0], code, sink, out, 0, 1.0, qrope=3)


def test_launchers_rotation_arguments_and_empty_slot_lists():
    """Both Gluon launchers' shared argument step: dummy (never read) pointers without rotations, R2 from the angles,
    a clear refusal of a slot list with no slot."""
    sink, cos, sin = torch.zeros(64), torch.randn(5, 32), torch.randn(5, 32)
    code = torch.zeros(5, 3, dtype=torch.int32)
    assert sm90.launch_rope_args(code, sink, None, None, 0, "sm90") == (1, sink, sink)
    r2, c, s = sm90.launch_rope_args(code, sink, cos, sin, ROPE_Q | ROPE_OUT, "sm90")
    assert r2 == 32 and c is cos and s is sin
    with pytest.raises(ValueError, match=r"sparse_attention \(sm90 split\): needs at least one key slot"):
        sm90.launch_rope_args(code[:, :0], sink, None, None, 0, "sm90 split")

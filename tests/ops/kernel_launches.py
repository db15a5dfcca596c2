"""Record the Triton kernel launches of one compiled tiny-model step (interpreter), and compile each recorded
specialisation for sm_90 in a fresh process (no GPU: Triton's compiler and its bundled ptxas run on the CPU).

``test_kernels_compile_sm90.py`` drives it. The interpreter accepts code that the compiler rejects (a non-constexpr
global read in a kernel ran on the CPU and failed on the H200 in round 4), so the CPU tests alone do not show that a
kernel compiles.

    TRITON_INTERPRET=1 python -m tests.ops.kernel_launches record tests/fixtures/kernel_launches.json
    TRITON_INTERPRET=0 python -m tests.ops.kernel_launches compile tests/fixtures/kernel_launches.json

The record is a committed fixture (a minute or two to make; the test compiles it in ~15 s). Re-record it when a
kernel's parameters change or a kernel is added: the test names what is stale or missing.
"""

from __future__ import annotations

import importlib
import inspect
import json
import sys

import torch

DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32",
          torch.int64: "i64", torch.uint8: "u8", torch.int8: "i8", torch.bool: "i1", torch.float8_e4m3fn: "fp8e4nv",
          torch.float64: "fp64", torch.float8_e5m2: "fp8e5", torch.float8_e8m0fnu: "u8", torch.int16: "i16",
          torch.uint16: "u16", torch.uint32: "u32"}
OPTIONS = ("num_warps", "num_stages")


def _arg_type(v) -> str:
    if isinstance(v, torch.Tensor):
        return "*" + DTYPES[v.dtype]
    if type(v).__name__ == "TensorDescriptor":  # a host TMA descriptor (triton.tools.tensor_descriptor)
        return f"tensordesc<{DTYPES[v.base.dtype]}[{', '.join(str(b) for b in v.block_shape)}]>"
    if isinstance(v, bool):
        return "i1"
    if isinstance(v, int):
        return "i32" if -2**31 <= v < 2**31 else "i64"
    if isinstance(v, float):
        return "fp32"
    raise TypeError(f"unsupported kernel argument {type(v).__name__}")


def _divisible_by_16(v) -> bool:
    """What Triton's launcher specialises as ``tt.divisibility`` 16: a pointer aligned to 16 bytes, an int (not a
    bool) that is a multiple of 16. The GPU compiles that variant (wider loads, other registers); without it the
    compile test would build scalar-load variants that never run."""
    if isinstance(v, torch.Tensor):
        return v.data_ptr() % 16 == 0
    return isinstance(v, int) and not isinstance(v, bool) and v % 16 == 0


OP_TESTS = ("tests/ops/test_fp4_grouped_gemm.py", "tests/ops/test_indexer_score.py", "tests/ops/test_topk.py",
            "tests/ops/test_gate_tf32x3.py", "tests/ops/test_fp8_quant.py", "tests/ops/test_fp8_grouped_gemm.py",
            "tests/ops/test_sparse_attention.py", "tests/ops/test_hc_mix.py", "tests/ops/test_hc_sinkhorn.py",
            "tests/ops/test_indexer_fp8_quant.py", "tests/ops/test_indexer_score_fp8.py", "tests/ops/test_hc_expand.py",
            "tests/ops/test_fp8_experts.py", "tests/ops/test_indexer_candidates.py", "tests/ops/test_fp8_linear.py",
            "tests/ops/test_fp4_grouped_gemm_sm90.py", "tests/ops/test_rotated_rows.py",
            "tests/ops/test_head_logits.py", "tests/ops/test_row_topk.py", "tests/ops/test_expert_order.py",
            "tests/ops/test_fq8.py", "tests/ops/test_moe_gather.py", "tests/ops/test_candidate_blocks.py",
            "tests/ops/test_hc_expand_mix.py", "tests/ops/test_hadamard.py")
PER_KERNEL = 12  # specialisations kept per kernel: the first of each variant (its bool / small-int constexprs)


def record(path: str, models: tuple[str, ...] = ("tiny-v41", "tiny-v4")) -> None:
    """Under the interpreter: one compiled prefill step of each model, then the op tests that reach the kernels and
    variants the models do not (chunk maxima, unswapped / scaled / fp32 GEMMs, split-K gate). Writes up to
    PER_KERNEL distinct launches per kernel of minidi.ops (test-local helper kernels are not recorded)."""
    from triton.runtime import interpreter

    import minidi
    from minidi.runtime.engine import Engine, Request

    launches: dict[tuple[str, str], dict] = {}
    run = interpreter.InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        if not self.fn.__module__.startswith("minidi.ops."):  # e.g. a test's own kernel around a jit helper
            return run(self, *args, grid=grid, warmup=warmup, **kwargs)
        params = inspect.signature(self.fn).parameters
        bound = dict(zip(params, args)) | {k: v for k, v in kwargs.items() if k in params}
        sig, consts = {}, {}
        try:
            for name, p in params.items():
                v = bound.get(name, p.default)
                if p.annotation is not inspect.Parameter.empty and "constexpr" in str(p.annotation) or v is None:
                    sig[name], consts[name] = "constexpr", v
                else:
                    sig[name] = _arg_type(v)
        except (KeyError, TypeError):  # an argument type this recorder does not map: not recorded, still run
            return run(self, *args, grid=grid, warmup=warmup, **kwargs)
        divisible = [n for n, t in sig.items() if t != "constexpr" and _divisible_by_16(bound.get(n))]
        entry = {"module": self.fn.__module__, "name": self.fn.__name__, "signature": sig, "constexprs": consts,
                 "divisible": divisible, "options": {k: kwargs[k] for k in OPTIONS if k in kwargs}}
        variant = (entry["name"], json.dumps({k: v for k, v in consts.items()
                                              if isinstance(v, bool) or (isinstance(v, int) and 0 <= v < 4)},
                                             sort_keys=True))
        same_kernel = [k for k in launches if k[0] == entry["name"]]
        if variant not in launches and len(same_kernel) < PER_KERNEL:
            launches[variant] = entry
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    interpreter.InterpretedFunction.run = recording_run
    try:
        for name in models:
            model = minidi.load_model(name)
            engine = Engine(model, compile=True, passes="all", compile_kwargs={"backend": "aot_eager"},
                            max_batch_tokens=32, max_seqs=2, cache_tokens=512, page_size=8)
            result = engine.prefill([Request(list(range(5, 17)))])[0]
            if result.error is not None:  # the engine reports a failed request instead of raising: do not record less
                raise RuntimeError(f"kernel_launches: the {name} prefill failed: {result.error}")
        import pytest
        pytest.main(["-q", "-p", "no:cacheprovider", *OP_TESTS])
    finally:
        interpreter.InterpretedFunction.run = run
    with open(path, "w") as f:
        json.dump(list(launches.values()), f, default=str)


def fp4_gpu_configs(recorded: list[dict]) -> list[dict]:
    """The FP4 GEMM's GPU tile configs (defaults and fallbacks; interpreter tests run only small tiles), as launches
    derived from a recorded bf16 launch."""
    from minidi.ops.fp4_grouped_gemm_configs import (DECODES, SCALED_EP1, SCALED_EP4, SS_EP1, SS_EP4, SWAP1WG_EP1,
                                                     SWAP1WG_EP4, SWAP2WG_EP1, SWAP2WG_EP4)

    base = next(e for e in recorded if e["name"] == "_fp4_grouped_mm_kernel" and not e["constexprs"]["IS_FP32"])
    configs = [SWAP1WG_EP4, SWAP2WG_EP4, SS_EP4, SWAP2WG_EP1, SWAP1WG_EP1, SS_EP1, SCALED_EP4, SCALED_EP1]
    out = []
    for c in configs:
        consts = dict(base["constexprs"], BM=c.BM, BN=c.BN, BK=c.BK, E_POW2=512, SWAP=c.swap,
                      DECODE=DECODES.index(c.decode), EVEN_K=True, SCALE32=c.BK <= 128)
        out.append(dict(base, constexprs=consts, options={"num_warps": c.num_warps, "num_stages": c.num_stages}))
    return out


def compile_all(path: str) -> list[str]:
    """Compile every recorded launch, and the FP4 GEMM's GPU configs, for sm_90 at the recorded specialisation (the
    arguments divisible by 16 marked as the launcher marks them); returns one line per failure."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    failures = []
    recorded = json.load(open(path))
    for e in recorded + fp4_gpu_configs(recorded):
        kernel = getattr(importlib.import_module(e["module"]), e["name"])
        consts = {k: (False if k == "INTERPRET" else v) for k, v in e["constexprs"].items()}  # the GPU code path
        names = list(e["signature"])  # the kernel's parameters in order: attrs are keyed by position
        attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in e["divisible"]}
        try:
            triton.compile(ASTSource(kernel, signature=e["signature"], constexprs=consts, attrs=attrs),
                           target=GPUTarget("cuda", 90, 32), options=e["options"])
        except Exception as err:  # noqa: BLE001 (reported by the test, with the kernel's name)
            failures.append(f"{e['module']}.{e['name']} {e['constexprs']}: {type(err).__name__}: {str(err)[-400:]}")
    return failures


if __name__ == "__main__":
    what, out = sys.argv[1], sys.argv[2]
    if what == "record":
        record(out)
    else:
        fails = compile_all(out)
        print("\n".join(fails) if fails else f"compiled {len(json.load(open(out)))} launches")
        sys.exit(1 if fails else 0)

"""Registers and stack (spills) of hot kernels compiled for sm_90 at the specialisation they run with on the GPU
(the launcher marks 16-byte aligned pointers and multiples of 16 as divisible; the recorded-launch fixture of
``kernel_launches.py`` marks what it recorded at the tiny sizes, this file the full-size V4.1 shapes).
``test_kernel_resources_sm90.py`` drives it in a fresh process with the interpreter off:

    TRITON_INTERPRET=0 python -m tests.ops.kernel_resources     # one JSON line: {kernel: {"regs", "stack"}}
"""

from __future__ import annotations

import json
import re
import subprocess
import tempfile


def resources(fn, signature: dict, constexprs: dict, divisible: tuple[str, ...], **options) -> dict:
    """``fn`` compiled for sm_90 with ``divisible`` arguments specialised as multiples of 16 -> {"regs", "stack"}."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = dict(signature) | {k: "constexpr" for k in constexprs}
    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    k = triton.compile(ASTSource(fn, signature=sig, constexprs=constexprs, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options=options)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        out = subprocess.run([knobs.nvidia.cuobjdump.path, "-res-usage", f.name], capture_output=True, text=True,
                             check=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+)", out)
    return {"regs": int(m.group(1)), "stack": int(m.group(2))}


def hc_mix_default() -> dict:
    """``_hc_mix_kernel`` at V4.1-Flash's mHC site (bf16 streams, collapse, D 5,120) with its default config."""
    from minidi.ops import hc_mix

    cfg = hc_mix.default_config(4096, 5120)
    sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "pre_ptr": "*fp32", "g_ptr": "*fp32", "ss_ptr": "*fp32",
           "u_ptr": "*bf16", "T": "i32", "D": "i32", "M": "i32", "D_PER_SPLIT": "i32", "sx_t": "i32", "sx_j": "i32",
           "sw_piece": "i32", "sw_m": "i32", "sg_split": "i32", "sg_t": "i32", "ss_split": "i32", "su_t": "i32",
           "sp_t": "i32"}
    div = tuple(n for n in sig if n.endswith("_ptr")) + ("D", "D_PER_SPLIT", "sx_t", "sx_j", "sw_piece", "sw_m",
                                                            "sg_split", "ss_split", "su_t")
    consts = dict(N=4, MP=32, COLLAPSE=True, X_BF16=True, INTERPRET=False, BT=cfg["BT"], BD=cfg["BD"])
    return resources(hc_mix._hc_mix_kernel, sig, consts, div, num_warps=cfg["num_warps"],
                     num_stages=cfg["num_stages"])


def moe_activation_fp8_default() -> dict:
    """``_moe_activation_kernel`` as pass L runs it (bf16 g / v, e4m3 out + scales, fq8 blocks of 32, I 2,304, the
    default launch form)."""
    from minidi.ops import moe_activation as act

    br, nb, warps = act.gpu_tile(2304, 32)
    sig = {"g_ptr": "*bf16", "v_ptr": "*bf16", "w_ptr": "*fp32", "offs_ptr": "*i32", "out_ptr": "*fp8e4nv",
           "s_ptr": "*fp32", "R": "i32", "I": "i32", "E": "i32", "NCT": "i32", "stride_g": "i32",
           "stride_v": "i32", "stride_w": "i32", "stride_o": "i32", "stride_s": "i32", "limit": "fp32"}
    div = tuple(n for n in sig if n.endswith("_ptr")) + ("I", "stride_g", "stride_v", "stride_o")
    consts = dict(BR=br, NB=nb, BLOCK=32, QUANT=True, ROUND_BF16=True, SPLIT=True, INTERPRET=False,
                  WALK=act.WALK_PER_SM is not None)
    return resources(act._moe_activation_kernel, sig, consts, div, num_warps=warps)


def hc_expand_mix_default() -> dict:
    """``_hc_expand_mix_kernel`` (pass U) at V4.1-Flash's MoE site (bf16 streams and h, collapse, D 5,120) with its
    default config."""
    from minidi.ops import hc_expand_mix

    cfg = hc_expand_mix.default_config(4096, 5120)
    ptrs = {"x_ptr": "*bf16", "h_ptr": "*bf16", "post_ptr": "*fp32", "comb_ptr": "*fp32", "out_ptr": "*bf16",
            "w_ptr": "*bf16", "pre_ptr": "*fp32", "g_ptr": "*fp32", "ss_ptr": "*fp32", "u_ptr": "*bf16"}
    ints = ("T", "D", "M", "D_PER_SPLIT", "sx_t", "sx_j", "sh_t", "sp_t", "sc_t", "so_t", "so_j", "sw_piece", "sw_m",
            "sg_split", "sg_t", "ss_split", "su_t", "spre_t")
    sig = ptrs | {n: "i32" for n in ints}
    div = tuple(ptrs) + ("D", "D_PER_SPLIT", "sx_t", "sx_j", "sh_t", "so_t", "so_j", "sw_piece", "sw_m", "sg_split",
                         "ss_split", "su_t")
    consts = dict(N=4, MP=32, COLLAPSE=True, X_BF16=True, ROUND_BF16=False, INTERPRET=False, BT=cfg["BT"],
                  BD=cfg["BD"])
    return resources(hc_expand_mix._hc_expand_mix_kernel, sig, consts, div, num_warps=cfg["num_warps"],
                     num_stages=cfg["num_stages"])


if __name__ == "__main__":
    print(json.dumps({"hc_mix": hc_mix_default(), "moe_activation_fp8": moe_activation_fp8_default(),
                      "hc_expand_mix": hc_expand_mix_default()}))

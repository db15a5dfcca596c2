"""Tile / decode / schedule configs of the fused FP4 grouped GEMM (``fp4_grouped_gemm.py``) and how one is chosen."""

from __future__ import annotations

import dataclasses
import functools
import os

import torch

DECODES = ("manual", "asm", "scaled")


@dataclasses.dataclass(frozen=True)
class Fp4GemmConfig:
    """Tile, decode and schedule of one launch.

    decode: "asm" (PTX byte-lookup decode + bf16x2 scale multiply; arithmetic decode in the interpreter), "scaled"
    (``tl.dot_scaled``, bf16 x only) or "manual" (integer/fp32 arithmetic; the fp32-x path). swap: acc^T = W x^T.
    ``progs_per_sm`` sizes the persistent grid on the GPU; ``progs`` overrides it (tests use it everywhere).
    """

    BM: int = 128
    BN: int = 128
    BK: int = 128
    num_warps: int = 8
    num_stages: int = 3
    swap: bool = True
    decode: str = "asm"
    progs_per_sm: int = 1
    progs: int | None = None

    def name(self) -> str:
        return (f"{self.decode}{'_swap' if self.swap else ''}_m{self.BM}n{self.BN}k{self.BK}"
                f"_w{self.num_warps}s{self.num_stages}p{self.progs_per_sm}")


# Known-good GPU configs, measured on the H200 (Triton 3.6; R = 24,576 rows): the fallbacks of the "asm" defaults.
# EP4 (256 rows / expert): 2.56 ms = 226 TFLOP/s; EP1 (64 rows / expert): 6.98 ms = 83 TFLOP/s.
SCALED_EP4 = Fp4GemmConfig(BM=256, BN=128, BK=128, num_warps=8, num_stages=3, swap=False, decode="scaled")
SCALED_EP1 = Fp4GemmConfig(BM=64, BN=128, BK=128, num_warps=8, num_stages=4, swap=False, decode="scaled")
SCALED_SMALL = Fp4GemmConfig(BM=128, BN=128, BK=128, num_warps=8, num_stages=3, swap=False, decode="scaled")  # 150
# Without register-operand MMAs (see below): the fastest unswapped tiles of the H200 race sweep
# (docs/benchmarks/h200_ops_round4/call3_*/race.json, skewed rows, ptxas 12.8): EP4 2.173 / 2.108 ms (w1/w3 / w2)
# against 2.245 / 2.196 for m256 n128 k64; EP1 4.117 / 3.985 ms against 4.305 / 4.326 for m64 n128 k128 w4.
SS_EP4 = Fp4GemmConfig(BM=128, BN=256, BK=64, num_warps=8, num_stages=3, swap=False, decode="asm")
SS_EP1 = Fp4GemmConfig(BM=64, BN=256, BK=64, num_warps=8, num_stages=4, swap=False, decode="asm")
# Swapped with one warpgroup, two programs per SM (docs/benchmarks/h200_ops_round5/call1/race.json): EP4 1.863 /
# 1.789 ms against SS_EP4's 2.159 / 2.095 in the same run, and race-free there (6 repeats, bitwise) and in the rows
# repro's grid variants; call 2: 1.822 / 1.811 ms, 8 repeats race-free, and the V4.1 EP4 prefill (592.8 ms/step).
# EP1 (call 2's sweep): 3.287 / 3.306 ms against SS_EP1's 4.087 / 3.958, race-free in 8 repeats.
SWAP1WG_EP4 = Fp4GemmConfig(BM=128, BN=128, BK=64, num_warps=4, num_stages=3, swap=True, decode="asm", progs_per_sm=2)
SWAP1WG_EP1 = Fp4GemmConfig(BM=64, BN=128, BK=64, num_warps=4, num_stages=4, swap=True, decode="asm", progs_per_sm=2)
# Swapped, two warpgroups: the defaults of rounds 2-3, racy with Triton 3.6 (below); never a default, for experiments
# that pass them explicitly (``fp4_grouped_gemm.launch(..., config=SWAP2WG_EP4)``, as the op bench's sweep does).
SWAP2WG_EP4 = Fp4GemmConfig(BM=256, BN=128, BK=64, num_warps=8, num_stages=3, swap=True, decode="asm")
SWAP2WG_EP1 = Fp4GemmConfig(BM=64, BN=128, BK=128, num_warps=8, num_stages=4, swap=True, decode="asm")


# The swapped tiles feed the decoded weights to the Hopper MMA from registers ("RS" wgmma). With Triton 3.6 on the
# H200 the swapped tiles of two warpgroups (8 warps) race: a few weight rows of whole tiles come out wrong, changing
# from run to run.
# - With Triton 3.6's ptxas 12.8: in the default grid (GPU test, op bench, race sweep).
# - With ptxas 13.5, where triton issue 9433's ptxas fix (13.3) is in: the default grid was clean in 9 runs, but
#   other grid sizes still raced, with the rows= read and without (docs/benchmarks/h200_ops_round4/call3_ptxas135/
#   repro_e96.json: progs_tiles, progs_66).
# - Triton issue 11047 (fixed by PR 11056, after Triton 3.6): the wgmma wait does not synchronise across
#   warpgroups, so one warpgroup can run ahead and overwrite what the other's MMAs still read. One warpgroup
#   (num_warps=4) has nothing to synchronise with: no one-warpgroup swapped tile raced in round 5's sweep and repro.
# So swapped tiles of several warpgroups are never a default; experiments name them (``config=``).


def multi_warpgroup_swap(cfg: Fp4GemmConfig) -> bool:
    """Whether ``cfg`` is a register-operand MMA tile spread over several warpgroups: the kind that races with Triton
    3.6 on Hopper (see above). The "scaled" decode does not feed the MMA from registers."""
    return cfg.swap and cfg.decode != "scaled" and cfg.num_warps > 4


@functools.lru_cache(maxsize=None)
def _ptxas_version(path_env: str | None) -> tuple[int, int] | None:
    try:
        from triton.backends.nvidia.compiler import get_ptxas
        major, minor = str(get_ptxas(90).version).split(".")[:2]
        return int(major), int(minor)
    except Exception:  # no NVIDIA backend / ptxas here
        return None


def ptxas_version() -> tuple[int, int] | None:
    """(major, minor) of the ptxas Triton compiles sm_90 kernels with (honours TRITON_PTXAS_PATH), or None."""
    return _ptxas_version(os.environ.get("TRITON_PTXAS_PATH"))


def _is_ep4_like(r: int, e: int) -> bool:
    return r / max(e, 1) >= 160  # mean rows per expert, known on the host without a sync


def default_config(r: int, e: int, n: int, k: int, dtype: torch.dtype, device: torch.device) -> Fp4GemmConfig:
    """Heuristic by mean rows per expert. GPU bf16: the "asm" decode in swapped tiles of one warpgroup
    (``SWAP1WG_*``), falling back to ``SCALED_*`` (see ``fallback_chain``). Never a ``multi_warpgroup_swap`` tile."""
    if device.type != "cuda":  # interpreter: its cost is per tile step (each tl op is a numpy call), so few wide steps:
        # tiny V4.1 expert shapes (48 rows, 8 experts, N x K 128 x 256 / 256 x 128) 0.36-0.58 s a call against 1.6-2.7 s
        # with BM 32, BN 32, BK 64 (2-core CPU); rows per expert are few, so 16-row tiles (32 measured slower)
        return Fp4GemmConfig(BM=16, BN=128, BK=128, num_warps=4, num_stages=1,
                             decode="asm" if dtype == torch.bfloat16 else "manual", progs=4)
    if dtype == torch.float32:  # test mode: IEEE fp32 dot, manual decode
        return Fp4GemmConfig(BM=64, BN=64, BK=32, num_warps=4, num_stages=2, decode="manual")
    # EP4-like (256 rows per expert): few row tiles per expert, decode amortised; EP1-like (64 rows per expert):
    # every expert's weights decoded once per column tile
    return SWAP1WG_EP4 if _is_ep4_like(r, e) else SWAP1WG_EP1


def fallback_chain(r: int, e: int, n: int, k: int, dtype: torch.dtype, device: torch.device) -> list[Fp4GemmConfig]:
    """The default config, then known-good fast configs of the same regime (never the slow "manual" decode for bf16
    x on the GPU). fp32 x and the interpreter: the default only."""
    first = default_config(r, e, n, k, dtype, device)
    if device.type != "cuda" or dtype != torch.bfloat16:
        return [first]
    known = [SCALED_EP4, SCALED_SMALL] if _is_ep4_like(r, e) else [SCALED_EP1, SCALED_SMALL]
    return [first] + [c for c in known if c != first]

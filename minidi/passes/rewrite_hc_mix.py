"""Pass F: the mHC mixer's fp32 projection (``minidi.model.hyper_connections.hc_mixer`` / ``hc_head``) ->
``minidi.ops.gate_tf32x3.gate_tf32x3`` (the fp32-accurate split-precision GEMM of pass E, with thin tiles).

Naive subgraph (Dynamo FX), twice per layer (the attention and the FFN site) and once in V4's head::

    z  = x.reshape(T, n * D).float()             # the n bf16 streams, flattened
    mu = z @ fn.float().t()                      # fn [(2 + n) n, n D] fp32 (head: [n, n D]): a [T, 20,480] x
                                                 # [20,480, 24] GEMM that cuBLAS runs on CUDA cores (FFMA): 14.0
                                                 # ms per V4.1 step at T 4,096 on an H200 (80 GEMMs, 160 kernels)

Replacement::

    mu = gate_tf32x3(z_source, fn)               # bf16 x exact, fn split hi + lo: 2 tf32 dots per K block, IEEE
                                                 # fp32 sum across blocks (error at fp32 level, see the op); 6.9 ms
                                                 # per step

Taken: ``float(x) @ t(float(w))`` with a rank-2 fp32 weight at most ``THIN_N`` rows (static) and x bf16 / fp32; the
router GEMM (pass E: it feeds softplus, weight bf16 [E, D]) and the output head (vocabulary rows) are not.
"""

from __future__ import annotations

import torch
from torch.fx import Node

from minidi.ops.gate_tf32x3 import THIN_N, gate_tf32x3

from .base import Match, Rewrite
from .fx_utils import dtype, val
from .patterns import feeds_softplus, fp32_gemm


class HCMixTF32x3(Rewrite):
    key = "F"
    name = "hc_mix_tf32x3"

    def match(self, node: Node) -> Match | None:
        gemm = fp32_gemm(node)
        if gemm is None or feeds_softplus(node):  # the router's GEMM: pass E
            return None
        x, w, nodes = gemm
        rows = val(w).shape[0] if dtype(w) == torch.float32 else None
        if not isinstance(rows, int) or rows > THIN_N:  # a thin fp32 projection (static width), not a head
            return None
        return Match(anchor=node, nodes=nodes, target=gate_tf32x3, args=(x, w), kwargs={"backend": self.op_backend},
                     outputs=[(node, None)])

"""Pass S: the compressors' fp32 GEMMs (``minidi.model.compressor``) -> ``minidi.ops.gate_tf32x3.gate_tf32x3``.

Naive subgraph (Dynamo FX), in every layer that runs a softmax-pooling compressor (V4.1: the ratio-2 kv sources; V4:
every compressed layer, and its ratio-4 indexer's own compressor)::

    xf = x.float()                                              # x [T, D] bf16
    kg = torch.cat([xf @ wkv.float().t(), xf @ wgate.float().t()], dim=-1)   # weights [w, D] bf16 -> [T, 2w] fp32

Both GEMMs are fp32 GEMMs on CUDA cores (cuBLAS FFMA, TF32 off): V4.1 at T 4,096, D 5,120, w 512, 0.45 ms each
(48 TFLOP/s) on an H100 in round 25's step, 0.07 ms (313 TFLOP/s) with this pass. Replacement::

    kg = torch.cat([gate_tf32x3(x, wkv), gate_tf32x3(x, wgate)], dim=-1)

With bf16 x and weights every product is exact in fp32, so the op runs one bf16 dot per K block on tensor cores and
adds the blocks with IEEE fp32 adds (its promotion): the fp32 GEMM's result up to the order of the fp32 sums (the
op's GPU tests bound it at the fp32 level). An fp32 x (fp32 models) takes the op's two tf32 dots of x's hi / lo split,
as pass E's router GEMM does. Taken: ``float(x) @ t(float(w))`` with bf16 | fp32 x and a bf16 w whose every user is
a ``cat``; the router's GEMM (pass E: it feeds softplus), the mHC projections (pass F: fp32 weights) and the output
head (pass O: the graph's output) are not.
"""

from __future__ import annotations

import torch
from torch.fx import Node

from minidi.ops.gate_tf32x3 import gate_tf32x3

from .base import Match, Rewrite
from .fx_utils import dtype, is_call
from .patterns import fp32_gemm


class CompressorGemm(Rewrite):
    key = "S"
    name = "compressor_gemm"

    def match(self, node: Node) -> Match | None:
        gemm = fp32_gemm(node)
        if gemm is None or not node.users or not all(is_call(u, "cat") for u in node.users):
            return None
        x, w, nodes = gemm
        if dtype(x) not in (torch.bfloat16, torch.float32) or dtype(w) != torch.bfloat16:
            return None
        return Match(anchor=node, nodes=nodes, target=gate_tf32x3, args=(x, w), kwargs={"backend": self.op_backend},
                     outputs=[(node, None)])

"""Pass G: the mHC stream update's einsum (``minidi.model.hyper_connections.hc_expand``) ->
``minidi.ops.hc_streams.hc_stream_mix``.

Naive subgraph (Dynamo FX), twice per layer (after attention, after the MoE)::

    mixed = einsum("tjk,tjd->tkd", comb, x.float())     # comb [T, n, n] fp32, streams [T, n, D]
    x'    = (post[..., None] * h.float()[:, None] + mixed).to(x.dtype)

Replacement::

    mixed = hc_stream_mix(comb, x.float())               # broadcast product summed over j: Inductor fuses it with
                                                          # the rest of the update into one memory-bound kernel

Taken: exactly this equation, both operands rank 3 and fp32, comb square in its stream dims (n: static and at most
``MAX_STREAMS`` in a whole-step graph; a symbol when a layer graph takes the streams as a dynamic input).
"""

from __future__ import annotations

import torch
from torch.fx import Node

from minidi.ops.hc_streams import hc_stream_mix

from .base import Match, Rewrite
from .fx_utils import dtype, is_call, normalize_einsum, rank, same_int, val

MAX_STREAMS = 16


class HCExpand(Rewrite):
    key = "G"
    name = "hc_stream_mix"

    def match(self, node: Node) -> Match | None:
        if not is_call(node, "einsum") or len(node.args) != 3 or node.kwargs:
            return None
        eq, comb, x = node.args
        if normalize_einsum(eq) != "tjk,tjd->tkd":
            return None
        if rank(comb) != 3 or rank(x) != 3 or dtype(comb) != torch.float32 or dtype(x) != torch.float32:
            return None
        n = val(comb).shape[1]  # static in a whole-step graph; symbolic when a layer is compiled on its own
        if not same_int(n, val(comb).shape[2]) or (isinstance(n, int) and n > MAX_STREAMS):
            return None
        return Match(anchor=node, nodes={node}, target=hc_stream_mix, args=(comb, x), outputs=[(node, None)])

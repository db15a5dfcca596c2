"""Pass U: the stream update a layer writes and its MoE site's reads of it (passes G's and J's ops) ->
``minidi.ops.hc_expand_mix.hc_expand_mix``, one pass over the streams.

Subgraph (after G and J), once per layer: the attention site's update and the MoE site's mixer reads::

    x2        = hc_expand(x, h, post, comb)         # G: writes the streams x2
    g, ms, u  = hc_mix_fused(x2, fn, pre)            # J: reads x2 back (projection, mean square, collapse with pre)

Replacement::

    x2, g, ms, u = hc_expand_mix(x, h, post, comb, fn, pre)   # x2 written, never read back

Taken: J's x is G's result itself; ``pre`` (or None) and ``fn`` exist at G's call, where the replacement runs, and
nothing mutates x2, pre or fn between the two calls; x bf16 / fp32 (J's dtypes); both calls in the same layer. The
layer's other site (the MoE's update, read by the next layer's attention mixer) crosses a layer boundary, which a
per-layer compile (the default) never sees in one graph; a whole-model graph leaves it too, so the sites are the
same in both: one a layer.

Opt-in (``passes="all,U"``; not part of "all"): the op is bit for bit G's and J's and compiles for sm_90 without
spilling (8 warps, 255 registers), but it is slower than the two kernels it replaces (one H100, round 30,
``docs/benchmarks``): 0.4234 ms against 0.2598 in ``bench/bench_hc_expand_mix.py``, and in the V4.1 EP4 step its
kernel takes 18.17 ms where G's and J's took ~10.1 ms for the same sites (the step 363.1 against 356.9 ms). It writes
fewer bytes, but one program holds the expand's and the mix's work and runs at 31 % of copy bandwidth.
"""

from __future__ import annotations

import operator

from torch.fx import Node

from minidi.ops.hc_expand import hc_expand
from minidi.ops.hc_expand_mix import hc_expand_mix
from minidi.ops.hc_mix import X_DTYPES, hc_mix_fused

from .base import Match, Rewrite
from .fx_utils import dtype, layer_of, untouched_between


def _call(node: Node, target, n_args: int) -> bool:
    return node.op == "call_function" and node.target is target and len(node.args) == n_args


class HCExpandMix(Rewrite):
    key = "U"
    name = "hc_expand_mix"
    requires = ("G", "J")
    in_all = False  # opt-in (passes="all,U"): slower than G's and J's kernels in the step (H100, round 30)

    def match(self, node: Node) -> Match | None:
        if not _call(node, hc_expand, 4) or dtype(node) not in X_DTYPES:
            return None
        mix = next((u for u in node.users if _call(u, hc_mix_fused, 3) and u.args[0] is node), None)
        if mix is None:
            return None
        _, fn, pre = mix.args
        layer = layer_of(node)
        if layer_of(mix) != layer:  # both None in a per-layer graph (the graph is one layer)
            return None
        if not all(u.op == "call_function" and u.target is operator.getitem and isinstance(u.args[1], int)
                   for u in mix.users):
            return None
        order = {n: i for i, n in enumerate(node.graph.nodes)}
        if any(isinstance(a, Node) and order[a] > order[node] for a in (fn, pre)):
            return None  # fn / pre computed after the update: the replacement could not run there
        if not untouched_between(node.graph, node, mix, {node, fn} | ({pre} if isinstance(pre, Node) else set())):
            return None
        outputs = [(node, 0)] + [(u, u.args[1] + 1) for u in mix.users]
        return Match(anchor=node, nodes={node, mix, *mix.users}, target=hc_expand_mix,
                     args=(*node.args, fn, pre), kwargs={"backend": self.op_backend}, outputs=outputs)

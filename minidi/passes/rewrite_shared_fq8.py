"""Pass R: one fq8 per shared input of the FP8 linears. Several of a layer's FP8 linears read one tensor, and after
pass N each of them fake-quantises it again inside its ``fp8_linear`` call (issue 23: V4.1-Flash EP4, 290 fq8
launches a step, 8.2 ms on the H100).

Naive subgraph (Dynamo FX, after pass N), where >= 2 ``fp8_linear`` calls read the same node x with the same
nonzero act_block (per layer: attention's wq_a and wkv on the normed hidden state, the shared expert's w1 and w3 on
the MoE input; in an index-source layer also attention's wq_b and the indexer's wq_b on the query latent)::

    a = fp8_linear(x, wa, sa, block, act_block)        # each call runs fq8(x, act_block) on its own
    stage_mark(x, "indexer", True)                     # (a profiler stage marker, when they are on)
    b = fp8_linear(x, wb, sb, block, act_block)

Replacement (the fq8 op inserted before the first of them, which keep their nodes)::

    xq = fq8(x, act_block)
    a  = fp8_linear(xq, wa, sa, block, -act_block)     # -act_block: the input as it is, known to be fq8 (the FP8
                                                       # route's fq8_split of it is exact)
    stage_mark(xq, "indexer", True)                    # moved to xq: it still orders b after it
    b  = fp8_linear(xq, wb, sb, block, -act_block)

Exact: ``fq8`` runs the kernel ``fp8_linear`` runs on its input (``minidi/ops/fq8.py``), on the same contiguous
values, and each linear then makes the same ``F.linear`` call on the same bits (``tests/passes/
test_rewrite_shared_fq8.py``). One match per group of linears, anchored at its first. Refused: calls with another
act_block or another input node (a view or copy of x is another node: never merged), act_block <= 0, and a group whose x
some in-place op (a stage marker aside) takes between the first and the last linear (the later linears would read x
as it was at the first). A stage marker on x between the linears moves to xq where only the group reads x after it:
a marker orders kernels by their data, and the later linears now read xq (left on x, the indexer's marker on the
query latent ordered nothing after it: in an H100 V4.1 step the stage table then moved 12 ms of kernels out of the
indexer's range, round 24).
Needs N (``requires``): it rewrites N's ops. A pass of its own, not part of N, so that its sites are counted and
checked on their own (``expected_sites``) and N stays one op per linear, matched linear by linear.
"""

from __future__ import annotations

from torch.fx import Node

from minidi.ops.fp8_linear import fp8_linear
from minidi.ops.fq8 import BLOCKS, fq8

from .base import Match, Rewrite
from .fx_utils import is_stage_marker, untouched_between

ACT_BLOCK = 4  # position of act_block in fp8_linear's args (x, weight, scale, weight_block, act_block)


def _fq8_linear(node, act_block: int | None = None) -> bool:
    """An ``fp8_linear`` call with positional args that fake-quantises its input (in blocks of ``act_block``)."""
    if not (isinstance(node, Node) and node.op == "call_function" and node.target is fp8_linear
            and len(node.args) == ACT_BLOCK + 1):
        return False
    block = node.args[ACT_BLOCK]
    return isinstance(block, int) and block in BLOCKS and (act_block is None or block == act_block)


class SharedFq8(Rewrite):
    key = "R"
    name = "shared_fq8"
    requires = ("N",)

    def match(self, node: Node) -> Match | None:
        if not _fq8_linear(node):
            return None
        x, act_block = node.args[0], node.args[ACT_BLOCK]
        if not isinstance(x, Node):
            return None
        group = [u for u in x.users if _fq8_linear(u, act_block) and u.args[0] is x]
        if len(group) < 2:
            return None
        order = {n: i for i, n in enumerate(node.graph.nodes)}
        group.sort(key=order.__getitem__)
        if node is not group[0] or not untouched_between(node.graph, group[0], group[-1], {x}):
            return None  # one match per group, at its first linear
        return Match(anchor=node, nodes=set(), target=fq8, args=(x, act_block), kwargs={"backend": self.op_backend},
                     reroute=[(u, x, None) for u in group + _markers_between(x, group, order)],
                     set_args=[(u, ACT_BLOCK, -act_block) for u in group])


def _markers_between(x: Node, group: list[Node], order: dict[Node, int]) -> list[Node]:
    """Stage markers on x between the group's first and last linear after which x has no readers but the group's
    linears (and markers): they move to the fq8 result, so that they still order the later linears (the indexer's
    marker on the query latent keeps the indexer's wq_b in its range). A marker that orders other readers of x stays."""
    first, last = order[group[0]], order[group[-1]]
    out = []
    for m in x.users:
        if is_stage_marker(m) and first < order[m] < last:
            later = [u for u in x.users if order[u] > order[m]]
            if all(u in group or is_stage_marker(u) for u in later):
                out.append(m)
    return sorted(out, key=order.__getitem__)

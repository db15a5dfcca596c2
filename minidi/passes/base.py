"""What a rewrite is, and how one match is spliced into the graph.

A rewrite looks at one node at a time (the *anchor*: the last node of its naive subgraph) and either refuses or
returns a ``Match``: the nodes of the naive subgraph, the replacement call and which naive nodes its results stand
for. ``apply_match`` inserts the call just before the anchor, reroutes the users, records a fake value for the new
node (so later graph passes see shapes and dtypes), and erases the naive nodes that became dead. It never runs a
general dead-code elimination: Dynamo records in-place tensor methods (``cache.index_copy_(...)``) as pure
``call_method`` nodes with no users, which ``Graph.eliminate_dead_code`` would delete.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import torch
from torch.fx import Graph, Node
from torch.fx.node import map_aggregate, map_arg

from .fx_utils import is_inplace, layer_of, mutation_between, val

_META_KEYS = ("stack_trace", "nn_module_stack", "source_fn_stack", "seq_nr")


@dataclass
class Match:
    anchor: Node  # the naive subgraph's last node; the replacement goes right before it
    nodes: set[Node]  # every node of the naive subgraph (erased once nothing else uses it)
    target: Callable  # the replacement, a function of minidi.ops with the naive function's signature
    args: tuple
    kwargs: dict = field(default_factory=dict)
    outputs: list[tuple[Node, int | None]] = field(default_factory=list)  # (naive node, index into the result)
    # (user, old input, new input or None = the replacement's result): inputs of nodes outside the subgraph that
    # must read another value once it is spliced (a profiler stage marker on a tensor the replacement absorbs)
    reroute: list[tuple[Node, Node, Node | None]] = field(default_factory=list)
    # (node outside the subgraph, position in its args, new literal): arguments that change with the splice (pass R:
    # a linear that reads the shared fq8 result instead of its input takes act_block -b)
    set_args: list[tuple[Node, int, Any]] = field(default_factory=list)
    mutation_start: Node | None = None  # where the mutation check starts (default: the subgraph's first node)

    def first(self, graph: Graph) -> Node:
        for n in graph.nodes:
            if n in self.nodes:
                return n
        return self.anchor


class Rewrite:
    """One pass: ``match(node)`` returns a ``Match`` when ``node`` ends this pass's naive subgraph, else None."""

    key: ClassVar[str]  # one letter: A, B, ...
    name: ClassVar[str]
    in_all: ClassVar[bool] = True  # part of passes="all" (False: opt-in, named on its own)
    requires: ClassVar[tuple[str, ...]] = ()  # keys of passes whose ops this one rewrites (selected with it)

    def __init__(self, op_backend: str = "auto") -> None:
        self.op_backend = op_backend

    def match(self, node: Node) -> Match | None:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.key}: {self.name})"


def _fake_value(target: Callable, args: tuple, kwargs: dict) -> Any:
    """The replacement's output on the inputs' recorded fake values, in the fake mode those values belong to (not
    ``detect_fake_mode``'s first choice, the tracing context's mode: inside a backend that is another mode, and
    running the op there fails with "Mixing fake modes")."""
    from torch._subclasses.fake_tensor import FakeTensor

    fargs = map_aggregate(args, val)
    fkwargs = map_aggregate(kwargs, val)
    tensors = [x for x in list(fargs) + list(fkwargs.values()) if isinstance(x, torch.Tensor)]
    modes = {id(t.fake_mode): t.fake_mode for t in tensors if isinstance(t, FakeTensor)}
    if len(modes) != 1:
        return None
    with next(iter(modes.values())):
        return target(*fargs, **fkwargs)


def apply_match(graph: Graph, m: Match) -> bool:
    """Splice ``m`` into ``graph``. Refuses (returns False) when some other node mutates a tensor between the naive
    subgraph's first node and its anchor (the replacement reads its inputs at the anchor, and must see what the naive
    code saw), when a naive result is used before the anchor, or when an input of the replacement is computed after
    it."""
    if mutation_between(graph, m.mutation_start or m.first(graph), m.anchor, m.nodes) is not None:
        return False
    order = {n: i for i, n in enumerate(graph.nodes)}
    if any(order[u] < order[m.anchor] for old, _ in m.outputs for u in old.users if u not in m.nodes):
        return False  # a naive result is used before the anchor, where the replacement's result does not exist yet
    inputs: list[Node] = []
    map_arg((m.args, m.kwargs), inputs.append)
    if any(order[a] > order[m.anchor] for a in inputs):
        return False  # an input of the replacement is computed after the anchor, where the call is inserted
    with graph.inserting_before(m.anchor):
        new = graph.call_function(m.target, m.args, m.kwargs)
        for k in _META_KEYS:
            if k in m.anchor.meta:
                new.meta[k] = m.anchor.meta[k]
        try:
            new.meta["example_value"] = _fake_value(m.target, m.args, m.kwargs)
        except Exception:  # a missing fake value only costs later passes their shape info
            pass
        for old, idx in m.outputs:
            if idx is None:
                repl = new
            else:
                repl = graph.call_function(operator.getitem, (new, idx))
                repl.meta.update({k: new.meta[k] for k in _META_KEYS if k in new.meta})
                ev = new.meta.get("example_value")
                if ev is not None:
                    repl.meta["example_value"] = ev[idx]
            want, got = val(old), repl.meta.get("example_value")
            if isinstance(want, torch.Tensor) and isinstance(got, torch.Tensor) and want.dtype != got.dtype:
                cast = graph.call_method("to", (repl, want.dtype))  # keep the dtype the naive code produced
                cast.meta.update({k: repl.meta[k] for k in _META_KEYS if k in repl.meta})
                cast.meta["example_value"] = got.to(want.dtype)
                repl = cast
            old.replace_all_uses_with(repl)
        for user, old, repl in m.reroute:
            user.replace_input_with(old, new if repl is None else repl)
        for user, pos, value in m.set_args:
            user.update_arg(pos, value)
    erase_dead(graph, m.nodes)
    return True


def erase_dead(graph: Graph, nodes: set[Node]) -> None:
    """Erase the nodes of ``nodes`` (and pure producers feeding them) that no longer have users."""
    work = list(nodes)
    erased: set[Node] = set()
    while work:
        n = work.pop()
        if n in erased or n.users or n.op not in ("call_function", "call_method"):
            continue
        if n not in nodes and (is_inplace(n) or (n.op == "call_function" and n.is_impure())):
            continue
        inputs = list(n.all_input_nodes)
        graph.erase_node(n)
        erased.add(n)
        work.extend(inputs)


def site_of(m: Match) -> int | None:
    return layer_of(m.anchor)

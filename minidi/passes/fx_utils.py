"""Small helpers for matching torch-level calls in a Dynamo FX graph.

Dynamo records a tensor method as ``call_method`` (``x.float()`` -> target ``"float"``) and a function or operator as
``call_function`` (``torch.functional.einsum``, ``operator.mul``, ``operator.getitem``). ``op(node)`` folds both into
one name (``"float"``, ``"einsum"``, ``"mul"``, ``"getitem"``), and ``arg(node, i, name)`` reads an argument
whether it was passed by position or by keyword, counting ``self`` of a method as position 0.
"""

from __future__ import annotations

import operator
import re
from typing import Any, Iterable

import torch
from torch.fx import Graph, Node

_MISSING = object()

# call_function targets that mean the same as a tensor method of that name
_FUNCTION_NAMES: dict[Any, str] = {
    operator.getitem: "getitem", operator.mul: "mul", operator.truediv: "truediv", operator.add: "add",
    operator.sub: "sub", operator.neg: "neg", operator.invert: "invert", operator.and_: "and", operator.or_: "or",
    operator.ge: "ge", operator.gt: "gt", operator.lt: "lt", operator.le: "le", operator.eq: "eq",
    operator.matmul: "matmul", operator.lshift: "lshift", operator.rshift: "rshift", operator.floordiv: "floordiv",
    torch.mul: "mul", torch.add: "add", torch.sub: "sub", torch.matmul: "matmul", torch.where: "where",
    torch.cat: "cat", torch.concat: "cat", torch.einsum: "einsum", torch.functional.einsum: "einsum",
    torch.exp: "exp", torch.relu: "relu", torch.nn.functional.relu: "relu", torch.stack: "stack",
    torch.zeros_like: "zeros_like", torch.full_like: "full_like", torch.arange: "arange", torch.sqrt: "sqrt",
    torch.nn.functional.softplus: "softplus", torch._C._nn.softplus: "softplus", torch.bucketize: "bucketize",
    torch.masked_fill: "masked_fill", torch.topk: "topk", torch.clamp: "clamp", torch.gather: "gather",
    torch.squeeze: "squeeze", torch.unsqueeze: "unsqueeze", torch.transpose: "transpose", torch.t: "t",
    torch.sum: "sum", torch.amax: "amax", torch.repeat_interleave: "repeat_interleave", torch.flatten: "flatten",
    torch.sym_min: "sym_min", torch.tensor: "tensor", torch._refs.tensor: "tensor", operator.ne: "ne",
    torch.nn.functional.silu: "silu", torch.nn.functional.pad: "pad", torch._C._nn.pad: "pad",
    torch.nn.functional.linear: "linear", torch._C._nn.linear: "linear",
}
if hasattr(torch, "_grouped_mm"):
    _FUNCTION_NAMES[torch._grouped_mm] = "_grouped_mm"

# dunder methods that mean the same as the operator of that name (see op())
_DUNDER_METHODS = {f"__{n}__": n for n in ("eq", "ne", "lt", "le", "gt", "ge", "mul", "add", "sub", "truediv",
                                               "neg", "invert", "matmul", "lshift", "rshift", "floordiv", "getitem")}
_DUNDER_METHODS.update({"__and__": "and", "__or__": "or"})

_INPLACE_FUNCTIONS = {operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv}


def op(node: Any) -> str | None:
    """Canonical name of the call a node makes (None for placeholders, outputs, attributes and non-nodes)."""
    if not isinstance(node, Node):
        return None
    if node.op == "call_method":
        # torch 2.11 records ``b == 0`` on a tensor as the method ``__eq__``; 2.13 as ``operator.eq``
        return _DUNDER_METHODS.get(node.target, node.target)
    if node.op == "call_function":
        name = _FUNCTION_NAMES.get(node.target)
        if name is None and getattr(node.target, "__module__", None) in ("torch", "torch.functional"):
            name = getattr(node.target, "__name__", None)
        return name
    return None


def is_call(node: Any, *names: str) -> bool:
    return op(node) in names


def arg(node: Node, pos: int | None, name: str | None = None, default: Any = _MISSING) -> Any:
    """Argument ``pos`` (positional, ``self`` = 0 for methods) or keyword ``name`` of a call; ``default`` if absent."""
    if pos is not None and pos < len(node.args):
        return node.args[pos]
    if name is not None and name in node.kwargs:
        return node.kwargs[name]
    if default is _MISSING:
        raise LookupError(name or pos)
    return default


def n_args(node: Node) -> int:
    return len(node.args) + len(node.kwargs)


def val(node: Any) -> Any:
    """The example value Dynamo recorded for a node (a fake tensor, SymInt, ...), or the literal itself."""
    if isinstance(node, Node):
        return node.meta.get("example_value", node.meta.get("val"))
    return node


def dtype(node: Any) -> torch.dtype | None:
    v = val(node)
    return v.dtype if isinstance(v, torch.Tensor) else None


def rank(node: Any) -> int | None:
    v = val(node)
    return v.dim() if isinstance(v, torch.Tensor) else None


def same_int(a: Any, b: Any) -> bool:
    """Two ints or SymInts known to be equal (syntactic equality of the symbolic expressions; no guard is added)."""
    a, b = val(a), val(b)
    a = a.node.expr if isinstance(a, torch.SymInt) else a
    b = b.node.expr if isinstance(b, torch.SymInt) else b
    try:
        return bool(a == b)
    except TypeError:
        return False


def is_literal(x: Any, value: Any) -> bool:
    return not isinstance(x, Node) and type(x) in (int, float, bool) and x == value


def const_number(x: Any) -> int | float | None:
    """A number known at trace time: a literal, or ``-literal`` as Dynamo records a negated float it lifted to a
    symbolic value (``neg = -10.0``, an ``operator.neg`` node, under dynamic float shapes); else None."""
    if isinstance(x, Node):
        if x.op == "call_function" and x.target is operator.neg and len(x.args) == 1:
            v = const_number(x.args[0])
            return None if v is None else -v
        return None
    return x if type(x) in (int, float) else None


def dims_equal(x: Any, *dims: int) -> bool:
    """A dim argument given as an int, a one-element tuple/list, equal to one of ``dims``."""
    if isinstance(x, (tuple, list)) and len(x) == 1:
        x = x[0]
    return isinstance(x, int) and not isinstance(x, bool) and x in dims


def is_inplace(node: Node) -> bool:
    """A call that mutates one of its arguments (``x.index_copy_(...)``, ``x[i] = y``)."""
    if node.op == "call_method":
        return node.target.endswith("_") and not node.target.endswith("__")
    if node.op == "call_function":
        if node.target in _INPLACE_FUNCTIONS:
            return True
        schema = getattr(node.target, "_schema", None)
        return bool(schema is not None and schema.is_mutable)
    return False


def mutation_between(graph: Graph, first: Node, last: Node, allowed: Iterable[Node]) -> Node | None:
    """The first mutating node strictly between ``first`` and ``last`` (graph order) that is not in ``allowed``."""
    if first is last:  # a one-node subgraph: nothing lies between
        return None
    allowed = set(allowed)
    inside = False
    for n in graph.nodes:
        if n is first:
            inside = True
            continue
        if n is last:
            return None
        if inside and n not in allowed and is_inplace(n):
            return n
    return None


def is_stage_marker(node: Node) -> bool:
    """A profiler stage marker (``minidi.model.stages``): declared to mutate its tensor so that the compiler keeps it
    in place, it only reads it."""
    return node.op == "call_function" and "stage_mark" in str(node.target)


def untouched_between(graph: Graph, start: Node, stop: Node, tensors: set[Node]) -> bool:
    """No in-place node between ``start`` and ``stop`` takes one of ``tensors`` (or the tensor it is a view of) as an
    argument, stage markers aside: a replacement may read them at another point than the naive code did."""
    watch = set(tensors) | {t.args[0] for t in tensors if is_call(t, "getitem", "view") and t.args}
    inside = False
    for n in graph.nodes:
        if n is start:
            inside = True
        elif n is stop:
            return True
        elif inside and is_inplace(n) and not is_stage_marker(n) and watch & set(n.all_input_nodes):
            return False
    return True


_LAYER_RE = re.compile(r"layers(?:\[|_|\.)(\d+)")


def layer_of(node: Node) -> int | None:
    """Index of the ``layers[i]`` module a node was traced in (from Dynamo's ``nn_module_stack``), if any."""
    stack = node.meta.get("nn_module_stack") or {}
    for key, entry in reversed(list(stack.items())):
        path = entry[0] if isinstance(entry, tuple) else str(entry)
        for text in (path, key):
            m = _LAYER_RE.search(str(text))
            if m:
                return int(m.group(1))
    return None


def normalize_einsum(eq: Any) -> str | None:
    return eq.replace(" ", "") if isinstance(eq, str) else None

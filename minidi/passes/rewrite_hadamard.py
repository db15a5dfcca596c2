"""Pass V: V4's Hadamard rotations (``minidi.formats.hadamard``: the indexer's q and k) -> ``minidi.ops.hadamard``.

Naive subgraph (Dynamo FX), twice in every V4 index-source layer with fake quant on (``IndexerV4._quant``)::

    h = hadamard_matrix(n, device)                 # traced: ones, 3 cats and a neg per doubling, / sqrt(n)
    y = (x.float() @ h).to(x.dtype)                # x [..., n] bf16 / fp16 -> fp32 matmul on CUDA cores (TF32 off)

    q = fq4_ue8m0(y, 32)                           # (the indexer's fake quant, where it follows: every V4 site)

Replacement::

    y = hadamard_rotate(x)                         # one tensor-core dot of x with the +-1 signs, times 1 / sqrt(n)
    q = hadamard_rotate(x, fq4_block=32)           # where fq4_ue8m0 is y's only reader: one kernel for both

The op's result is the model's up to the order of fp32 roundings before the one rounding to x's dtype (its module
doc); its fq4 is the model's fq4 of that rotation, bit for bit. Taken: a ``matmul`` of ``float(x)`` (x bf16 / fp16)
and a matrix computed from constants alone whose value, evaluated here on the CPU, is ``hadamard_matrix(n)`` bit for
bit (n a power of two in the op's range), whose only user is a ``to`` back to x's dtype; the fq4 with it where that
``to`` is read only by an ``fq4_ue8m0`` chain (``patterns.fq4_ue8m0_input``) of a block the op takes, back to x's
dtype. Another constant matrix, a parameter, an fp32 x or a product kept in fp32 are not; an fq4 with other constants
or with an intermediate read elsewhere stays as it is (the rotation alone is taken).
"""

from __future__ import annotations

import torch
from torch.fx import Node
from torch.fx.node import map_arg

from minidi.formats import hadamard_matrix
from minidi.ops.hadamard import KERNEL_DTYPES, fq4_block_ok, hadamard_rotate, width_ok

from .base import Match, Rewrite
from .fx_utils import dtype, is_call, n_args, val
from .patterns import fq4_ue8m0_input


def _constant_value(node: Node) -> tuple[torch.Tensor, set[Node]] | None:
    """(value on the CPU, the nodes computing it) of a node computed from literals by calls alone (no placeholder or
    attribute among its inputs), else None. Devices in the calls are replaced by the CPU."""
    order: list[Node] = []
    seen: set[Node] = set()

    def visit(n: Node) -> bool:
        if n in seen:
            return True
        if n.op not in ("call_function", "call_method") or len(seen) > 256:
            return False
        seen.add(n)
        ok = all(visit(a) for a in n.all_input_nodes)
        order.append(n)
        return ok

    if not visit(node):
        return None
    env: dict[Node, object] = {}
    cpu = lambda v: torch.device("cpu") if isinstance(v, torch.device) else v  # noqa: E731
    try:
        for n in order:
            args = map_arg(n.args, lambda a: env[a])
            kwargs = {k: cpu(v) for k, v in map_arg(n.kwargs, lambda a: env[a]).items()}
            if n.op == "call_function":
                env[n] = n.target(*args, **kwargs)
            else:
                env[n] = getattr(args[0], n.target)(*args[1:], **kwargs)
    except Exception:  # noqa: BLE001 - anything that does not evaluate here is not a constant we know
        return None
    out = env[node]
    return (out, seen) if isinstance(out, torch.Tensor) else None


def _is_hadamard(h: Node, n: int) -> set[Node] | None:
    """The nodes computing ``h`` where its value is ``hadamard_matrix(n)`` bit for bit, else None."""
    v = val(h)
    if not (isinstance(v, torch.Tensor) and tuple(v.shape) == (n, n) and v.dtype == torch.float32):
        return None
    const = _constant_value(h)
    if const is None or not torch.equal(const[0], hadamard_matrix(n)):
        return None
    return const[1]


def _rotation(node: Node) -> tuple[Node, set[Node]] | None:
    """node = (x.float() @ hadamard_matrix(n)).to(x.dtype), x bf16 / fp16 -> (x, the nodes it replaces)."""
    if not (is_call(node, "to") and len(node.args) == 2 and not node.kwargs):
        return None
    mm, out_dtype = node.args
    if not (is_call(mm, "matmul") and len(mm.args) == 2 and not mm.kwargs and len(mm.users) == 1):
        return None
    xf, h = mm.args
    if not (is_call(xf, "float") and n_args(xf) == 1):
        return None
    x = xf.args[0]
    n = val(x).shape[-1] if isinstance(val(x), torch.Tensor) else None
    if dtype(x) not in KERNEL_DTYPES or out_dtype != dtype(x) or n is None or not width_ok(n):
        return None
    consts = _is_hadamard(h, n)
    if consts is None:
        return None
    return x, {node, mm} | ({xf} if len(xf.users) == 1 else set()) | consts


# the calls from y.float() to an fq4_ue8m0 chain's output, each reading the one before (formats.fq4_ue8m0)
_FQ4_PATH = ("unflatten", "truediv", "clamp", "copysign", "mul", "flatten", "to")


def _fq4_of(y: Node) -> tuple[Node, int, set[Node]] | None:
    """(output, block, nodes) of an fq4_ue8m0 chain that is the only reader of the rotation ``y`` and returns y's
    dtype, in a block the op takes: the chain's output is found along ``_FQ4_PATH``, then matched whole."""
    users = list(y.users)
    if len(users) != 1 or not is_call(users[0], "float"):
        return None
    n = users[0]
    for name in _FQ4_PATH:
        n = next((u for u in n.users if is_call(u, name)), None)
        if n is None:
            return None
    found = fq4_ue8m0_input(n)
    if found is None or found[0] is not y or n.args[1] != dtype(y) or not fq4_block_ok(found[1], val(y).shape[-1]):
        return None
    return n, found[1], found[2]


class Hadamard(Rewrite):
    key = "V"
    name = "hadamard"

    def match(self, node: Node) -> Match | None:
        rotation = _rotation(node)
        if rotation is None:
            return None
        x, nodes = rotation
        anchor, kwargs = node, {"backend": self.op_backend}
        fq4 = _fq4_of(node)
        if fq4 is not None:  # the fq4 that reads the rotation goes into the same call
            anchor, block, fq4_nodes = fq4
            nodes |= fq4_nodes
            kwargs = {"fq4_block": block, **kwargs}
        return Match(anchor=anchor, nodes=nodes, target=hadamard_rotate, args=(x,), kwargs=kwargs,
                     outputs=[(anchor, None)])

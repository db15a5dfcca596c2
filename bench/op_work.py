"""The work one profiled op call must do: its FLOPs and the bytes it must move, from what ``torch.profiler`` records
in a Chrome trace event (``record_shapes=True``: ``Input Dims`` / ``Input type`` / ``Input Strides``;
``with_flops=True``: FLOPs, copied into ``args.flops`` by ``kernel_table.annotate_flops``; Inductor's ``kernel_flop``
/ ``kernel_num_gb``). None wherever the trace does not decide it: nothing is guessed.

- FLOPs: the profiler's count for the matmul-like ops of ``MATMUL_OPS`` (0 when an operand is empty: the profiler
  records no 0); 2 M N K of ``aten::_scaled_mm`` ([M, K] x [K, N]: the profiler counts none); ``kernel_flop`` of an
  Inductor kernel record.
- bytes: ``kernel_num_gb`` of an Inductor Triton kernel record (Inductor's own estimate, present only when
  ``torch._inductor.config.benchmark_kernel`` was set at compile time); for ``COPY_OPS`` (copy_: destination written
  + source read; fill_ / zero_: written) and ``ELEMENTWISE_OPS`` (and their in-place forms) the bytes of the tensor
  arguments plus the output. A broadcast (stride 0) dimension is read once; an in-place op reads and writes its first
  argument; an ``out=`` argument (found from torch's schemas of the op) gives the output's dtype, the inputs'
  broadcast shape its size; else the output dtype follows torch's type promotion over the dimensioned inputs, and is
  unknown where a 0-dim input (or wrapped number, which the trace does not tell apart) could change it. A tensor
  passed twice is counted twice.
- ``call_work``: the part of a call that is its own (its self time), given the ops it calls: a call that delegates
  to an op of its own name does 0 itself; a call of a composite op is unknown (its work may be in the children).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from functools import reduce

import torch

MATMUL_OPS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"})
SCALED_MM = "aten::_scaled_mm"  # FP8 matmul (fp8_linear's cuBLAS route): 2 M N K from its operands' dims
COPY_OPS = frozenset({"aten::copy_", "aten::fill_", "aten::zero_"})  # fill_ / zero_: write their first argument
_PROMOTE = ("add sub rsub mul maximum minimum fmax fmin pow remainder fmod bitwise_and bitwise_or bitwise_xor __and__ "
            "__or__ __xor__ __rshift__ __lshift__ bitwise_left_shift bitwise_right_shift floor_divide atan2 copysign "
            "hypot lerp addcmul addcdiv abs neg relu round floor ceil trunc frac sign sgn clamp clamp_min clamp_max "
            "bitwise_not nan_to_num hardtanh leaky_relu")
_FLOAT = ("div true_divide exp exp2 expm1 log log2 log10 log1p sqrt rsqrt reciprocal sigmoid tanh sin cos tan erf "
          "erfc erfinv silu gelu softplus mish logit asin acos atan sinh cosh")  # an integral input gives a float
_BOOL = "eq ne lt le gt ge logical_and logical_or logical_xor logical_not isnan isinf signbit"
OUT_RULE = {**dict.fromkeys(_PROMOTE.split(), "promote"), **dict.fromkeys(_FLOAT.split(), "float"),
            **dict.fromkeys(_BOOL.split(), "bool"), "where": "values", "masked_fill": "self"}
ELEMENTWISE_OPS = frozenset(f"aten::{n}" for n in OUT_RULE)  # and their in-place forms (aten::add_, ...)
TRIVIAL_OPS = frozenset(f"aten::{n}" for n in (
    "empty empty_strided empty_like as_strided view _reshape_alias _unsafe_view view_as unsqueeze squeeze expand "
    "expand_as t transpose permute select slice narrow detach alias resolve_conj resolve_neg lift_fresh result_type "
    "resize_ set_ item _local_scalar_dense scalar_tensor").split())  # views and allocations: no data moved
PREP_OPS = frozenset(f"aten::{n}" for n in "contiguous clone copy_ to _to_copy reshape".split())  # operand copies

_DTYPE_NAMES = {  # the profiler's "Input type" strings
    "float": "float32", "double": "float64", "c10::Half": "float16", "c10::BFloat16": "bfloat16",
    "long int": "int64", "int": "int32", "short int": "int16", "signed char": "int8", "unsigned char": "uint8",
    "bool": "bool", "short unsigned int": "uint16", "unsigned int": "uint32", "long unsigned int": "uint64",
    "c10::complex<c10::Half>": "complex32", "c10::complex<float>": "complex64", "c10::complex<double>": "complex128",
    "c10::Float8_e4m3fn": "float8_e4m3fn", "c10::Float8_e5m2": "float8_e5m2", "c10::Float8_e4m3fnuz":
    "float8_e4m3fnuz", "c10::Float8_e5m2fnuz": "float8_e5m2fnuz", "c10::Float8_e8m0fnu": "float8_e8m0fnu",
    "c10::Float4_e2m1fn_x2": "float4_e2m1fn_x2",
}
DTYPES = {k: getattr(torch, v) for k, v in _DTYPE_NAMES.items() if hasattr(torch, v)}  # (a dtype torch lacks: unknown)


# ---- work of one op call -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorArg:
    dims: tuple[int, ...]
    dtype: torch.dtype
    strides: tuple[int, ...] | None

    @property
    def nbytes(self) -> int:  # distinct elements: a stride-0 (broadcast) dimension is read once
        dims = self.dims if self.strides is None or len(self.strides) != len(self.dims) else [
            d for d, s in zip(self.dims, self.strides) if s != 0]
        return math.prod(dims) * self.dtype.itemsize


def tensor_args(args: dict) -> list[TensorArg | None] | None:
    """The op's arguments, a ``TensorArg`` for each tensor and None for the rest; None when shapes were not recorded
    or an argument is a tensor list or a tensor of a dtype not known here."""
    dims, types, strides = args.get("Input Dims"), args.get("Input type"), args.get("Input Strides")
    if not isinstance(dims, list) or not isinstance(types, list) or len(dims) != len(types):
        return None
    out: list[TensorArg | None] = []
    for i, (d, t) in enumerate(zip(dims, types)):
        if t in DTYPES and isinstance(d, list) and all(isinstance(x, int) for x in d):
            s = strides[i] if isinstance(strides, list) and i < len(strides) else None
            out.append(TensorArg(tuple(d), DTYPES[t], tuple(s) if isinstance(s, list) else None))
        elif t == "TensorList" or str(t).startswith("c10::"):
            return None  # tensors we cannot size
        else:  # Scalar, ScalarList, a string, None (""): no data
            out.append(None)
    return out


def _category(dt: torch.dtype) -> int:
    return 3 if dt.is_complex else 2 if dt.is_floating_point else 0 if dt == torch.bool else 1


def _result_dtype(tensors: list[TensorArg]) -> torch.dtype | None:
    """torch's type promotion where the trace decides it: dimensioned tensors promote; a 0-dim one (or a wrapped
    number, which the trace does not tell apart) of a higher category makes it undecidable (None)."""
    if not tensors:
        return None
    dimensioned = [t.dtype for t in tensors if t.dims] or [t.dtype for t in tensors]
    out = reduce(torch.promote_types, dimensioned)
    if any(_category(t.dtype) > _category(out) for t in tensors if not t.dims):
        return None
    return out


def _is_tensor_type(t) -> bool:
    if isinstance(t, torch._C.OptionalType):
        t = t.getElementType()
    return isinstance(t, torch._C.TensorType)


@functools.cache
def out_positions(name: str, tensor_mask: tuple[bool, ...]) -> tuple[int, ...] | None:
    """The positions of the ``out=`` arguments of a call of ``name`` whose recorded arguments are tensors where
    ``tensor_mask`` says: from the overloads of that arity whose tensor parameters fit the record (torch's schemas).
    () for a functional call; None when the overloads that fit disagree (or none fits)."""
    try:
        schemas = torch._C._jit_get_schemas_for_operator(name)
    except RuntimeError:
        return None
    found = set()
    for sch in schemas:
        params = sch.arguments
        fits = len(params) == len(tensor_mask) and all(
            not m or _is_tensor_type(a.type) for a, m in zip(params, tensor_mask))
        if fits:
            outs = tuple(i for i, a in enumerate(params) if a.is_out)
            if all(tensor_mask[i] for i in outs):
                found.add(outs)
    return found.pop() if len(found) == 1 else None


def _elementwise_bytes(name: str, args: list[TensorArg | None]) -> int | None:
    base = name[len("aten::"):]
    inplace = base.endswith("_") and not base.endswith("__")
    rule = OUT_RULE.get(base[:-1] if inplace else base)
    if rule is None or not any(args) or (inplace and args[0] is None):
        return None
    if inplace:  # the first argument is read and written
        return sum(t.nbytes for t in args if t is not None) + args[0].nbytes
    outs = out_positions(name, tuple(a is not None for a in args))
    if outs is None or len(outs) > 1:
        return None
    out = args[outs[0]] if outs else None  # an out= argument: its dtype is the output's (its shape may be 0 yet)
    args = [None if i in outs else a for i, a in enumerate(args)]
    tensors = [a for a in args if a is not None]
    if not tensors:
        return None
    read = sum(t.nbytes for t in tensors)
    if out is not None:
        dtype = out.dtype
    elif rule == "bool":
        dtype = torch.bool
    elif rule == "self":
        dtype = args[0].dtype if args[0] is not None else None
    else:
        dtype = _result_dtype([a for a in args[1:] if a is not None] if rule == "values" else tensors)
        if rule == "float" and dtype is not None and _category(dtype) < 2:
            dtype = None  # an integral input gives the default float dtype: not in the trace
    if dtype is None:
        return None
    try:
        shape = torch.broadcast_shapes(*(t.dims for t in tensors))
    except RuntimeError:
        return None
    return read + math.prod(shape) * dtype.itemsize


def _positive(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0


def op_work(event: dict) -> tuple[float | None, float | None]:
    """(FLOPs, bytes) one call of this op (or Inductor kernel record) must do, None where not known."""
    name, args = event.get("name", ""), event.get("args") or {}
    flops = nbytes = None
    if name in MATMUL_OPS and _positive(args.get("flops")):
        flops = float(args["flops"])
    elif name in MATMUL_OPS and any(t is not None and 0 in t.dims for t in tensor_args(args) or []):
        flops = 0.0  # an empty operand or output (an expert with no rows): 2*M*N*K = 0 (the profiler records no 0)
    if name == SCALED_MM:
        t = tensor_args(args) or []
        if len(t) > 1 and t[0] is not None and t[1] is not None and len(t[0].dims) == len(t[1].dims) == 2:
            flops = 2.0 * t[0].dims[0] * t[0].dims[1] * t[1].dims[1]
    if _positive(args.get("kernel_flop")):
        flops = float(args["kernel_flop"])
    if _positive(args.get("kernel_num_gb")):
        nbytes = float(args["kernel_num_gb"]) * 1e9
    elif name in COPY_OPS or name in ELEMENTWISE_OPS or (
            name.endswith("_") and name[:-1] in ELEMENTWISE_OPS):
        tensors = tensor_args(args)
        if tensors and tensors[0] is not None:
            if name == "aten::copy_":  # write the destination, read the source
                b = tensors[0].nbytes + tensors[1].nbytes if len(tensors) > 1 and tensors[1] is not None else None
            elif name in COPY_OPS:  # fill_ / zero_: write
                b = tensors[0].nbytes
            else:
                b = _elementwise_bytes(name, tensors)
            nbytes = float(b) if b is not None else None
    return flops, nbytes


def trivial(event: dict) -> bool:
    """A call that moves no data worth counting: a view / allocation, or work on tensors of at most one element."""
    if event.get("name") in TRIVIAL_OPS:
        return True
    tensors = tensor_args(event.get("args") or {})
    return tensors is not None and all(t is None or math.prod(t.dims) <= 1 for t in tensors)


def call_work(event: dict, busy_children: list[str]) -> tuple[float | None, float | None]:
    """The work of one call's *own* part (its self time), given the names of the ops it calls that are not trivial:

    - it delegates (calls an op of its own name, e.g. a Scalar overload the Tensor one; or a copy-like op only
      copy-like ones): that child computes the result and carries the work in its own row, so this call's part is 0;
    - a matmul that only copies its operands first (``contiguous`` ...), or any ``_scaled_mm``: its FLOPs are its own;
    - any other call of an op that does work: unknown (the work may be in the child, or split);
    - no such children: ``op_work``.
    """
    name = event.get("name", "")
    if busy_children and (name in busy_children or (name in COPY_OPS and all(c in COPY_OPS for c in busy_children))):
        return tuple(None if w is None else 0.0 for w in op_work(event))  # type: ignore[return-value]
    if busy_children:
        if name in MATMUL_OPS and all(c in PREP_OPS for c in busy_children):
            return op_work(event)[0], None
        if name == SCALED_MM:  # its FLOPs are its own whatever it calls (no child computes its product)
            return op_work(event)[0], None
        return None, None
    return op_work(event)

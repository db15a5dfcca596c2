"""The argument checks of ``minidi::sparse_attention`` (``sparse_attention.py``): every tensor's shape, dtype and device
against q [T, H, D], the rotations' and q's row scales' arguments; each failure a ValueError that names the argument
and what it got. Run by the public wrapper (at trace time under ``torch.compile``) and by the custom op's body."""

from __future__ import annotations

import torch

from ._sparse_attention_rope import ROPE_OUT, ROPE_Q

Q_DTYPES = (torch.bfloat16, torch.float32)
IDX_DTYPES = (torch.int32, torch.int64)
MAX_D = 512  # the [BH, D] fp32 accumulator must fit one SM's registers


def shape(x: torch.Tensor) -> tuple:
    return tuple(x.shape)


def _check_rows(kv_name: str, kv: torch.Tensor, n: str, idx_name: str, idx: torch.Tensor, k: str, t: int, d: int,
                dtype: torch.dtype) -> None:
    """One source of keys (the window rows or the compressed rows) and its index: kv [n, D] in q's dtype, idx [T, k]."""
    if kv.dim() != 2 or kv.shape[1] != d or kv.dtype != dtype:
        raise ValueError(f"sparse_attention: {kv_name} must be [{n}, D={d}] {dtype}, got {shape(kv)} {kv.dtype}")
    if idx.dim() != 2 or idx.shape[0] != t or idx.dtype not in IDX_DTYPES:
        raise ValueError(f"sparse_attention: {idx_name} must be [T={t}, {k}] int32/int64, got {shape(idx)} "
                         f"{idx.dtype}")


def _check_rope(q: torch.Tensor, rope_cos, rope_sin, rope_mode) -> None:
    if rope_mode not in (0, ROPE_Q, ROPE_OUT, ROPE_Q | ROPE_OUT):
        raise ValueError(f"sparse_attention: rope_mode must be 0, ROPE_Q (1), ROPE_OUT (2) or 3, got {rope_mode!r}")
    if not rope_mode:
        return
    t, _, d = q.shape
    for name, x in (("rope_cos", rope_cos), ("rope_sin", rope_sin)):
        if x is None or x.dim() != 2 or x.shape[0] != t or x.dtype != torch.float32:
            raise ValueError(f"sparse_attention: rope_mode {rope_mode} needs {name} [T={t}, r2] float32, got "
                             f"{'None' if x is None else f'{shape(x)} {x.dtype}'}")
    if rope_cos.shape != rope_sin.shape or not 1 <= 2 * rope_cos.shape[1] <= d:
        raise ValueError(f"sparse_attention: rope_cos / rope_sin must both be [T, r2] with 2 r2 <= D={d}, got "
                         f"{shape(rope_cos)} and {shape(rope_sin)}")


def _check(q, window_kv, window_idx, comp_kv, comp_idx, sink, scale, rope_cos=None, rope_sin=None,
           rope_mode=0, q_scale=None) -> None:
    if q.dim() != 3 or q.dtype not in Q_DTYPES:
        raise ValueError(f"sparse_attention: q must be [T, H, D] in {Q_DTYPES}, got {shape(q)} {q.dtype}")
    t, h, d = q.shape
    if d > MAX_D:
        raise ValueError(f"sparse_attention: head dim D must be <= {MAX_D} for the Triton kernel, got {d}; "
                         "use backend='ref'")
    _check_rows("window_kv", window_kv, "Nw", "window_idx", window_idx, "W", t, d, q.dtype)
    if (comp_kv is None) != (comp_idx is None):
        raise ValueError("sparse_attention: comp_kv and comp_idx must both be given or both be None, got "
                         f"comp_kv {'None' if comp_kv is None else shape(comp_kv)}, "
                         f"comp_idx {'None' if comp_idx is None else shape(comp_idx)}")
    if comp_kv is not None:
        _check_rows("comp_kv", comp_kv, "Nc", "comp_idx", comp_idx, "K", t, d, q.dtype)
    for name, x in (("window_kv", window_kv), ("comp_kv", comp_kv)):
        if x is not None and x.shape[0] >= 2**30:
            raise ValueError(f"sparse_attention: {name} must have < 2^30 rows for the Triton kernel, got {x.shape[0]}")
    if sink.shape != (h,) or sink.dtype != torch.float32:
        raise ValueError(f"sparse_attention: sink must be [H={h}] float32, got {shape(sink)} {sink.dtype}")
    if not isinstance(scale, (float, int)):
        raise ValueError(f"sparse_attention: scale must be a Python float, got {type(scale).__name__}")
    _check_rope(q, rope_cos, rope_sin, rope_mode)
    if q_scale is not None and (q_scale.dtype != torch.float32 or q_scale.shape not in ((t, h), (t, h, 1))):
        raise ValueError(f"sparse_attention: q_scale must be [T={t}, H={h}] or [T, H, 1] float32, got "
                         f"{shape(q_scale)} {q_scale.dtype}")
    devices = {x.device for x in (q, window_kv, window_idx, comp_kv, comp_idx, sink, rope_cos, rope_sin, q_scale)
               if x is not None}
    if len(devices) != 1:
        raise ValueError(f"sparse_attention: all tensors must share a device, got {sorted(map(str, devices))}")

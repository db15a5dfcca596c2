"""Float64 reference of the DeepSeek-V4.1-Flash text backbone, written from the spec alone.

Source: ``/work/shared/spec/deepseek_v41_flash.md`` (section numbers below, "§n") and, where it says "= V4 §n",
``deepseek_v4_flash.md``. Nothing here is taken from ``minidi.model`` (only the config dataclass is read), so this
file is an *independent* second implementation: checkpoint formats are decoded bit by bit here, the fake-quant
roundings are implemented here, and the forward runs entirely in float64.

Numerics: there are no bf16/fp32 rounding points at all (every activation is float64). With ``fake_quant=False``
nothing is quantised; with ``fake_quant=True`` the §11 table is applied at exactly its sites (fq8 before every
FP8/FP4-weight linear, fq8 on window KV, fq4_e4m3/16 on compressed KV, fq4_ue8m0/32 on indexer q and k).

Top-k tie rule (the spec defines none, §8 "Ties"): among equal scores the lower entry index wins (stable sort).
Comparisons against another implementation should therefore tolerate differences at exact/near ties; the tapped
``L{l}.index_scores`` lets a test check that.

Legend for shape comments: S tokens, n mHC streams, D model dim, H heads, d head dim, r rope dims, E compressed
entries of the published cache, k top-k width, nI index heads, dI index head dim, G output groups.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

F64 = torch.float64
NEG_INF = float("-inf")

# ================================================================================================================
# §12 checkpoint formats (own decoders; nothing from minidi.model.quant)
# ================================================================================================================

E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # code & 7 -> magnitude, bit 3 = sign (§12)


def _as_u8(t: torch.Tensor) -> torch.Tensor:
    """Raw bytes of a 1-byte tensor (float8_e4m3fn / float8_e8m0fnu / int8 / uint8) as int64 0..255."""
    assert t.element_size() == 1, t.dtype
    return t.contiguous().view(torch.uint8).to(torch.int64)


def e8m0_to_f64(s: torch.Tensor) -> torch.Tensor:
    """E8M0 byte b -> 2^(b-127) (b = 255 is NaN in the format and never produced by a scale)."""
    b = _as_u8(s)
    return torch.pow(torch.tensor(2.0, dtype=F64), (b - 127).to(F64))


def e4m3_to_f64(q: torch.Tensor) -> torch.Tensor:
    """OCP e4m3fn byte -> value: sign bit 7, exponent bits 6..3 (bias 7), mantissa bits 2..0; exp 0 = subnormal
    (m/8 * 2^-6); S.1111.111 = NaN; no infinities."""
    u = _as_u8(q)
    sign = torch.where((u >> 7) == 1, -1.0, 1.0).to(F64)
    e = (u >> 3) & 0xF
    m = (u & 7).to(F64)
    two = torch.tensor(2.0, dtype=F64)
    normal = (1.0 + m / 8.0) * torch.pow(two, (e - 7).to(F64))
    sub = (m / 8.0) * 2.0 ** -6
    v = sign * torch.where(e == 0, sub, normal)
    return torch.where((e == 15) & ((u & 7) == 7), torch.full_like(v, float("nan")), v)


def dequant_fp8_tiles(q: torch.Tensor, scale: torch.Tensor, block: int = 32) -> torch.Tensor:
    """FP8 linear weight (§12): e4m3 [out, in] x E8M0 [ceil(out/32), ceil(in/32)], one scale per 32x32 tile."""
    out, inp = q.shape
    assert scale.shape == (-(-out // block), -(-inp // block)), (q.shape, scale.shape)
    s = e8m0_to_f64(scale).repeat_interleave(block, 0).repeat_interleave(block, 1)[:out, :inp]
    return e4m3_to_f64(q) * s


def dequant_fp8_rows(q: torch.Tensor, scale: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Engram table (§5.2/§12): e4m3 [rows, hd] x E8M0 [rows, hd/32], one scale per row per 32 channels."""
    rows, hd = q.shape
    assert scale.shape == (rows, hd // block), (q.shape, scale.shape)
    return e4m3_to_f64(q) * e8m0_to_f64(scale).repeat_interleave(block, 1)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """int8 [out, in/2] -> e2m1 values [out, in]; element 2i = low nibble, 2i+1 = high nibble (§12)."""
    u = _as_u8(packed)
    nib = torch.stack([u & 0xF, (u >> 4) & 0xF], dim=-1).flatten(-2)  # [out, in]
    mag = torch.tensor(E2M1_GRID, dtype=F64)[nib & 7]
    return torch.where((nib & 8) != 0, -mag, mag)


def dequant_fp4_experts(packed: torch.Tensor, scale: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Routed-expert weight (§12, §16: 32-channel groups): packed e2m1 x E8M0 [out, in/32] (1x32 along input)."""
    v = unpack_fp4(packed)
    assert scale.shape == (v.shape[0], v.shape[1] // block), (packed.shape, scale.shape)
    return v * e8m0_to_f64(scale).repeat_interleave(block, 1)


F64_MARKER = "__spec_f64__"


def dequantize_checkpoint(w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every official tensor -> float64 (FP8 tiles, FP4 experts, Engram rows decoded; BF16/F32 upcast).

    The result maps the ``.weight`` name to the dequantised matrix; ``.scale`` sidecars are consumed.
    """
    out: dict[str, torch.Tensor] = {F64_MARKER: torch.zeros(())}
    for name, t in w.items():
        if name.endswith(".scale") and name[: -len(".scale")] + ".weight" in w:
            continue
        if name.endswith(".weight") and (sname := name[: -len(".weight")] + ".scale") in w:
            s = w[sname]
            if name.endswith("engram.embed.weight"):
                out[name] = dequant_fp8_rows(t, s)
            elif t.dtype == torch.int8:
                out[name] = dequant_fp4_experts(t, s)
            elif t.dtype == torch.float8_e4m3fn:
                out[name] = dequant_fp8_tiles(t, s)
            else:
                raise TypeError(f"{name}: unexpected quantised dtype {t.dtype}")
        else:
            out[name] = t.to(F64)
    return out


# ================================================================================================================
# §11 fake-quant (float64, exact power-of-two scales)
# ================================================================================================================

def _pow2(k: torch.Tensor) -> torch.Tensor:
    return torch.pow(torch.tensor(2.0, dtype=F64), k.to(F64))


def smallest_pow2_exponent(a: torch.Tensor, c: float) -> torch.Tensor:
    """Smallest integer k with c * 2^k >= a (a > 0), i.e. ceil(log2(a / c)) without float log2 error."""
    k = torch.ceil(torch.log2(a / c))
    k = torch.where(c * _pow2(k - 1) >= a, k - 1, k)
    k = torch.where(c * _pow2(k) < a, k + 1, k)
    return k


def round_e4m3(v: torch.Tensor) -> torch.Tensor:
    """Round to the nearest e4m3fn value, ties to even mantissa (|v| must already be <= 448)."""
    a = v.abs()
    _, ex = torch.frexp(a)  # a = m * 2^ex, m in [0.5, 1)  ->  floor(log2 a) = ex - 1
    e = torch.clamp(ex.to(torch.int64) - 1, min=-6)  # below 2^-6: subnormal spacing 2^-9
    quantum = _pow2(e - 3)
    r = torch.round(a / quantum) * quantum  # torch.round = half to even; a / quantum is exact
    r = torch.where(a == 0, torch.zeros_like(a), r)
    return torch.copysign(r, v)


_E2M1_MIDS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=F64)


def round_e2m1(v: torch.Tensor) -> torch.Tensor:
    """Round to the e2m1 grid {0,.5,1,1.5,2,3,4,6} (|v| <= 6), ties to the even code (§11: 0.25->0, 0.75->1,
    1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4). Exact: compares against the midpoints, no subtraction."""
    a = v.abs()
    code = (a[..., None] > _E2M1_MIDS).sum(-1)
    tie = (a[..., None] == _E2M1_MIDS).any(-1)
    code = code + (tie & (code % 2 == 1)).to(code.dtype)  # tie at mid_i (codes i, i+1): take the even one
    mag = torch.tensor(E2M1_GRID, dtype=F64)[code]
    return torch.copysign(mag, v)


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    assert x.shape[-1] % block == 0, (x.shape, block)
    return x.reshape(*x.shape[:-1], x.shape[-1] // block, block)


def fq8(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """§11 fq8: per `block` contiguous channels s = 2^ceil(log2(max(amax,1e-4)/448)); e4m3(clamp(x/s, ±448))·s."""
    xb = _blocks(x, block)
    amax = xb.abs().amax(-1, keepdim=True).clamp_min(1e-4)
    s = _pow2(smallest_pow2_exponent(amax, 448.0))
    return (round_e4m3(torch.clamp(xb / s, -448.0, 448.0)) * s).reshape(x.shape)


def fq4_ue8m0(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """§11 fq4_ue8m0: s = 2^ceil(log2(max(amax, 6·2^-126)/6)); e2m1(clamp(x/s, ±6))·s."""
    xb = _blocks(x, block)
    amax = xb.abs().amax(-1, keepdim=True).clamp_min(6.0 * 2.0 ** -126)
    s = _pow2(smallest_pow2_exponent(amax, 6.0))
    return (round_e2m1(torch.clamp(xb / s, -6.0, 6.0)) * s).reshape(x.shape)


def fq4_e4m3(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    """§11 fq4_e4m3: s = e4m3_RNE(max(amax, 6·2^-9)/6) (not a power of two); e2m1(clamp(x/s, ±6))·s.
    The scale is saturated at 448 (unreachable for normalised KV rows)."""
    xb = _blocks(x, block)
    amax = xb.abs().amax(-1, keepdim=True).clamp_min(6.0 * 2.0 ** -9)
    s = round_e4m3(torch.clamp(amax / 6.0, max=448.0))
    return (round_e2m1(torch.clamp(xb / s, -6.0, 6.0)) * s).reshape(x.shape)


# ================================================================================================================
# basic pieces
# ================================================================================================================

def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight over the last dim (weight None = unweighted)."""
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight


def linear(x: torch.Tensor, weight: torch.Tensor, fq: bool) -> torch.Tensor:
    """x [.., in] · weightᵀ [out, in]; `fq` = this is an FP8/FP4-weight linear under fake-quant (§11: fq8/32 on
    the input along K)."""
    return (fq8(x, 32) if fq else x) @ weight.T


def silu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(x)


# ================================================================================================================
# §6 RoPE (= V4 §4): interleaved pairs on the trailing r channels
# ================================================================================================================

def yarn_bounds(cfg) -> tuple[int, int]:
    """DeepSeek YaRN correction range on the compress table (V4 §4): corr(k) = r·ln(L/(2πk)) / (2·ln base),
    lo = max(floor(corr(beta_fast)), 0), hi = min(ceil(corr(beta_slow)), r-1); L = original_seq_len."""
    r, base, L = cfg.rope_head_dim, cfg.compress_rope_theta, cfg.original_seq_len

    def corr(k: float) -> float:
        return r * math.log(L / (2 * math.pi * k)) / (2 * math.log(base))

    return max(math.floor(corr(cfg.beta_fast)), 0), min(math.ceil(corr(cfg.beta_slow)), r - 1)


def rope_inv_freq(cfg, compressed: bool) -> torch.Tensor:
    """[r/2] frequencies. Main table (ratio-0 layers): ω_i = rope_theta^(-2i/r), no YaRN. Compress table (m>0):
    base compress_rope_theta with the YaRN blend ω' = ω(1-ramp) + ω/factor·ramp, ramp_i = clamp((i-lo)/(hi-lo),0,1)
    (always applied, spec "Unsure": YaRN gating)."""
    r = cfg.rope_head_dim
    base = cfg.compress_rope_theta if compressed else cfg.rope_theta
    i = torch.arange(r // 2, dtype=F64)
    omega = base ** (-2.0 * i / r)
    if not compressed:
        return omega
    lo, hi = yarn_bounds(cfg)
    hi_f = hi + 0.001 if hi == lo else float(hi)
    ramp = torch.clamp((i - lo) / (hi_f - lo), 0.0, 1.0)
    return omega * (1 - ramp) + omega / cfg.rope_factor * ramp


def rope_angles(inv_freq: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[P, r/2] angles pos·ω (float64)."""
    return positions.to(F64)[:, None] * inv_freq[None, :]


def apply_rope(x: torch.Tensor, angles: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the trailing r = 2·angles.shape[-1] channels of x [P, ..., C] as interleaved pairs
    (c0+2i, c0+2i+1) by angle (or -angle when `inverse`). angles [P, r/2] broadcast over middle dims."""
    r = 2 * angles.shape[-1]
    ang = angles.reshape(angles.shape[0], *([1] * (x.dim() - 2)), angles.shape[-1])
    cos, sin = torch.cos(ang), torch.sin(ang)
    if inverse:
        sin = -sin
    head, tail = x[..., :-r], x[..., -r:]
    a, b = tail[..., 0::2], tail[..., 1::2]
    rot = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)
    return torch.cat([head, rot], dim=-1)


# ================================================================================================================
# §4 mHC
# ================================================================================================================

def mhc_mixer(X: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, cfg):
    """§4 / V4 §3.1. X [S, n, D]; fn [(2+n)n, nD]; base [(2+n)n]; scale [3].
    Returns pre [S, n] (+hc_eps), post [S, n] (2σ), C [S, n, n] (Sinkhorn, hc_sinkhorn_iters normalisations of
    columns, rows in between). rsqrt eps = norm_eps."""
    S, n, D = X.shape
    z = X.reshape(S, n * D)
    mu = (z @ fn.T) * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + cfg.norm_eps)  # [S, (2+n)n]
    pre = torch.sigmoid(mu[:, :n] * scale[0] + base[:n]) + cfg.hc_eps
    post = 2 * torch.sigmoid(mu[:, n:2 * n] * scale[1] + base[n:2 * n])
    c0 = (mu[:, 2 * n:] * scale[2] + base[2 * n:]).reshape(S, n, n)  # C0[j, k]
    C = torch.softmax(c0, dim=-1) + cfg.hc_eps
    C = C / (C.sum(-2, keepdim=True) + cfg.hc_eps)  # Σ_j (column normalise)
    for _ in range(cfg.hc_sinkhorn_iters - 1):
        C = C / (C.sum(-1, keepdim=True) + cfg.hc_eps)  # Σ_k
        C = C / (C.sum(-2, keepdim=True) + cfg.hc_eps)  # Σ_j
    return pre, post, C


def mhc_collapse(X: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """u = Σ_j pre_j X_j. X [S, n, D], pre [S, n] or [n] -> [S, D]."""
    return (pre[..., None] * X).sum(-2)


def mhc_update(X: torch.Tensor, h: torch.Tensor, post: torch.Tensor, C: torch.Tensor) -> torch.Tensor:
    """X'_k = post_k·h + Σ_j C[j,k]·X_j (comb over the FIRST index, §4/§16). -> [S, n, D]."""
    return post[..., None] * h[:, None, :] + torch.einsum("sjk,sjd->skd", C, X)


# ================================================================================================================
# §5 Engram
# ================================================================================================================

def _is_prime(p: int) -> bool:
    if p < 2:
        return False
    if p % 2 == 0:
        return p == 2
    f = 3
    while f * f <= p:
        if p % f == 0:
            return False
        f += 2
    return True


def engram_primes(cfg) -> dict[int, list[list[int]]]:
    """§5.1: for each Engram layer (config order), n-gram order n=2..max, head h: the next prime > vocab_size-1
    not used before. Returns {layer: primes[n-2][h]}."""
    out: dict[int, list[list[int]]] = {}
    p = cfg.engram_vocab_size - 1
    for layer in cfg.engram_layers:
        per_n = []
        for _n in range(2, cfg.engram_max_ngram + 1):
            row = []
            for _h in range(cfg.engram_n_heads):
                p += 1
                while not _is_prime(p):
                    p += 1
                row.append(p)
            per_n.append(row)
        out[layer] = per_n
    return out


def engram_offsets(primes: list[list[int]]) -> list[list[int]]:
    """Row offset of each (n, h) sub-table: running sum of the primes in (n, h) order, starting at 0."""
    offs, acc = [], 0
    for row in primes:
        o = []
        for p in row:
            o.append(acc)
            acc += p
        offs.append(o)
    return offs


def engram_multipliers(cfg, layer: int) -> list[int]:
    """§5.1: numpy default_rng(10007·L).integers(0, bound, size=max_ngram, int64), bound=(2^63-1)//C//2; m=2v+1."""
    C = cfg.engram_compressed_vocab_size
    bound = (2 ** 63 - 1) // C // 2
    v = np.random.default_rng(10007 * layer).integers(0, bound, size=cfg.engram_max_ngram, dtype=np.int64)
    return [2 * int(x) + 1 for x in v]


def engram_shifted_tokens(cfg, input_ids: torch.Tensor, token_map: torch.Tensor) -> torch.Tensor:
    """§5.1 c_s = map[id_{t-s}], s = 0..max_ngram-1; from the first shift with t-s < 0 or a DEAD (-1) compressed
    id on, pad' = map[engram_pad_id]. -> LongTensor [S, max_ngram]."""
    pad = int(token_map[cfg.engram_pad_id])
    comp = [int(token_map[int(i)]) for i in input_ids]
    S, N = len(comp), cfg.engram_max_ngram
    out = torch.empty(S, N, dtype=torch.int64)
    for t in range(S):
        dead = False
        for s in range(N):
            if not dead and (t - s < 0 or comp[t - s] == -1):
                dead = True
            out[t, s] = pad if dead else comp[t - s]
    return out


def engram_hash_ids(cfg, input_ids: torch.Tensor, token_map: torch.Tensor, layer: int,
                    primes: dict[int, list[list[int]]] | None = None) -> torch.Tensor:
    """§5.1 hash ids of one Engram layer -> LongTensor [S, (max_ngram-1)·n_heads], columns (n=2: h0.., n=3, ..).
    P_s = c_s·m_s (int64, < 2^63 since c_s < C and m_s <= (2^63-1)//C); R_n = P_0 xor .. xor P_{n-1};
    id = R_n mod prime[n][h] + offset[n][h]."""
    primes = primes if primes is not None else engram_primes(cfg)
    pr = primes[layer]
    offs = engram_offsets(pr)
    mult = torch.tensor(engram_multipliers(cfg, layer), dtype=torch.int64)
    c = engram_shifted_tokens(cfg, input_ids, token_map)  # [S, N]
    P = c * mult  # [S, N] int64, no overflow
    cols = []
    R = P[:, 0]
    for n in range(2, cfg.engram_max_ngram + 1):
        R = torch.bitwise_xor(R, P[:, n - 1])  # R_n
        for h in range(cfg.engram_n_heads):
            cols.append(torch.remainder(R, pr[n - 2][h]) + offs[n - 2][h])
    return torch.stack(cols, dim=-1)


def engram(X: torch.Tensor, ids: torch.Tensor, table: torch.Tensor, wkv: torch.Tensor, q_weight: torch.Tensor,
           k_weight: torch.Tensor, cfg, fq: bool) -> torch.Tensor:
    """§5.2. X [S, n, D]; ids [S, n_ids]; table [rows, hd] (dequantised); wkv [(n+1)D, n_ids·hd].
    key [S, n, D], value [S, D]; gate g_j = σ(copysign(√max(|δ_j|,1e-6), δ_j)) with δ = 0 positive.
    Returns X + g·value (same value to every stream)."""
    S, n, D = X.shape
    rows = table[ids].reshape(S, -1)  # [S, n_ids·hd]
    kv = linear(rows, wkv, fq)  # [S, (n+1)D]
    key = kv[:, : n * D].reshape(S, n, D)
    value = kv[:, n * D:]
    wgt = q_weight * k_weight  # [n, D]
    rho = torch.rsqrt(X.pow(2).mean(-1) + cfg.norm_eps) * torch.rsqrt(key.pow(2).mean(-1) + cfg.norm_eps)  # [S, n]
    delta = (X * wgt * key).sum(-1) * rho / math.sqrt(D)  # [S, n]
    mag = torch.sqrt(torch.clamp(delta.abs(), min=1e-6))
    g = torch.sigmoid(torch.where(delta >= 0, mag, -mag))  # δ = ±0 counts as positive
    return X + g[..., None] * value[:, None, :]


# ================================================================================================================
# §6 attention
# ================================================================================================================

def attention_q(x: torch.Tensor, wq_a, q_norm, wq_b, angles, cfg, fq: bool):
    """§6 q path. x [S, D] -> qr [S, q_lora] (also the indexer latent), q [S, H, d] (RoPE on the rope tail)."""
    qr = rms_norm(linear(x, wq_a, fq), q_norm, cfg.norm_eps)
    q = linear(qr, wq_b, fq).reshape(x.shape[0], cfg.n_heads, cfg.head_dim)
    return qr, apply_rope(q, angles)


def window_kv(x: torch.Tensor, wkv, kv_norm, angles, cfg, fq: bool) -> torch.Tensor:
    """§6 window KV: RMSNorm(kv_norm)(x·wkvᵀ) [S, d], RoPE on the tail, then fq8/32 over all d channels."""
    kv = apply_rope(rms_norm(linear(x, wkv, fq), kv_norm, cfg.norm_eps), angles)
    return fq8(kv, 32) if fq else kv


def window_mask(S: int, window: int) -> torch.Tensor:
    """[S, S] bool: key row i visible to query t iff max(0, t-window+1) <= i <= t."""
    t = torch.arange(S)[:, None]
    i = torch.arange(S)[None, :]
    return (i <= t) & (i > t - window)


def sparse_attention_with_sink(q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, sink: torch.Tensor,
                               scale: float) -> torch.Tensor:
    """§6 (= V4 §4). q [S, H, d]; keys [K, d] (single KV head, rows are keys AND values); mask [S, K] bool
    (duplicate rows allowed, every query must see >= 1 key); sink [H].
    p = exp(s-M) / (Σ exp(s-M) + exp(sink_h - M)), M = max over visible keys; o = Σ p·k -> [S, H, d]."""
    s = torch.einsum("shd,kd->hsk", q, keys) * scale  # [H, S, K]
    s = s.masked_fill(~mask[None], NEG_INF)
    M = s.amax(-1, keepdim=True)  # [H, S, 1]
    e = torch.exp(s - M)
    den = e.sum(-1, keepdim=True) + torch.exp(sink[:, None, None] - M)
    p = e / den
    return torch.einsum("hsk,kd->shd", p, keys)


def attention_output(o: torch.Tensor, wo_a: torch.Tensor, wo_b: torch.Tensor, angles, cfg, fq: bool) -> torch.Tensor:
    """§6 output: inverse RoPE on o's tail; groups g = heads [g·H/G, (g+1)·H/G); a_g = o_g·wo_a[g]ᵀ (no fq);
    out = FP8-linear(wo_b). o [S, H, d] -> [S, D]."""
    S = o.shape[0]
    G, R = cfg.o_groups, cfg.o_lora_rank
    o = apply_rope(o, angles, inverse=True).reshape(S, G, -1)  # [S, G, H/G·d]
    a = torch.einsum("sgi,gri->sgr", o, wo_a.reshape(G, R, -1)).reshape(S, G * R)
    return linear(a, wo_b, fq)


# ================================================================================================================
# §7 compressor
# ================================================================================================================

def compress_ratio2(x: torch.Tensor, wkv: torch.Tensor, wgate: torch.Tensor, norm_w: torch.Tensor,
                    eps: float) -> torch.Tensor:
    """§7 m=2. x [S, D] -> latent [S//2, d] (post-norm, pre-RoPE). Group j = tokens {2j, 2j+1}; per channel
    C_j = Σ_slot softmax_slot(G)·K; no overlap, no ape; odd last token pending (dropped)."""
    E = x.shape[0] // 2
    K = (x[: 2 * E] @ wkv.T).reshape(E, 2, -1)
    Gt = (x[: 2 * E] @ wgate.T).reshape(E, 2, -1)
    C = (torch.softmax(Gt, dim=1) * K).sum(1)
    return rms_norm(C, norm_w, eps)


def compress_ratio1(x: torch.Tensor, wkv: torch.Tensor, norm_w: torch.Tensor, eps: float) -> torch.Tensor:
    """§7 m=1: latent_t = RMSNorm(norm)(x·wkvᵀ), one per token. x [S, D] -> [S, d]."""
    return rms_norm(x @ wkv.T, norm_w, eps)


def compressed_cache(latent: torch.Tensor, m: int, inv_freq: torch.Tensor, fq: bool) -> torch.Tensor:
    """§7 main compressed entries: RoPE (compress table) at position j·m, then fq4_e4m3/16 on all channels.
    latent [E, d] -> [E, d]."""
    ang = rope_angles(inv_freq, torch.arange(latent.shape[0]) * m)
    kv = apply_rope(latent, ang)
    return fq4_e4m3(kv, 16) if fq else kv


def visible_counts(S: int, m: int) -> torch.Tensor:
    """N_t = (t+1)//m, [S] (entry j visible to query t iff j < N_t)."""
    return (torch.arange(S) + 1) // m


# ================================================================================================================
# §8 indexer
# ================================================================================================================

def indexer_keys(latent: torch.Tensor, wk: torch.Tensor, k_norm: torch.Tensor, m: int, inv_freq, cfg,
                 fq: bool) -> torch.Tensor:
    """§8 owner keys from the PRE-RoPE latent: RMSNorm(k_norm)(latent·wkᵀ), RoPE tail at j·m, fq4_ue8m0/32.
    latent [E, d] -> [E, dI]."""
    k = rms_norm(latent @ wk.T, k_norm, cfg.norm_eps)
    k = apply_rope(k, rope_angles(inv_freq, torch.arange(k.shape[0]) * m))
    return fq4_ue8m0(k, 32) if fq else k


def indexer_queries(qr: torch.Tensor, wq_b: torch.Tensor, angles, cfg, fq: bool) -> torch.Tensor:
    """§8 qI = FP8-linear(qr, indexer.wq_b) [S, nI, dI]; RoPE tail at t (compress table); fq4_ue8m0/32."""
    q = linear(qr, wq_b, fq).reshape(qr.shape[0], cfg.index_n_heads, cfg.index_head_dim)
    q = apply_rope(q, angles)
    return fq4_ue8m0(q, 32) if fq else q


def indexer_weights(x: torch.Tensor, weights_proj: torch.Tensor, cfg) -> torch.Tensor:
    """§8 head weights wt = (x·weights_projᵀ)·(dI^-½·nI^-½), [S, nI] (no fq)."""
    return (x @ weights_proj.T) * (cfg.index_head_dim ** -0.5 * cfg.index_n_heads ** -0.5)


def indexer_scores(qI: torch.Tensor, wt: torch.Tensor, kI: torch.Tensor, m: int) -> torch.Tensor:
    """§8 I[t,j] = Σ_h wt[t,h]·relu(qI[t,h]·kI_j), -inf where j >= N_t. qI [S,nI,dI], wt [S,nI], kI [E,dI] -> [S,E]."""
    S, E = qI.shape[0], kI.shape[0]
    I = (torch.relu(torch.einsum("thc,jc->thj", qI, kI)) * wt[..., None]).sum(1)
    invisible = torch.arange(E)[None, :] >= visible_counts(S, m)[:, None]
    return I.masked_fill(invisible, NEG_INF)


def candidate_mask(I: torch.Tensor, m: int, block_size: int, topk_blocks: int) -> torch.Tensor:
    """§8 candidate pre-filter (candidate source layer, on its own scores). I [S, E] (-inf = invisible) -> [S, E]
    bool. Pad to a multiple of block_size with -inf; block score = max; force the newest (partly filled) block
    ⌊(N_t-1)/B⌋ to +inf; keep the top `topk_blocks` blocks, dropping picks scored -inf. Block-granular as in
    the spec: mask[t, j] = "j lies in a kept block", so invisible entries of the kept newest block are True too
    (harmless, their score is already -inf); compare `mask & visible`. Block ties: lower block index wins."""
    S, E = I.shape
    nb = -(-E // block_size)
    Ip = torch.full((S, nb * block_size), NEG_INF, dtype=I.dtype)
    Ip[:, :E] = I
    b = Ip.reshape(S, nb, block_size).amax(-1)  # [S, nb]
    N = visible_counts(S, m)
    rows = torch.nonzero(N > 0).flatten()
    b[rows, (N[rows] - 1) // block_size] = float("inf")
    kb = min(topk_blocks, nb)
    order = torch.sort(b, dim=-1, descending=True, stable=True).indices[:, :kb]  # [S, kb]
    picked_score = torch.gather(b, 1, order)
    keep = torch.zeros(S, nb + 1, dtype=torch.bool)
    keep.scatter_(1, torch.where(picked_score == NEG_INF, nb, order), True)  # dropped picks -> spare column
    return keep[:, :nb].repeat_interleave(block_size, 1)[:, :E]


def topk_select(I: torch.Tensor, k: int, m: int) -> torch.Tensor:
    """§8 top-k: k picks per query (ties: lower index first); picks with j >= N_t -> -1. I [S, E] -> [S, k]."""
    S = I.shape[0]
    idx = torch.sort(I, dim=-1, descending=True, stable=True).indices[:, :k]
    N = visible_counts(S, m)
    return torch.where(idx >= N[:, None], torch.full_like(idx, -1), idx)


def topk_sets(topk: torch.Tensor) -> list[list[int]]:
    """Per-query sorted list of valid picks (drops -1)."""
    return [sorted(int(j) for j in row if j >= 0) for row in topk]


# ================================================================================================================
# §10 MoE
# ================================================================================================================

def swiglu_clipped(x: torch.Tensor, w1, w3, w2, weight: torch.Tensor | None, limit: float, fq: bool) -> torch.Tensor:
    """g = x·w1ᵀ, v = x·w3ᵀ; v = clamp(v, ±limit), g = min(g, limit); a = silu(g)·v(·w_e); y = a·w2ᵀ.
    All three linears are FP8/FP4-weight linears (fq8 input under fake-quant). x [T, D] -> [T, D]."""
    g = linear(x, w1, fq)
    v = torch.clamp(linear(x, w3, fq), -limit, limit)
    g = torch.clamp(g, max=limit)
    a = silu(g) * v
    if weight is not None:
        a = a * weight[:, None]
    return linear(a, w2, fq)


def moe_route(x: torch.Tensor, gate_w: torch.Tensor, gate_bias: torch.Tensor, cfg):
    """§10 gate: s = √softplus(x·gateᵀ) [S, E]; idx = top-k(s + bias) (bias selects only);
    w = s[idx] / (Σ s[idx] + 1e-20) · route_scale. -> idx [S, k], w [S, k]."""
    logits = x @ gate_w.T
    s = torch.sqrt(torch.logaddexp(logits, torch.zeros_like(logits)))  # exact softplus (no threshold)
    idx = torch.sort(s + gate_bias, dim=-1, descending=True, stable=True).indices[:, : cfg.n_activated_experts]
    sel = torch.gather(s, 1, idx)
    return idx, sel / (sel.sum(-1, keepdim=True) + 1e-20) * cfg.route_scale


def moe(x: torch.Tensor, W: dict[str, torch.Tensor], prefix: str, cfg, fq: bool):
    """§10 MoE. x [S, D] (ffn-normed) -> (y [S, D], idx [S, k], w [S, k]). y = Σ_e y_e + shared(x)."""
    idx, wts = moe_route(x, W[prefix + "gate.weight"], W[prefix + "gate.bias"], cfg)
    y = torch.zeros_like(x)
    for e in range(cfg.n_routed_experts):
        tok, slot = torch.nonzero(idx == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        pe = f"{prefix}experts.{e}."
        y[tok] += swiglu_clipped(x[tok], W[pe + "w1.weight"], W[pe + "w3.weight"], W[pe + "w2.weight"],
                                 wts[tok, slot], cfg.swiglu_limit, fq)
    ps = prefix + "shared_experts."
    y = y + swiglu_clipped(x, W[ps + "w1.weight"], W[ps + "w3.weight"], W[ps + "w2.weight"], None,
                           cfg.swiglu_limit, fq)
    return y, idx, wts


# ================================================================================================================
# attention block with the §2 / §9 sharing
# ================================================================================================================

def attention_block(layer: int, x: torch.Tensor, W: dict[str, torch.Tensor], cfg, shared: dict[str, Any],
                    fq: bool, taps: dict | None) -> torch.Tensor:
    """One layer's attention (§6-§9). x [S, D] attn-normed input. `shared` holds the one-slot runtime state
    (compress_kv, index_k, topk, candidates, ratio) published by source layers in layer order."""
    S = x.shape[0]
    p = f"layers.{layer}.attn."
    m = cfg.compress_ratios[layer]
    inv = rope_inv_freq(cfg, compressed=m > 0)
    ang = rope_angles(inv, torch.arange(S))
    qr, q = attention_q(x, W[p + "wq_a.weight"], W[p + "q_norm.weight"], W[p + "wq_b.weight"], ang, cfg, fq)
    kv = window_kv(x, W[p + "wkv.weight"], W[p + "kv_norm.weight"], ang, cfg, fq)  # [S, d]
    keys, mask = kv, window_mask(S, cfg.window_size)

    if m > 0:
        kv_src = layer in cfg.kv_source_layers
        idx_src = layer in cfg.index_source_layers
        if kv_src:
            if m == 2:
                latent = compress_ratio2(x, W[p + "compressor.wkv.weight"], W[p + "compressor.wgate.weight"],
                                         W[p + "compressor.norm.weight"], cfg.norm_eps)
            elif m == 1:
                latent = compress_ratio1(x, W[p + "compressor.wkv.weight"], W[p + "compressor.norm.weight"],
                                         cfg.norm_eps)
            else:
                raise ValueError(f"V4.1 ratio {m} unsupported")
            if taps is not None:
                taps[f"L{layer}.latent"] = latent
        if idx_src:
            if kv_src:  # owner: keys from its own pre-RoPE latent, published
                shared["index_k"] = indexer_keys(latent, W[p + "indexer.wk.weight"], W[p + "indexer.k_norm.weight"],
                                                 m, inv, cfg, fq)
                shared["index_ratio"] = m
                if taps is not None:
                    taps[f"L{layer}.index_keys"] = shared["index_k"]
            assert shared.get("index_ratio") == m, "index keys published by a layer of another ratio"
            qI = indexer_queries(qr, W[p + "indexer.wq_b.weight"], ang, cfg, fq)
            wt = indexer_weights(x, W[p + "indexer.weights_proj.weight"], cfg)
            I = indexer_scores(qI, wt, shared["index_k"], m)
            if layer == cfg.candidate_source_layer:
                shared["candidates"] = candidate_mask(I, m, cfg.candidate_block_size, cfg.candidate_topk_blocks)
                if taps is not None:
                    taps[f"L{layer}.candidates"] = shared["candidates"]
            elif not kv_src and shared.get("candidates") is not None:  # Reindex: only inside the candidates
                I = I.masked_fill(~shared["candidates"], NEG_INF)
            k = min(cfg.index_topk, I.shape[1])
            topk = topk_select(I, k, m)
            # official rule (-1 only for j >= N_t) == HF rule (drop -inf picks) needs no -inf valid pick (§8)
            valid = topk >= 0
            assert torch.isfinite(torch.gather(I, 1, topk.clamp_min(0))[valid]).all(), "valid pick scored -inf"
            shared["topk"] = topk
            if taps is not None:
                taps[f"L{layer}.index_scores"] = I
                taps[f"L{layer}.index_q"] = qI
                taps[f"L{layer}.index_weights"] = wt
        if kv_src:
            shared["compress_kv"] = compressed_cache(latent, m, inv, fq)
            shared["kv_ratio"] = m
            if taps is not None:
                taps[f"L{layer}.compressed_kv"] = shared["compress_kv"]
        assert shared.get("kv_ratio") == m and shared.get("topk") is not None, f"layer {layer}: nothing published"
        ckv, topk = shared["compress_kv"], shared["topk"]
        E = ckv.shape[0]
        sel = torch.zeros(S, E + 1, dtype=torch.bool)
        sel.scatter_(1, torch.where(topk >= 0, topk, E), True)  # -1 -> spare column (never entry 0)
        keys = torch.cat([kv, ckv], dim=0)  # [S + E, d]
        mask = torch.cat([mask, sel[:, :E]], dim=1)  # [S, S + E]
        if taps is not None:
            taps[f"L{layer}.topk"] = topk_sets(topk)
            taps[f"L{layer}.topk_raw"] = topk

    o = sparse_attention_with_sink(q, keys, mask, W[p + "attn_sink"], cfg.head_dim ** -0.5)
    out = attention_output(o, W[p + "wo_a.weight"], W[p + "wo_b.weight"], ang, cfg, fq)
    if taps is not None:
        taps[f"L{layer}.q"] = q
        taps[f"L{layer}.qr"] = qr
        taps[f"L{layer}.window_kv"] = kv
        taps[f"L{layer}.attn_o"] = o
    return out


# ================================================================================================================
# §3 top level
# ================================================================================================================

def spec_forward(cfg, w: dict[str, torch.Tensor], input_ids: torch.Tensor, token_map: torch.Tensor,
                 fake_quant: bool = False, taps: dict | None = None) -> torch.Tensor:
    """Prefill of one sequence from position 0 (§3). input_ids [S] -> logits [S, vocab] float64.

    `w`: official checkpoint tensors (§12 names/formats) or the output of `dequantize_checkpoint(w)`.
    `fake_quant` (not cfg.fake_quant) switches the §11 sites. `taps` (optional dict) receives per-layer values:
    engram_ids.L, L{l}.{engram_out, hc_attn, attn_in, attn_out, streams_mid, hc_ffn, moe_in, moe_out, moe_idx,
    moe_weights, streams, q, qr, window_kv, attn_o, latent, compressed_kv, index_keys, index_q, index_weights,
    index_scores, candidates, topk (sorted sets), topk_raw}, final_hidden, logits.
    """
    W = w if F64_MARKER in w else dequantize_checkpoint(w)
    fq = bool(fake_quant)
    ids = input_ids.to(torch.int64).flatten()
    n = cfg.hc_mult

    X = W["embed.weight"][ids][:, None, :].repeat(1, n, 1)  # [S, n, D]
    pre = torch.zeros(n, dtype=F64)
    pre[0] = 1.0  # one-hot(stream 0)

    primes = engram_primes(cfg) if cfg.engram_layers else {}
    eng_ids = {L: engram_hash_ids(cfg, ids, token_map, L, primes) for L in cfg.engram_layers}
    if taps is not None:
        for L, v in eng_ids.items():
            taps[f"engram_ids.{L}"] = v

    shared: dict[str, Any] = {}
    for layer in range(cfg.n_layers):
        pl = f"layers.{layer}."
        if layer in eng_ids:
            pe = pl + "engram."
            X = engram(X, eng_ids[layer], W[pe + "embed.weight"], W[pe + "wkv.weight"], W[pe + "q_weight"],
                       W[pe + "k_weight"], cfg, fq)
            if taps is not None:
                taps[f"L{layer}.engram_out"] = X
        preA, postA, CA = mhc_mixer(X, W[pl + "hc_attn_fn"], W[pl + "hc_attn_base"], W[pl + "hc_attn_scale"], cfg)
        u = mhc_collapse(X, pre)
        h = attention_block(layer, rms_norm(u, W[pl + "attn_norm.weight"], cfg.norm_eps), W, cfg, shared, fq, taps)
        X_mid = mhc_update(X, h, postA, CA)
        if taps is not None:
            taps[f"L{layer}.hc_attn"] = (preA, postA, CA)
            taps[f"L{layer}.attn_in"] = u
            taps[f"L{layer}.attn_out"] = h
            taps[f"L{layer}.streams_mid"] = X_mid
        preF, postF, CF = mhc_mixer(X_mid, W[pl + "hc_ffn_fn"], W[pl + "hc_ffn_base"], W[pl + "hc_ffn_scale"], cfg)
        u = mhc_collapse(X_mid, preA)
        h, e_idx, e_w = moe(rms_norm(u, W[pl + "ffn_norm.weight"], cfg.norm_eps), W, pl + "ffn.", cfg, fq)
        X = mhc_update(X_mid, h, postF, CF)
        pre = preF
        if taps is not None:
            taps[f"L{layer}.hc_ffn"] = (preF, postF, CF)
            taps[f"L{layer}.moe_in"] = u
            taps[f"L{layer}.moe_out"] = h
            taps[f"L{layer}.moe_idx"] = e_idx
            taps[f"L{layer}.moe_weights"] = e_w
            taps[f"L{layer}.streams"] = X

    y = rms_norm(mhc_collapse(X, pre), W["norm.weight"], cfg.norm_eps)  # no hc_head
    logits = y @ W["head.weight"].T
    if taps is not None:
        taps["final_hidden"] = y
        taps["logits"] = logits
    return logits

"""Build one step's metadata (``StepMeta``) for a packed batch, on the host, before the step.

Each item is a sequence whose cache already holds positions [0, P) (P = ``seq.length``, possibly 0) and whose
slot and pages have been reserved for P + n positions; its n new tokens are appended to the packed batch.
Every index the model reads is computed here (vectorised per sequence), so the compiled step has no host sync.
Index conventions (see ``minidi.model.context``): a row index addresses ``cat([pool, this step's new rows])``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minidi.model.context import RatioMeta, StepMeta

from .cache import CacheManager, SeqCache


@dataclass
class StepItem:
    seq: SeqCache
    new_tokens: list[int]
    history: list[int]  # the last (up to engram_max_ngram - 1) token ids before position P
    all_logits: bool = False


def _cat(parts: list[torch.Tensor], width: int | None = None) -> torch.Tensor:
    if parts:
        return torch.cat(parts)
    return torch.zeros((0,) if width is None else (0, width), dtype=torch.long)


def build_step(cm: CacheManager, items: list[StepItem]) -> StepMeta:
    cfg = cm.cfg
    w, ring = cfg.window_size, cm.ring
    rw = cm.max_slots * ring  # window pool rows
    ids, pos, widx, wsrc, wdst, logit_rows = [], [], [], [], [], []
    offs, o = [], 0
    for it in items:
        offs.append(o)
        o += len(it.new_tokens)
    for i, (it, o) in enumerate(zip(items, offs)):
        seq, n, p0 = it.seq, len(it.new_tokens), it.seq.length
        if p0 + n > cfg.max_position_embeddings:  # checked here, on the host: the model's RoPE lookup does not
            raise ValueError(f"step item {i}: positions [{p0}, {p0 + n}) pass max_position_embeddings "
                             f"{cfg.max_position_embeddings} (the RoPE tables' length)")
        p = torch.arange(p0, p0 + n)
        ids.append(torch.tensor(it.new_tokens, dtype=torch.long))
        pos.append(p)
        kp = p[:, None] - (w - 1) + torch.arange(w)[None, :]  # [n, W] key positions
        rows = torch.where(kp >= p0, rw + o + (kp - p0), seq.slot * ring + kp % ring)
        widx.append(torch.where(kp >= 0, rows, -1))
        q = torch.arange(max(p0, p0 + n - ring), p0 + n)  # new positions that stay in the ring
        wsrc.append(rw + o + (q - p0))
        wdst.append(seq.slot * ring + q % ring)
        logit_rows.append(torch.arange(o, o + n) if it.all_logits else torch.tensor([o + n - 1]))
    meta = StepMeta(
        input_ids=_cat(ids), positions=_cat(pos), window_idx=_cat(widx, w), window_src=_cat(wsrc),
        window_dst=_cat(wdst), logit_rows=_cat(logit_rows),
    )
    for m in cm.ratios:
        meta.ratios[m] = _ratio_meta(cm, items, offs, m)
    if cfg.engram_layers:
        meta.engram_tokens, meta.engram_src = _engram(items, offs, cfg.engram_max_ngram)
    dev = cm.device
    for name, value in vars(meta).items():
        if isinstance(value, torch.Tensor):
            setattr(meta, name, value.to(dev))
    for rm in meta.ratios.values():
        for name, value in vars(rm).items():
            setattr(rm, name, value.to(dev))
    return meta


def _ratio_meta(cm: CacheManager, items: list[StepItem], offs: list[int], m: int) -> RatioMeta:
    cfg = cm.cfg
    overlap = cm.overlap(m)
    pr = cm.pend_rows(m)
    rp = cm.max_slots * pr if m > 1 else 0  # pending pool rows (ratio 1 keeps nothing pending)
    rpool = cm.n_pages[m] * cm.page_size  # compressed pool rows
    align = cfg.candidate_block_size if cfg.is_v41 else 1
    groups, prevs, epos, psrc, pdst, view, pool_src, pool_dst, ks, ke = ([] for _ in range(10))
    e_off, v_off = 0, 0
    for it, o in zip(items, offs):
        seq, n, p0 = it.seq, len(it.new_tokens), it.seq.length
        p1 = p0 + n

        def row(q: torch.Tensor) -> torch.Tensor:  # K|G row of position q: pending pool or this step's tokens
            return torch.where(q >= p0, rp + o + (q - p0), seq.slot * pr + q % pr)

        g0, g1 = p0 // m, p1 // m
        g = torch.arange(g0, g1)
        gp = g[:, None] * m + torch.arange(m)[None, :]  # [Nn_s, m] positions of each new group
        groups.append(row(gp))
        prevs.append(torch.where(gp >= m, row(gp - m), -1) if overlap else torch.full_like(gp, -1))
        epos.append(g * m)
        keep = torch.arange((g1 - 1) * m if (overlap and g1 >= 1) else g1 * m, p1)
        if m > 1:
            psrc.append(row(keep))
            pdst.append(seq.slot * pr + keep % pr)
        # the step's view of this sequence's entries: cached ones from its pages, then the new ones
        j_old = torch.arange(g0)
        old_rows = torch.zeros(0, dtype=torch.long)
        if g0:
            pages = torch.tensor(seq.pages[m], dtype=torch.long)
            old_rows = pages[j_old // cm.page_size] * cm.page_size + j_old % cm.page_size
        new_rows = rpool + e_off + (g - g0)
        seg = torch.cat([old_rows, new_rows])
        pad = -len(seg) % align
        view.append(torch.cat([seg, torch.full((pad,), -1, dtype=torch.long)]))
        if len(g):
            pages = torch.tensor(seq.pages[m], dtype=torch.long)
            pool_src.append(new_rows)
            pool_dst.append(pages[g // cm.page_size] * cm.page_size + g % cm.page_size)
        tpos = torch.arange(p0, p1)
        ks.append(torch.full((n,), v_off, dtype=torch.long))
        ke.append(v_off + (tpos + 1) // m)
        e_off += len(g)
        v_off += len(seg) + pad
    return RatioMeta(
        group_idx=_cat(groups, m), prev_idx=_cat(prevs, m), entry_pos=_cat(epos), pend_src=_cat(psrc),
        pend_dst=_cat(pdst), view_idx=_cat(view), pool_src=_cat(pool_src), pool_dst=_cat(pool_dst),
        k_start=_cat(ks), k_end=_cat(ke),
    )


def _engram(items: list[StepItem], offs: list[int], k: int) -> tuple[torch.Tensor, torch.Tensor]:
    hist = [it.history[-(k - 1):] if k > 1 else [] for it in items]
    h_total = sum(len(h) for h in hist)
    tokens = [t for h in hist for t in h] + [t for it in items for t in it.new_tokens]
    srcs, h_off = [], 0
    for it, o, h in zip(items, offs, hist):
        p0, n = it.seq.length, len(it.new_tokens)
        q = torch.arange(p0, p0 + n)[:, None] - torch.arange(k)[None, :]  # [n, K] position of shift s
        new = h_total + o + (q - p0)
        old = h_off + len(h) - (p0 - q)  # history row (valid when p0 - q <= len(h))
        src = torch.where(q >= p0, new, old)
        srcs.append(torch.where((q >= 0) & ((q >= p0) | (p0 - q <= len(h))), src, -1))
        h_off += len(h)
    return torch.tensor(tokens, dtype=torch.long), _cat(srcs, k)

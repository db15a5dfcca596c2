"""The prefill cache: exactly what an exact continuation needs (spec V4.1 §13, V4 §12), in flat row pools.

Per sequence *slot*: the last W-1 window KV rows of every layer (a ring, row = position mod (W-1)) and the fp32
K|G rows of incomplete compressor groups (row = position mod R, R = m, or 2m when V4 windows overlap). Per
compression ratio m: compressed-KV rows of every kv-source layer and indexer keys of the layers that own them, in
*pages* of ``page_size`` entries, refcounted: a cached prefix's pages are shared by every request that continues it
(no O(prefix) copy); a fork copies only the bounded tail (ring, pending rows, the partly filled last page).
Engram history needs no tensor: the engine keeps every sequence's token ids on the host.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from minidi.model.config import ModelConfig
from minidi.model.context import ModelCache


class CacheFull(RuntimeError):
    """No free slot or page: the scheduler preempts a sequence or waits."""


class CacheStateError(RuntimeError):
    """A ``SeqCache`` that this manager does not hold (released twice, of another manager, or tampered with).

    Raised before anything changes, so a bad handle can never free, share or overwrite another sequence's rows."""


@dataclass
class SeqCache:
    """Host-side state of one cached sequence."""

    length: int = 0  # positions 0..length-1 are in the cache
    slot: int = -1
    pages: dict[int, list[int]] = field(default_factory=dict)  # ratio -> page ids, in entry order


class CacheManager:
    def __init__(self, model_cfg: ModelConfig, max_slots: int, max_tokens: int, page_size: int = 64,
                 device: str | torch.device = "cpu", debug: bool = False) -> None:
        """``max_tokens``: the budget of cached positions summed over resident sequences (sets the page count).
        ``debug``: run ``check()`` (free lists hold no duplicates, refcounts match) after every change."""
        cfg = model_cfg
        self.cfg, self.device, self.page_size = cfg, torch.device(device), page_size
        self.max_slots, self.max_tokens = max_slots, max_tokens
        self.ring = cfg.window_size - 1
        self.ratios = tuple(sorted(set(cfg.compress_ratios) - {0}))
        self.n_pages = {m: -(-max_tokens // m // page_size) + max_slots for m in self.ratios}
        act, d = cfg.torch_dtype, cfg.head_dim
        dev = self.device
        self.tensors = ModelCache()
        for layer in range(cfg.n_layers):
            self.tensors.window[layer] = torch.zeros(max_slots * self.ring, d, dtype=act, device=dev)
            m = cfg.ratio(layer)
            if not cfg.is_kv_source(layer):
                continue
            rows = self.n_pages[m] * page_size
            self.tensors.comp[layer] = torch.zeros(rows, d, dtype=act, device=dev)
            if cfg.owns_index_keys(layer) or (not cfg.is_v41 and cfg.has_indexer(layer)):
                self.tensors.index_k[layer] = torch.zeros(rows, cfg.index_head_dim, dtype=act, device=dev)
            if m > 1:
                width = (2 if (not cfg.is_v41 and m == 4) else 1) * d
                self.tensors.pending[f"L{layer}"] = torch.zeros(max_slots * self.pend_rows(m), 2 * width,
                                                                device=dev)
            if not cfg.is_v41 and cfg.has_indexer(layer):
                self.tensors.pending[f"L{layer}.index"] = torch.zeros(
                    max_slots * self.pend_rows(m), 4 * cfg.index_head_dim, device=dev)
        self.free_slots = list(range(max_slots - 1, -1, -1))
        self.free_pages = {m: list(range(self.n_pages[m] - 1, -1, -1)) for m in self.ratios}
        self.page_refs = {m: [0] * self.n_pages[m] for m in self.ratios}
        self.slot_used = [False] * max_slots  # a slot is either in free_slots or used, never both
        self.debug = debug

    # ---- geometry --------------------------------------------------------------------------------------------------
    def overlap(self, m: int) -> bool:
        return not self.cfg.is_v41 and m == 4

    def pend_rows(self, m: int) -> int:
        return 2 * m if self.overlap(m) else m

    def entry_row(self, seq: SeqCache, m: int, j: int) -> int:
        """Pool row of compressed entry j (0-based) of the sequence."""
        return seq.pages[m][j // self.page_size] * self.page_size + j % self.page_size

    # ---- allocation ----------------------------------------------------------------------------------------------
    def pages_needed(self, seq: SeqCache, new_length: int) -> dict[int, int]:
        out = {}
        for m in self.ratios:
            have = len(seq.pages.get(m, []))
            out[m] = max(0, -(-(new_length // m) // self.page_size) - have)
        return out

    def can_grow(self, seq: SeqCache, new_length: int) -> bool:
        if seq.slot < 0 and not self.free_slots:
            return False
        return all(len(self.free_pages[m]) >= n for m, n in self.pages_needed(seq, new_length).items())

    def grow(self, seq: SeqCache, new_length: int) -> None:
        """Reserve a slot and the pages for ``new_length`` positions (raises CacheFull, changing nothing)."""
        if not self.can_grow(seq, new_length):
            raise CacheFull(f"no room for {new_length} positions")
        if seq.slot >= 0 or seq.pages:
            self._check_held(seq, "grow")
        if seq.slot < 0:
            seq.slot = self._take_slot()
        for m, n in self.pages_needed(seq, new_length).items():
            for _ in range(n):
                seq.pages.setdefault(m, []).append(self._take_page(m))
        self._debug_check()

    def release(self, seq: SeqCache) -> None:
        """Drop the sequence's slot and its references to pages (shared pages stay while referenced).

        Releasing an empty ``SeqCache`` (never grown, or already released) does nothing; one whose slot is free or
        whose pages are not referenced raises ``CacheStateError`` before changing anything (no refcount below
        zero, no page or slot twice in a free list)."""
        if seq.slot < 0 and not seq.pages:
            seq.length = 0
            return
        self._check_held(seq, "release")
        if seq.slot >= 0:
            self.slot_used[seq.slot] = False
            self.free_slots.append(seq.slot)
        for m, pages in seq.pages.items():
            for page in pages:
                self.page_refs[m][page] -= 1
                if self.page_refs[m][page] == 0:
                    self.free_pages[m].append(page)
        seq.slot, seq.pages, seq.length = -1, {}, 0
        self._debug_check()

    def fork(self, prefix: SeqCache) -> SeqCache:
        """A new sequence continuing ``prefix``: full pages are shared (refcount), the partly filled last page of each
        ratio, the window ring and the pending rows are copied into the new sequence's own slot/page.

        Raises ``CacheStateError`` (a prefix this manager does not hold) or ``CacheFull``, changing nothing."""
        self._check_held(prefix, "fork")
        if prefix.slot < 0:
            raise CacheStateError("fork: the prefix has no slot (released?)")
        if not self.free_slots:
            raise CacheFull("no free slot")
        partial = {m: (prefix.length // m) % self.page_size != 0 for m in self.ratios}
        if any(partial[m] and not self.free_pages[m] for m in self.ratios):
            raise CacheFull("no free page for the copied last page")
        seq = SeqCache(length=prefix.length, slot=self._take_slot())
        try:
            self._fork_rows(prefix, seq, partial)
        except BaseException:
            self.release(seq)  # e.g. out of device memory mid-copy: hand the slot and copied pages back
            raise
        self._debug_check()
        return seq

    def _fork_rows(self, prefix: SeqCache, seq: SeqCache, partial: dict[int, bool]) -> None:
        """Copy the prefix's bounded tail into ``seq``'s slot / new last pages and share its full pages."""
        t = self.tensors
        r = self.ring
        src, dst = slice(prefix.slot * r, (prefix.slot + 1) * r), slice(seq.slot * r, (seq.slot + 1) * r)
        for pool in t.window.values():
            pool[dst] = pool[src]
        for name, pool in t.pending.items():
            m = self.cfg.ratio(int(name.split(".")[0][1:]))
            pr = self.pend_rows(m)
            pool[seq.slot * pr:(seq.slot + 1) * pr] = pool[prefix.slot * pr:(prefix.slot + 1) * pr]
        for m in self.ratios:
            pages = list(prefix.pages.get(m, []))
            if partial[m]:
                old = pages.pop()
                new = self._take_page(m)
                seq.pages[m] = [new]  # owned at once: a failed copy below releases it
                ps = self.page_size
                for layer_pool in self._ratio_pools(m):
                    layer_pool[new * ps:(new + 1) * ps] = layer_pool[old * ps:(old + 1) * ps]
                pages.append(new)
                shared = pages[:-1]
            else:
                shared = pages
            for page in shared:
                self.page_refs[m][page] += 1
            seq.pages[m] = pages

    def _ratio_pools(self, m: int) -> list[torch.Tensor]:
        t = self.tensors
        layers = [layer for layer in t.comp if self.cfg.ratio(layer) == m]
        return [t.comp[layer] for layer in layers] + [t.index_k[layer] for layer in layers if layer in t.index_k]

    # ---- ownership and invariants ----------------------------------------------------------------------------------
    def _take_slot(self) -> int:
        slot = self.free_slots.pop()
        assert not self.slot_used[slot], f"slot {slot} was in the free list and in use"
        self.slot_used[slot] = True
        return slot

    def _take_page(self, m: int) -> int:
        page = self.free_pages[m].pop()
        assert self.page_refs[m][page] == 0, f"ratio-{m} page {page} was in the free list with refcount > 0"
        self.page_refs[m][page] = 1
        return page

    def _check_held(self, seq: SeqCache, op: str) -> None:
        """Raise ``CacheStateError`` unless every slot and page ``seq`` names is in use here (before any change)."""
        if not isinstance(seq, SeqCache):
            raise CacheStateError(f"{op}: expected a SeqCache, got {type(seq).__name__}")
        if seq.slot >= 0 and (seq.slot >= self.max_slots or not self.slot_used[seq.slot]):
            raise CacheStateError(f"{op}: slot {seq.slot} is not in use (released twice, or another cache's)")
        if seq.length < 0:
            raise CacheStateError(f"{op}: negative length {seq.length}")
        if not isinstance(seq.pages, dict) or set(seq.pages) - set(self.ratios):
            raise CacheStateError(f"{op}: pages for unknown ratios {sorted(set(seq.pages) - set(self.ratios))}")
        for m, pages in seq.pages.items():
            for page, count in Counter(pages).items():
                if not (isinstance(page, int) and 0 <= page < self.n_pages[m]):
                    raise CacheStateError(f"{op}: ratio-{m} page id {page!r} is outside [0, {self.n_pages[m]})")
                if self.page_refs[m][page] < count:
                    raise CacheStateError(f"{op}: ratio-{m} page {page} is not referenced (released twice, or "
                                          "another cache's)")
        if op == "fork" and any(self.pages_needed(seq, seq.length).values()):
            raise CacheStateError(f"{op}: {seq.length} positions need more pages than the prefix holds")

    def _debug_check(self) -> None:
        if self.debug:
            self.check()

    def check(self, held: list[SeqCache] | None = None) -> None:
        """Assert the pool's invariants: free lists without duplicates, free slots / pages unused, refcounts >= 0.

        ``held``: every live ``SeqCache`` (cached prefixes and running sequences); then the refcount of each page
        must equal the number of them that name it, and the used slots must be exactly theirs."""
        problems: list[str] = []
        if len(set(self.free_slots)) != len(self.free_slots):
            problems.append(f"duplicate slots in the free list {sorted(self.free_slots)}")
        if sorted(set(self.free_slots)) != [s for s in range(self.max_slots) if not self.slot_used[s]]:
            problems.append("free list and used slots disagree")
        for m in self.ratios:
            free = self.free_pages[m]
            if len(set(free)) != len(free):
                problems.append(f"ratio {m}: duplicate pages in the free list")
            refs = self.page_refs[m]
            if any(r < 0 for r in refs):
                problems.append(f"ratio {m}: negative refcounts")
            if sorted(set(free)) != [p for p in range(self.n_pages[m]) if refs[p] == 0]:
                problems.append(f"ratio {m}: free list and refcounts disagree")
        if held is not None:
            slots = [s.slot for s in held if s.slot >= 0]
            if sorted(slots) != [s for s in range(self.max_slots) if self.slot_used[s]]:
                problems.append(f"used slots {[s for s in range(self.max_slots) if self.slot_used[s]]} are not "
                                f"those of the live sequences {sorted(slots)}")
            for m in self.ratios:
                want = [0] * self.n_pages[m]
                for s in held:
                    for page in s.pages.get(m, []):
                        want[page] += 1
                if want != self.page_refs[m]:
                    problems.append(f"ratio {m}: refcounts do not match the live sequences' pages")
        assert not problems, "cache pool corrupt: " + "; ".join(problems)

    def free_counts(self) -> tuple[int, dict[int, int]]:
        """(free slots, {ratio: free pages}): tests compare it before and after a batch."""
        return len(self.free_slots), {m: len(p) for m, p in self.free_pages.items()}

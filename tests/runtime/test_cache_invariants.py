"""The cache pool's ownership checks (issue 18): no SeqCache can free, share or overwrite rows it does not hold.

No model runs here: the pool is built from the tiny config and driven directly (milliseconds).
"""

from __future__ import annotations

import copy

import pytest

from minidi.model.presets import preset
from minidi.runtime.cache import CacheManager, CacheStateError, SeqCache


@pytest.fixture
def cm() -> CacheManager:
    return CacheManager(preset("tiny-v41", dtype="float32"), max_slots=4, max_tokens=256, page_size=4, debug=True)


def _prefix(cm: CacheManager, length: int = 17) -> SeqCache:
    seq = SeqCache()
    cm.grow(seq, length)
    seq.length = length  # as if a step had filled it
    return seq


def test_double_release_of_a_stale_copy_changes_nothing(cm):
    start = cm.free_counts()
    seq = _prefix(cm)
    stale = copy.deepcopy(seq)  # what a freed prefix handle used to carry
    cm.release(seq)
    cm.release(seq)  # the released object itself is empty: a no-op
    assert cm.free_counts() == start
    with pytest.raises(CacheStateError, match="slot 0 is not in use"):
        cm.release(stale)
    assert cm.free_counts() == start
    cm.check(held=[])


def test_fork_of_a_released_or_foreign_prefix_is_refused(cm):
    other = CacheManager(cm.cfg, max_slots=4, max_tokens=256, page_size=4)
    start = cm.free_counts()
    seq = _prefix(cm)
    cm.release(seq)
    with pytest.raises(CacheStateError, match="no slot"):
        cm.fork(seq)
    foreign = _prefix(other, 40)  # slot 0 and pages that are free in cm
    with pytest.raises(CacheStateError, match="not in use"):
        cm.fork(foreign)
    mine = _prefix(cm, 40)
    foreign.slot = mine.slot  # same slot id as a live sequence here, but pages that cm never handed out
    foreign.pages = {m: [p + 1 for p in pages] for m, pages in mine.pages.items()}
    with pytest.raises(CacheStateError, match="page .* is not referenced"):
        cm.fork(foreign)
    forged = SeqCache(length=40, slot=mine.slot, pages={m: [10 ** 6] for m in cm.ratios})
    with pytest.raises(CacheStateError, match="outside"):
        cm.fork(forged)
    cm.release(mine)
    assert cm.free_counts() == start
    cm.check(held=[])


def test_refcounts_never_go_below_zero(cm):
    prefix = _prefix(cm, 40)
    forks = [cm.fork(prefix) for _ in range(2)]
    shared = prefix.pages[2][0]
    assert cm.page_refs[2][shared] == 3
    cm.check(held=[prefix, *forks])
    for f in forks:
        cm.release(f)
    cm.release(prefix)
    assert cm.page_refs[2][shared] == 0
    with pytest.raises(CacheStateError, match="not referenced"):
        cm.release(SeqCache(length=0, slot=-1, pages={2: [shared]}))
    assert all(r >= 0 for refs in cm.page_refs.values() for r in refs)
    cm.check(held=[])


def test_check_finds_duplicate_free_ids_and_leaks(cm):
    seq = _prefix(cm)
    cm.check(held=[seq])
    with pytest.raises(AssertionError, match="not those of the live sequences"):
        cm.check(held=[])  # a leak: the pool holds a slot and pages nobody owns
    m = cm.ratios[0]
    cm.free_pages[m].append(cm.free_pages[m][0])
    with pytest.raises(AssertionError, match="duplicate pages in the free list"):
        cm.check()
    cm.free_pages[m].pop()
    cm.free_slots.append(cm.free_slots[0])
    with pytest.raises(AssertionError, match="duplicate slots"):
        cm.check()

"""Unit tests of the model's hot-spot functions and small blocks against independent float64 formulations."""

import math

import pytest
import torch

from minidi.model.indexer import (block_max, candidate_allowed, candidate_blocks, candidate_mask,
                                  indexer_topk_naive)
from minidi.model.moe import RoutedExperts, grouped_mm, moe_combine_naive
from minidi.model.presets import preset
from minidi.model.sparse_attention import sparse_attention_naive


def _dense_attention_f64(q, keys, valid, sink, scale):
    """Attention over an explicit per-query key list in float64; the sink joins the denominator only."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    for t in range(q.shape[0]):
        k = keys[t][valid[t]].double()  # [K, D]
        s = q[t].double() @ k.T * scale  # [H, K]
        m = s.max(-1, keepdim=True).values
        e = torch.exp(s - m)
        p = e / (e.sum(-1, keepdim=True) + torch.exp(sink.double()[:, None] - m))
        out[t] = p @ k
    return out


def _case(t=13, h=3, d=32, nw=13, nc=7, w=5, kc=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, h, d, generator=g)
    wkv = torch.randn(nw, d, generator=g)
    ckv = torch.randn(nc, d, generator=g)
    pos = torch.arange(t)
    widx = pos[:, None] - (w - 1) + torch.arange(w)[None]
    widx = torch.where(widx >= 0, widx, -1)
    cidx = torch.randint(0, nc, (t, kc), generator=g)
    cidx[::3, -2:] = -1  # ragged: fewer valid compressed keys than slots
    cidx[5] = -1  # a query with no compressed keys at all
    sink = torch.randn(h, generator=g)
    return q, wkv, widx, ckv, cidx, sink


def test_sparse_attention_matches_float64_reference():
    q, wkv, widx, ckv, cidx, sink = _case()
    out = sparse_attention_naive(q, wkv, widx, ckv, cidx, sink, 0.2)
    keys = torch.cat([wkv[widx.clamp(min=0)], ckv[cidx.clamp(min=0)]], 1)
    valid = torch.cat([widx, cidx], 1) >= 0
    ref = _dense_attention_f64(q, keys, valid, sink, 0.2)
    assert (out.double() - ref).abs().max() < 1e-5


def test_sparse_attention_ignores_garbage_in_empty_slots():
    q, wkv, widx, ckv, cidx, sink = _case()
    out = sparse_attention_naive(q, wkv, widx, ckv, cidx, sink, 0.2)
    # a -1 slot must not read row 0: poisoning row 0 of the caches changes only queries that really use it
    wkv2, ckv2 = wkv.clone(), ckv.clone()
    wkv2[0], ckv2[0] = 1e4, 1e4
    out2 = sparse_attention_naive(q, wkv2, widx, ckv2, cidx, sink, 0.2)
    uses0 = (widx == 0).any(1) | (cidx == 0).any(1)
    assert torch.equal(out[~uses0], out2[~uses0])


def test_sparse_attention_sink_is_denominator_only_and_bf16_rounding():
    q, wkv, widx, ckv, cidx, sink = _case(h=2)
    big_sink = torch.full_like(sink, 30.0)  # if the sink entered the max, outputs would not shrink this way
    out = sparse_attention_naive(q, wkv, widx, ckv, cidx, big_sink, 0.2)
    keys = torch.cat([wkv[widx.clamp(min=0)], ckv[cidx.clamp(min=0)]], 1)
    valid = torch.cat([widx, cidx], 1) >= 0
    ref = _dense_attention_f64(q, keys, valid, big_sink, 0.2)
    assert (out.double() - ref).abs().max() < 1e-9 + 1e-5 * ref.abs().max()
    # bf16: the unnormalised probabilities are rounded to bf16 before PV -> equals a reference that rounds there
    qb, wb, cb = q.bfloat16(), wkv.bfloat16(), ckv.bfloat16()
    outb = sparse_attention_naive(qb, wb, widx, cb, cidx, sink, 0.2).double()
    kb = torch.cat([wb[widx.clamp(min=0)], cb[cidx.clamp(min=0)]], 1).float()
    s = torch.einsum("thd,tkd->thk", qb.float(), kb) * 0.2
    s = s.masked_fill(~valid[:, None], float("-inf"))
    m = s.amax(-1, keepdim=True)
    e = torch.exp(s - m)
    den = e.sum(-1, keepdim=True) + torch.exp(sink.view(1, -1, 1) - m)
    rounded = (torch.einsum("thk,tkd->thd", e.bfloat16().float(), kb) / den).bfloat16().double()
    unrounded = (torch.einsum("thk,tkd->thd", e, kb) / den).bfloat16().double()
    assert (outb - rounded).abs().max() <= (outb - unrounded).abs().max()
    assert (outb - rounded).abs().max() < 1e-2


def test_indexer_topk_eager_query_chunks_equal_the_whole_product(monkeypatch):
    """Under an eager budget the [T, Hi, N] product is built in query chunks (memory only): same scores, same
    picks, for chunk sizes that do and do not divide T (ragged last chunk) and for 1-row chunks. These budgets also
    run the top-k in row chunks (its temporaries, ``_PICK_BYTES`` per score)."""
    from minidi.model import indexer

    g = torch.Generator().manual_seed(3)
    t, hi, di, n = 13, 8, 16, 37
    q, k, w = torch.randn(t, hi, di, generator=g), torch.randn(n, di, generator=g), torch.rand(t, hi, generator=g)
    k_start, k_end = torch.zeros(t, dtype=torch.long), torch.randint(1, n + 1, (t,), generator=g)
    allowed = torch.rand(t, n, generator=g) > 0.2
    idx_whole, s_whole = indexer_topk_naive(q, k, w, k_start, k_end, 6, allowed)
    row_bytes = hi * n * q.element_size()
    for rows in (1, 4, 5, t - 1):
        budget = rows * row_bytes + row_bytes // 2  # rows per chunk
        calls = []
        real = indexer._head_weighted_scores
        monkeypatch.setattr(indexer, "_head_weighted_scores", lambda *a: calls.append(a[0].shape[0]) or real(*a))
        idx_c, s_c = indexer_topk_naive(q, k, w, k_start, k_end, 6, allowed, budget)
        assert calls == [rows] * (t // rows) + ([t % rows] if t % rows else [])  # really chunked, ragged tail
        assert torch.allclose(s_c, s_whole, atol=1e-6, rtol=0) and torch.equal(s_c.isinf(), s_whole.isinf())
        assert torch.equal(idx_c, idx_whole)
        monkeypatch.setattr(indexer, "_head_weighted_scores", real)


def test_expert_dequant_eager_chunks_equal_the_whole_stack(monkeypatch):
    """Under an eager budget the FP4 expert stack is decoded a few experts at a time (memory only): bit-equal
    to the whole decode, for chunks that do and do not divide E, with E8M0 edge codes (0, 127, 255 = NaN)."""
    from minidi.model import moe, quant

    g = torch.Generator().manual_seed(4)
    e, n, k = 7, 6, 64
    packed = torch.randint(-128, 128, (e, n, k // 2), dtype=torch.int8, generator=g)
    codes = torch.randint(100, 140, (e, n, k // 32), dtype=torch.uint8, generator=g)
    codes[0, 0, 0], codes[3, 5, 1], codes[6, 2, 0] = 0, 255, 127
    scale = codes.view(torch.float8_e8m0fnu)
    whole = quant.dequant_fp4(packed, scale, torch.bfloat16)
    per_expert = n * k * 12
    for step in (1, 3, e - 1):
        budget = step * per_expert + per_expert // 2
        calls = []
        real = moe.dequant_fp4
        monkeypatch.setattr(moe, "dequant_fp4", lambda p, *a: calls.append(p.shape[0]) or real(p, *a))
        out = moe.dequant_expert_stack(packed, scale, torch.bfloat16, budget)
        assert calls == [step] * (e // step) + ([e % step] if e % step else [])  # really chunked, ragged tail
        assert out.dtype == torch.bfloat16 and torch.equal(out.isnan(), whole.isnan()) and whole.isnan().any()
        assert torch.equal(out.nan_to_num(), whole.nan_to_num())
        monkeypatch.setattr(moe, "dequant_fp4", real)


def test_indexer_topk_matches_float64_and_masks_invisible():
    g = torch.Generator().manual_seed(1)
    t, hi, di, n = 11, 8, 16, 9
    q, k, w = torch.randn(t, hi, di, generator=g), torch.randn(n, di, generator=g), torch.rand(t, hi, generator=g)
    n_vis = (torch.arange(t) + 1) // 1
    idx, scores = indexer_topk_naive(q, k, w, torch.zeros_like(n_vis), n_vis.clamp(max=n), 4)
    ref = (torch.einsum("thd,nd->thn", q.double(), k.double()).relu() * w.double()[..., None]).sum(1)
    vis = torch.arange(n)[None] < n_vis.clamp(max=n)[:, None]
    assert torch.allclose(scores[vis].double(), ref[vis], atol=1e-5)
    assert torch.isinf(scores[~vis]).all()
    for row in range(t):
        picks = set(idx[row][idx[row] >= 0].tolist())
        nv = int(n_vis[row].clamp(max=n))
        assert len(picks) == min(4, nv) and all(p < nv for p in picks)
        want = set(ref[row, :nv].topk(min(4, nv)).indices.tolist())
        assert picks == want


def test_candidate_mask_keeps_best_blocks_and_newest():
    # 2 queries, 12 entries, blocks of 4 -> 3 blocks; keep 1 block (+ the forced newest)
    s = torch.full((2, 12), float("-inf"))
    s[0, :9] = torch.tensor([9.0, 0, 0, 0, 1, 1, 1, 1, 0.5])  # n_vis 9: newest block is 2 (entry 8)
    s[1, :3] = torch.tensor([1.0, 2, 3])  # n_vis 3: only block 0 visible
    m = candidate_mask(s, torch.zeros(2, dtype=torch.long), torch.tensor([9, 3]), keep_blocks=2, block=4)
    assert m[0].tolist() == [True] * 4 + [False] * 4 + [True] * 4  # block 0 (max 9) + forced newest block 2
    assert m[1].tolist() == [True] * 4 + [False] * 8  # -inf blocks are dropped even though 2 may be kept


def test_candidate_blocks_are_ascending_ids_then_minus_one():
    """The candidate source publishes block ids (pass M reads them): each row's kept blocks ascending, -1 for the
    dropped ones at the end; their mask is the [T, N] filter a re-index layer applies."""
    s = torch.full((2, 12), float("-inf"))
    s[0, :9] = torch.tensor([9.0, 0, 0, 0, 1, 1, 1, 1, 0.5])
    s[1, :3] = torch.tensor([1.0, 2, 3])
    b = candidate_blocks(s, torch.zeros(2, dtype=torch.long), torch.tensor([9, 3]), keep_blocks=2, block=4)
    assert b.tolist() == [[0, 2], [0, -1]] and b.dtype == torch.int64
    assert candidate_allowed(b, 12, 4).tolist() == candidate_mask(s, torch.zeros(2, dtype=torch.long),
                                                                  torch.tensor([9, 3]), 2, 4).tolist()
    assert candidate_allowed(b, 10, 4).shape == (2, 10)  # N not a multiple of the block: the last block is partial
    g = torch.Generator().manual_seed(7)
    s = torch.randn(5, 37, generator=g)
    b = candidate_blocks(s, torch.zeros(5, dtype=torch.long), torch.full((5,), 37), keep_blocks=4, block=4)
    assert torch.equal(b, b.sort(dim=1).values) and b.shape == (5, 4) and (b >= 0).all()


@pytest.mark.parametrize("n, block", [(64, 8), (37, 4), (5, 8), (8, 1)])
def test_block_max_equals_the_padded_amax_bitwise(n, block):
    """The elementwise-max chain is the amax of each block (last block padded with -inf), NaN and -inf included."""
    g = torch.Generator().manual_seed(n * 31 + block)
    s = torch.randn(6, n, generator=g).to(torch.bfloat16)
    s[1] = float("-inf")
    s[2, ::3] = float("-inf")
    s[3, n // 2] = float("nan")
    s[4, 0] = float("inf")
    pad = -n % block
    want = torch.nn.functional.pad(s.float(), (0, pad), value=float("-inf")).view(6, -1, block).amax(-1)
    got = block_max(s, block)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert torch.equal(got.isnan(), want.isnan()) and want.isnan().any()
    assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(want))


def test_moe_combine_never_leaks_nonlocal_rows():
    g = torch.Generator().manual_seed(2)
    t, k, d = 5, 3, 8
    rows = torch.randn(t * k, d, generator=g)
    order = torch.randperm(t * k, generator=g)
    local = torch.rand(t * k, generator=g) > 0.4
    rows[~local] = float("nan")
    out = moe_combine_naive(rows, order, local, k)
    slots = torch.zeros(t * k, d, dtype=torch.float64)
    slots[order[local]] = rows[local].double()
    assert torch.isfinite(out).all()
    assert torch.allclose(out.double(), slots.view(t, k, d).sum(1), atol=1e-6)


def test_grouped_mm_matches_per_expert_loop():
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(10, 16, generator=g), torch.randn(3, 8, 16, generator=g)
    offs = torch.tensor([4, 4, 10], dtype=torch.int32)
    out = grouped_mm(x, w, offs)
    ref = torch.cat([x[:4] @ w[0].T, x[4:] @ w[2].T])
    assert torch.allclose(out, ref, atol=1e-5)


def test_routed_experts_state_dict_speaks_checkpoint_names():
    cfg = preset("tiny-v41")
    ex = RoutedExperts(cfg)
    sd = {k: torch.randint(0, 255, v.shape, dtype=torch.uint8).view(v.dtype) if v.dtype != torch.int8 else
          torch.randint(-128, 127, v.shape, dtype=torch.int8) for k, v in ex.state_dict().items()}
    assert "3.w2.scale" in sd and sd["3.w2.weight"].shape == (cfg.dim, cfg.moe_inter_dim // 2)
    ex.load_state_dict(sd)
    assert torch.equal(ex.w2[3], sd["3.w2.weight"])
    bad = dict(sd)
    bad["3.w2.weight"] = bad["3.w2.weight"][:, :-1]
    del bad["4.w1.scale"]
    bad["9.w1.weight"] = sd["0.w1.weight"]
    with pytest.raises(RuntimeError) as e:
        ex.load_state_dict(bad)
    msg = str(e.value)
    assert "3.w2.weight" in msg and "4.w1.scale" in msg and "9.w1.weight" in msg


def test_rope_yarn_tiny_ramp():
    from minidi.model.layers import rope_inv_freq

    cfg = preset("tiny-v41")
    base = 1.0 / (cfg.compress_rope_theta ** (torch.arange(0, 64, 2).double() / 64))
    f = rope_inv_freq(cfg, compressed=True).double()
    # tiny YaRN ramp: lo = 0, hi = 7 (spec §15): pair 0 unscaled, pairs >= 7 divided by the factor 16
    assert math.isclose(f[0].item(), base[0].item(), rel_tol=1e-6)
    assert torch.allclose(f[7:], base[7:] / 16, rtol=1e-6)
    ramp3 = 3 / 7
    assert math.isclose(f[3].item(), (base[3] * (1 - ramp3) + base[3] / 16 * ramp3).item(), rel_tol=1e-6)
    main = rope_inv_freq(cfg, compressed=False).double()
    assert torch.allclose(main, 1.0 / (cfg.rope_theta ** (torch.arange(0, 64, 2).double() / 64)), rtol=1e-6)


def _old_fp32_grouped_mm(x, w, offs):
    """The fp32 form before issue 17 (and still the traceable one): every expert on every row, keep each row's own."""
    expert = torch.bucketize(torch.arange(x.shape[0]), offs.long(), right=True)
    out = torch.einsum("rk,enk->ren", x, w)
    return out.gather(1, expert.clamp(max=w.shape[0] - 1).view(-1, 1, 1).expand(-1, 1, w.shape[1])).squeeze(1)


def test_fp32_routed_experts_under_an_eager_budget_compute_each_row_once():
    """Issue 17 bug: the fp32 grouped GEMM ran every expert on every row (E times the work; a 90 GiB einsum at full
    size). With an eager budget the routed experts do one row's GEMMs once (FLOPs of the real work only) and give
    the einsum's results; without one (the traceable form torch.compile sees) the graph is the einsum's."""
    from torch.utils.flop_counter import FlopCounterMode

    cfg = preset("tiny-v41", dtype="float32", fake_quant=False)
    ex = RoutedExperts(cfg)
    g = torch.Generator().manual_seed(7)
    for name in ex.NAMES:
        w, s = getattr(ex, name), getattr(ex, f"{name}_scale")
        w.data = torch.randint(-128, 128, w.shape, dtype=torch.int8, generator=g)
        s.data = torch.randint(120, 128, s.shape, dtype=torch.uint8, generator=g)
    t, k, e = 23, cfg.n_activated_experts, cfg.n_routed_experts
    x = torch.randn(t, cfg.dim, generator=g)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    wts = torch.rand(t, k, generator=g)
    idx[:5] = torch.arange(k)  # some experts get many rows, some (likely) none
    ex.eager_budget = 1 << 10  # far below the [R, E, N] einsum product
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        out = ex(x, idx, wts, cfg)
    rows = t * k
    real = 2 * rows * cfg.dim * cfg.moe_inter_dim * 3  # w1, w3, w2 once per routed row
    assert fc.get_total_flops() == real, (fc.get_total_flops(), real)
    ex.eager_budget = None
    with torch.no_grad():
        want = ex(x, idx, wts, cfg)
    assert (out - want).abs().max() <= 1e-6 * want.abs().max()  # fp32 summation order only


def test_fp32_grouped_mm_loop_equals_the_einsum_form():
    """The per-expert loop (eager budget) against the old einsum on ragged groups, empty experts and rows past the
    last local expert (other ranks' rows: the loop leaves them zero, the einsum computed garbage; both unread)."""
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(19, 24, generator=g), torch.randn(5, 12, 24, generator=g)
    offs = torch.tensor([3, 3, 9, 9, 16], dtype=torch.int32)  # experts 1 and 3 empty, rows 16.. elsewhere
    want = _old_fp32_grouped_mm(x, w, offs)
    got = grouped_mm(x, w, offs, budget=0)
    torch.testing.assert_close(got[:16], want[:16], atol=1e-6, rtol=1e-6)
    assert torch.equal(got[16:], torch.zeros(3, 12))
    assert torch.equal(grouped_mm(x, w, offs), want)  # no budget: the einsum form itself


# ---- the model stays plain: eager budgets, layer kinds ------------------------------------------------------------
def test_eager_budget_is_set_by_the_runtime_not_read_from_the_compile_state():
    """A built model keeps the whole (traceable) chains; ``set_eager_budget`` reaches every budgeted module and
    ``None`` clears it. The model source never asks whether it is being compiled."""
    import pathlib

    import minidi
    from minidi.model import model as model_mod
    from minidi.model.attention import Attention

    m = minidi.load_model("tiny-v41", dtype="float32", fake_quant=False)
    budgeted = [mod for mod in m.modules() if isinstance(mod, (Attention, RoutedExperts))]
    assert len(budgeted) == 2 * m.cfg.n_layers and all(mod.eager_budget is None for mod in budgeted)
    m.set_eager_budget()
    assert all(mod.eager_budget == model_mod.EAGER_BUDGET_BYTES for mod in budgeted)
    m.set_eager_budget(None)
    assert all(mod.eager_budget is None for mod in budgeted)
    with pytest.raises(ValueError, match="eager budget"):
        m.set_eager_budget(-1)
    src = pathlib.Path(model_mod.__file__).parent
    assert not [p.name for p in src.glob("*.py") if "is_compiling" in p.read_text()]


def test_eager_budget_changes_no_value_of_a_step():
    """A tiny budget chunks every budgeted chain (indexer queries, expert decode, fp32 expert loop): same logits."""
    import minidi

    m = minidi.load_model("tiny-v41", dtype="float32", fake_quant=False)
    ids = torch.randint(0, m.cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        whole = m(ids)
        m.set_eager_budget(256)
        pieces = m(ids)
    m.set_eager_budget(None)
    torch.testing.assert_close(pieces, whole, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["tiny-v41", "tiny-v4"])
def test_block_kind_names_the_roles_that_shape_the_graph(name):
    import minidi

    m = minidi.load_model(name)
    cfg = m.cfg
    for b in m.layers:
        a = b.attn
        ratio = a.ratio
        if cfg.is_v41 and a.ratio and not a.kv_source:  # reads the source's compressed KV, not its own ratio
            ratio = cfg.ratio(max(j for j in cfg.kv_source_layers if j <= b.layer_id)) if a.index_source else "shared"
        assert b.kind() == (ratio, a.kv_source, a.index_source, a.owns_index_keys, a.candidate_filtered,
                            a.candidate_source, a.v4_indexer, b.ffn.gate.hash)
    kinds = [b.kind() for b in m.layers]
    assert 1 < len(set(kinds)) < len(kinds)  # some layers share a graph, not all
    if name == "tiny-v41":  # ratio-2 layers 3, 5 and ratio-1 layers 7, 9 only read shared KV: one kind
        assert len({kinds[i] for i in (3, 5, 7, 9)}) == 1 and len(set(kinds)) == 5
        # an Engram runs in front of the core (its own graph): Engram layers 1 and 4 share layers 0's and 2's kind
        assert kinds[1] == kinds[0] and kinds[4] == kinds[2] and m.layers[1].has_front and m.layers[4].has_front


def test_block_is_its_core_after_its_engram_front():
    """Block.forward = core(front(x)): the composition a per-layer compile repeats with each part compiled."""
    import minidi
    from minidi.model.context import ModelCache, SharedSlots, StepMeta

    m = minidi.load_model("tiny-v41")
    ids = torch.randint(0, m.cfg.vocab_size, (11,), generator=torch.Generator().manual_seed(5))
    meta = StepMeta.for_sequence(ids, m.cfg.window_size, m.ratios, m.cfg.engram_max_ngram)
    engram_ids = m.engram_ids(meta)
    block = m.layers[1]
    assert block.has_front
    x = torch.randn(11, m.cfg.hc_mult, m.cfg.dim, generator=torch.Generator().manual_seed(6)).to(m.cfg.torch_dtype)
    pre = torch.softmax(torch.randn(11, m.cfg.hc_mult, generator=torch.Generator().manual_seed(7)), -1)
    with torch.no_grad():
        whole, pre_w = block(x, pre, meta, ModelCache().layer(1), SharedSlots(), engram_ids[1])
        front = block.front(x, engram_ids[1])
        assert not torch.equal(front, x)  # the Engram changed the streams
        parts, pre_p = block.core(front, pre, meta, ModelCache().layer(1), SharedSlots())
    assert torch.equal(whole, parts) and torch.equal(pre_w, pre_p)

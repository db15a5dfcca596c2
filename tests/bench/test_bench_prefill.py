"""The prefill benchmark end to end on the CPU (``bench/bench_prefill.py``): the result line's fields, the trace,
the emulated expert parallelism, the cached-prefix workload, and one stock-compile run (aot_eager, per layer).
Only what the benchmark reports is checked, never how fast it was."""

from __future__ import annotations

import dataclasses
import gzip
import json

import pytest
import torch
import torch._dynamo

from bench.bench_prefill import main
from bench.prefill_workload import build_model, build_workload
import minidi
from minidi.model import stages
from minidi.runtime.flops import CATEGORIES

FIELDS = ("model", "mode", "passes", "ep", "new_tokens", "cached_tokens", "steps", "ms_per_step",
          "input_tok_per_s_per_gpu", "mfu", "stages_ms", "pass_matches")


@pytest.fixture(autouse=True)
def markers_off_after():
    """``main`` turns the stage markers on for the whole process: put them back."""
    prev = stages.enabled()
    try:
        yield
    finally:
        stages.enabled(prev)


def run(tmp_path, *extra: str) -> tuple[list[dict], list[dict]]:
    jsonl = tmp_path / "r.jsonl"
    cached = [] if "--context" in extra else ["--cached_tokens", "64"]
    argv = ["--model", "tiny-v41", "--device", "cpu", "--steps", "1", "--warmup", "1", "--profile_steps", "1",
            *cached, "--prefill_batch_size", "16", "--out_dir", str(tmp_path), "--result_jsonl", str(jsonl), *extra]
    results = main(argv)
    lines = [json.loads(line) for line in jsonl.read_text().splitlines()]
    return results, lines


@pytest.fixture(scope="module")
def eager(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("eager")
    prev = stages.enabled()
    try:
        results, lines = run(tmp)
    finally:
        stages.enabled(prev)
    return tmp, results, lines


def test_result_line_fields(eager):
    _, results, lines = eager
    assert len(lines) == len(results) == 1
    res = lines[0]
    assert set(FIELDS) <= set(res)
    assert (res["model"], res["mode"], res["passes"], res["ep"]) == ("tiny-v41", "eager", "none", 1)
    assert (res["new_tokens"], res["cached_tokens"], res["steps"]) == (16, 64, 1)
    assert res["ms_per_step"] > 0 and res["input_tok_per_s_per_gpu"] > 0 and res["mfu"] >= 0
    assert res["pass_matches"] is None  # eager: no passes
    assert res["faithful_rounding"] is None  # eager: nothing compiled (compiled modes record the setting)
    assert res["logits_finite"] is True
    assert len(res["host_enqueue_ms"]) == 2 and all(v > 0 for v in res["host_enqueue_ms"])
    assert res["fp8_weight_cache_gib"] == 0  # the CPU keeps no dequantised weights by default (eager: no op either)
    assert {k: v for k, v in results[0].items() if k != "speedup_vs"} == {
        k: v for k, v in res.items() if k != "speedup_vs"}


def test_stage_table(eager):
    stages_ms = eager[2][0]["stages_ms"]
    assert list(stages_ms) == list(CATEGORIES) and len(CATEGORIES) == 6
    assert all(v >= 0 for v in stages_ms.values())
    assert stages_ms["moe"] > 0 and stages_ms["sparse_attention_core"] > 0
    assert stages_ms["communication"] == 0  # one device, no exchange


def test_trace_written(eager):
    tmp, _, lines = eager
    trace = tmp / lines[0]["trace"]
    assert trace.name == "tiny-v41_eager_ep1.trace.json.gz" and trace.is_file()
    with gzip.open(trace, "rt") as f:
        names = {e.get("name") for e in json.load(f)["traceEvents"]}
    assert {"minidi/step", "minidi/attn", "minidi/attn.core", "minidi/indexer", "minidi/moe"} <= names
    assert not (tmp / "tiny-v41_eager_ep1.trace.json").exists()  # only the compressed copy is kept


def test_emulated_ep(tmp_path):
    _, lines = run(tmp_path, "--emulate-ep", "2")
    res = lines[0]
    assert res["ep"] == 2 and res["ep_emulated"] is True
    assert res["stages_ms"]["communication"] > 0 and res["stages_ms"]["moe"] > 0
    assert (tmp_path / "tiny-v41_eager_ep2.trace.json.gz").is_file()


@pytest.mark.parametrize("modes", ["eager,turbo", "Eager"])
def test_bad_mode_is_a_clear_error(tmp_path, modes):
    with pytest.raises(SystemExit, match=r"unknown mode.*choose from \('eager', 'compile', 'passes'\)"):
        run(tmp_path, "--modes", modes)
    assert not (tmp_path / "r.jsonl").exists()


def test_workload_continues_the_cached_prefix():
    notes: list[str] = []
    model = build_model("tiny-v41", "cpu", "float32", 1, "auto", None, 0, notes)
    wl = build_workload(model, 16, 64, 1, 0, notes)
    assert (wl.new_tokens, wl.cached_tokens, wl.seqs) == (16, 64, 1)
    assert torch.equal(wl.meta.positions, torch.arange(64, 80))
    assert wl.meta.input_ids.shape == (16,)
    assert any("cached positions" in n for n in notes)
    with torch.no_grad():
        logits = model.step(wl.meta, wl.cache.tensors)
    assert torch.isfinite(logits).all()


def test_workload_pool_factor():
    """--pool_factor 8: compressed pools 8x the positions the step needs (the step itself unchanged)."""
    model = build_model("tiny-v41", "cpu", "float32", 1, "auto", None, 0, [])
    one, eight = build_workload(model, 16, 64, 1, 0, []), build_workload(model, 16, 64, 1, 0, [], pool_factor=8)
    rows = {n: {k: t.shape[0] for k, t in w.cache.tensors.comp.items()} for n, w in (("1", one), ("8", eight))}
    assert eight.cache.max_tokens == 8 * one.cache.max_tokens
    assert all(rows["8"][k] >= 3 * rows["1"][k] for k in rows["1"]), rows  # pages of 64 rows, +1 per sequence
    assert eight.pool_factor == 8 and any("8x" in n for n in eight.notes)
    assert torch.equal(eight.meta.positions, one.meta.positions)
    with torch.no_grad():
        assert torch.isfinite(model.step(eight.meta, eight.cache.tensors)).all()
    with pytest.raises(SystemExit, match="pool_factor"):
        build_workload(model, 16, 64, 1, 0, [], pool_factor=0)


def test_workload_two_sequences():
    notes: list[str] = []
    model = build_model("tiny-v41", "cpu", "float32", 1, "auto", None, 0, notes)
    wl = build_workload(model, 8, 32, 2, 0, notes)
    assert torch.equal(wl.meta.positions, torch.cat([torch.arange(32, 40)] * 2))


def test_workload_too_long_for_the_model():
    model = build_model("tiny-v41", "cpu", "float32", 1, "auto", None, 0, [])
    with pytest.raises(SystemExit, match="max_position_embeddings"):
        build_workload(model, 64, model.cfg.max_position_embeddings, 1, 0, [])


def test_stock_compile_mode(tmp_path):
    """--modes compile: stock torch.compile (per layer, aot_eager here), no passes, hence no match counts; with
    --compile_cache the line records the cache's status (a miss: an empty folder) and the first step's split."""
    # specialize_float: no symbolic float scalars, so aot_autograd's tensorify pass does not make Dynamo re-trace
    # layers (halves the compile time here); fp32: fewer graph nodes than bf16 with its fp32 islands
    # tiny V4 (4 layers, 3 kinds; tiny V4.1's 5 kinds took 250 s in CI): the mode's code is the same for both
    with torch._dynamo.config.patch(specialize_float=True):
        _, lines = run(tmp_path, "--model", "tiny-v4", "--modes", "compile", "--backend", "aot_eager", "--dtype",
                       "float32", "--compile_cache", str(tmp_path / "cc"))
    res = lines[0]
    assert res["cache"] == "miss" and res["compile_cache"]["reason"] == "no entry for this key"
    assert res["compile_s"]["first_step"] > 0 and {"dynamo_trace", "passes", "backend"} <= set(res["compile_s"])
    detail = res["compile_detail_s"]  # torch's own phases, longest first (Dynamo's includes the backend's); with a
    # compile cache the layers are compiled ahead of time: Dynamo's phase is fullgraph_capture
    assert detail["fullgraph_capture"] > 0 and list(detail.values()) == sorted(detail.values(), reverse=True)
    assert res["compile_s"]["dynamo"] == detail["fullgraph_capture"] and res["compile_s"]["dynamo_trace"] > 0
    assert res["triton_jit"] is None or res["triton_jit"]["compiles"] >= 0
    assert (res["mode"], res["passes"], res["compile_scope"]) == ("compile", "none", "layer")
    assert res["faithful_rounding"] is True  # the default, recorded with the result
    assert res["pass_matches"] is None
    assert res["logits_finite"] is True
    assert res["stages_ms"]["moe"] > 0


def test_out_of_memory_is_recorded_and_the_next_mode_runs(tmp_path, monkeypatch):
    """A mode that runs out of memory (eager at full size, before the chunked indexer; here the compile mode, so that
    nothing is compiled: the mode loop is the same for every mode) writes a JSON line with the error and no speed, and
    the modes after it still run: a long device call loses nothing."""
    import bench.bench_prefill as bp

    real = bp.run_mode

    def compile_ooms(mode, *a, **kw):
        if mode == "compile":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 32.00 GiB\nmore text")
        return real(mode, *a, **kw)

    monkeypatch.setattr(bp, "run_mode", compile_ooms)
    results, lines = run(tmp_path, "--modes", "compile,eager", "--profile_steps", "0", "--dtype", "float32")
    assert [r["mode"] for r in lines] == ["compile", "eager"]
    failed, ran = lines
    assert failed["error"] == "OutOfMemoryError: CUDA out of memory. Tried to allocate 32.00 GiB"
    assert failed["ms_per_step"] is None and failed["input_tok_per_s_per_gpu"] is None
    assert set(FIELDS) <= set(failed)
    assert ran["ms_per_step"] > 0 and "error" not in ran
    assert [r["mode"] for r in results] == ["eager"]


def test_expert_load_stats_by_hand():
    from bench.expert_loads import layer_stats

    st = layer_stats(torch.tensor([256, 0, 300, 20]))
    assert (st["rows"], st["mean"], st["max"], st["min"]) == (576, 144.0, 300, 0)
    assert st["max_over_mean"] == round(300 / 144, 3)
    assert st["tile_fill_bm256"] == round(576 / (256 * 4), 3)  # 1 + 0 + 2 + 1 tiles
    assert st["tile_fill_bm64"] == round(576 / (64 * (4 + 0 + 5 + 1)), 3)
    assert layer_stats(torch.zeros(3, dtype=torch.long))["max_over_mean"] is None


def test_expert_loads_report(tmp_path):
    """--expert_loads: every MoE layer's local rows, N x this rank's count under emulated EP N; the counts the hooks
    read cover every token-slot (T x k per layer)."""
    from bench.expert_loads import collect_counts

    run(tmp_path, "--modes", "eager", "--profile_steps", "0", "--emulate-ep", "2", "--expert_loads")
    report = json.loads((tmp_path / "tiny-v41_ep2_expert_loads.json").read_text())
    model = build_model("tiny-v41", "cpu", "bfloat16", 2, "auto", None, 0, [])
    cfg = model.cfg
    assert report["emulated_ep"] == 2 and report["local_experts"] == cfg.n_local_experts
    assert sorted(map(int, report["layers"])) == list(range(cfg.n_layers))
    assert all(v["rows"] % 2 == 0 and v["rows"] <= 2 * 16 * cfg.n_activated_experts
               for v in report["layers"].values())
    assert set(report["median_over_layers"]) == {"max_over_mean", "cv", "tile_fill_bm256", "tile_fill_bm64"}
    assert report["gate_bias_abs_mean"] > 0.1  # the tiny checkpoint's router bias (0.3 x randn), named in the report
    wl = build_workload(model, 16, 64, 1, 0, [])
    counts = collect_counts(model, lambda: model.step(wl.meta, wl.cache.tensors))
    assert sorted(counts) == list(range(cfg.n_layers))
    assert all(int(c.sum()) == 16 * cfg.n_activated_experts for c in counts.values())
    # the report of a first step of a same-seed model: 2 x the local experts' counts above
    from bench.expert_loads import expert_loads

    twin = build_model("tiny-v41", "cpu", "bfloat16", 2, "auto", None, 0, [])
    wl2 = build_workload(twin, 16, 64, 1, 0, [])
    first_step = expert_loads(twin, lambda: twin.step(wl2.meta, wl2.cache.tensors), emulated_ep=2)
    first, n_local = cfg.first_local_expert, cfg.n_local_experts
    assert all(first_step["layers"][i]["rows"] == 2 * int(c[first:first + n_local].sum()) for i, c in counts.items())
    assert all(first_step["layers"][i]["max"] == 2 * int(c[first:first + n_local].max()) for i, c in counts.items())


def test_eager_mode_sets_the_memory_budget_and_compiled_modes_clear_it():
    """The model never asks whether it is compiled: the benchmark's eager mode sets its eager budget (bounded
    temporaries at full size), a compiled mode clears it (the whole chains the passes match)."""
    import argparse

    from bench.bench_prefill import make_step
    from minidi.model.model import EAGER_BUDGET_BYTES

    model = build_model("tiny-v41", "cpu", "float32", 1, "auto", None, 0, [])
    make_step(model, "eager", argparse.Namespace())
    assert {b.ffn.experts.eager_budget for b in model.layers} == {b.attn.eager_budget for b in model.layers} == {
        EAGER_BUDGET_BYTES}
    make_step(model, "compile", argparse.Namespace(passes="all", backend="aot_eager", compile_scope="layer",
                                                  faithful_rounding="on", autotune=False, cpu_simd=False,
                                                  no_precompile=False, compile_cache=None, compile_workers=None))
    assert {b.ffn.experts.eager_budget for b in model.layers} == {b.attn.eager_budget for b in model.layers} == {None}
    torch._dynamo.reset()
    minidi.uncompile(model)


def test_gate_bias_and_engram_rows_are_for_random_presets_only():
    with pytest.raises(SystemExit, match="--gate_bias / --engram_table_rows choose random weights"):
        build_model("tiny-v41", "cpu", "float32", 1, "auto", None, 0, [], gate_bias="random")
    with pytest.raises(SystemExit, match="--gate_bias / --engram_table_rows"):
        build_model("tiny-v41", "cpu", "float32", 1, "auto", 100, 0, [])


@pytest.mark.parametrize("cached, want", [("0", 0), ("5", 5), (None, 192)])
def test_cached_tokens_as_given(tmp_path, monkeypatch, cached, want):
    """``--cached_tokens 0`` is a prefill with no cached prefix (it ran 192 cached tokens: ``or 192``); no value
    gives the tiny default. Checked on the workload the modes receive (no step is run)."""
    import bench.bench_prefill as bp

    seen = []

    def record(mode, wl, *a, **kw):
        seen.append(wl.cached_tokens)
        raise torch.OutOfMemoryError("stop here")  # recorded as a failed mode: nothing is run

    monkeypatch.setattr(bp, "run_mode", record)
    argv = ["--model", "tiny-v41", "--device", "cpu", "--prefill_batch_size", "8", "--out_dir", str(tmp_path)]
    main(argv + (["--cached_tokens", cached] if cached is not None else []))
    assert seen == [want]


def test_phase_lines_and_median_stage_table(eager, capsys):
    """The run's phases are reported with their seconds; the stage table is the median over the profiled steps and
    the line says how far its sum is from the timed step (or nothing when within 10 %)."""
    res = eager[2][0]
    assert set(res["phases_s"]) >= {"make step", "first step", "timing (1 steps)", "profile (1 steps)"}
    assert res["profile_steps"] == 1 and len(res["profiled_step_sums_ms"]) == 1
    assert sum(res["stages_ms"].values()) == pytest.approx(res["profiled_step_sums_ms"][0], abs=0.01)
    assert "stage_sum_note" in res


def test_stage_sum_note():
    from bench.prefill_profile import stage_sum_note

    assert stage_sum_note(105.0, [100.0, 101.0], cuda=False) is None
    assert "profiler's own cost" in stage_sum_note(200.0, [100.0, 101.0], cuda=False)
    assert "range 50.00-150.00 ms" in stage_sum_note(300.0, [50.0, 100.0, 150.0], cuda=False)
    assert "streams" in stage_sum_note(150.0, [100.0], cuda=True)


def test_kernel_table_in_the_result_line(tmp_path, capsys):
    """--kernels 10: the top 10 of the profile's CPU ops by self time in the line (and printed); they are the first 10
    rows of the table of the saved trace, which keeps the profiler's FLOPs: its mm row has them, its copy row the
    bytes from the recorded shapes, both with a rate and a % of the measured peak."""
    from bench.kernel_table import kernel_table, load_trace

    _, lines = run(tmp_path, "--kernels", "10")
    res = lines[0]
    rows, summary = res["kernels"], res["kernels_summary"]
    assert len(rows) == 10 and len({r["name"] for r in rows}) == 10
    assert [r["ms_per_step"] for r in rows] == sorted((r["ms_per_step"] for r in rows), reverse=True)
    assert all(r["calls_per_step"] >= 1 and r["calls_per_step"] == int(r["calls_per_step"]) for r in rows)
    assert all(r["ms_per_step"] > 0 and r["pct_step"] >= 0 for r in rows) and sum(r["pct_step"] for r in rows) <= 100.1
    assert rows[0]["pct_step"] == pytest.approx(100 * rows[0]["ms_per_step"] / summary["step_ms"], abs=0.01)
    assert summary["basis"] == "cpu op self time" and summary["steps"] == 1 and summary["inductor_bytes"] is False
    assert summary["top_ms_per_step"] <= summary["all_ms_per_step"] <= summary["step_ms"] * 1.001
    for r in rows:  # a rate only where the work is known, and a % of peak with it
        assert ("tflops" in r) == ("flops_per_step" in r) and ("gbps" in r) == ("bytes_per_step" in r)
        assert ("pct_peak" in r) == ("tflops" in r or "gbps" in r)
    full = kernel_table(load_trace(tmp_path / res["trace"]), top=1000, peaks=res["peaks"])
    assert full.rows[:10] == rows
    by_name = {r["name"]: r for r in full.rows}
    mm, copy = by_name["aten::mm"], by_name["aten::copy_"]
    assert mm["flops_per_step"] > 0 and mm["tflops"] > 0 and mm["pct_peak"] > 0
    assert copy["bytes_per_step"] > 0 and copy["gbps"] > 0 and copy["pct_peak"] > 0
    assert "bytes_per_step" not in by_name["aten::cat"]  # a tensor list: not sized from the trace
    out = capsys.readouterr().out
    assert f"top 10 of {summary['distinct']} kernels (cpu op self time)" in out


def test_context_sweep(tmp_path, monkeypatch):
    """--context 16,32,48,1020: one line per point with its cached tokens, the same new tokens, its own FLOPs (growing
    with the context), MFU and stages; the point whose workload runs out of memory, and the one past the model's
    positions (1020 + 16 > 1024), get a line with the error and the next point still runs; the step is made once and
    reused; traces per point; the plot of the sweep."""
    import importlib.util

    import bench.bench_prefill as bp
    from minidi.runtime.flops import step_flops

    real = bp.prefill_workload.build_workload

    def oom_at_32(model, new, cached, *a, **kw):
        if cached == 32:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")
        return real(model, new, cached, *a, **kw)

    monkeypatch.setattr(bp.prefill_workload, "build_workload", oom_at_32)
    results, lines = run(tmp_path, "--context", "16,32,48,1020")
    assert [r["cached_tokens"] for r in lines] == [16, 32, 48, 1020]
    assert [r["cached_tokens"] for r in results] == [16, 48]
    first, failed, last, too_long = lines
    assert "exceed max_position_embeddings 1024" in too_long["error"] and too_long["ms_per_step"] is None
    assert failed["error"].startswith("OutOfMemoryError") and failed["failed_in"] == "build workload"
    assert failed["ms_per_step"] is None and failed["new_tokens"] == 16 and set(FIELDS) <= set(failed)
    cfg = build_model("tiny-v41", "cpu", "bfloat16", 1, "auto", None, 0, []).cfg
    for r in (first, last):
        assert set(FIELDS) <= set(r) and r["new_tokens"] == 16 and r["mode"] == "eager"
        assert r["flop_per_step"] == step_flops(cfg, 16, r["cached_tokens"], 1)["total"]
        assert r["ms_per_step"] > 0 and r["stages_ms"]["moe"] > 0
        want_mfu = r["flop_per_step"] / (r["ms_per_step"] * 1e-3) / (r["peaks"]["bf16_tflops"] * 1e12)
        assert r["mfu"] == pytest.approx(want_mfu, abs=1e-4)  # (rounded to 4 decimals: ~0 on a slow CPU)
        assert (tmp_path / r["trace"]).is_file() and r["trace"].endswith(f"_ctx{r['cached_tokens']}.trace.json.gz")
    assert last["flop_per_step"] > first["flop_per_step"]  # attention reads more keys
    assert (first["step_reused"], last["step_reused"]) == (False, True)
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "tiny-v41_ep1_context.png").is_file()


@pytest.mark.parametrize("extra, match", [
    (["--context", "16,32", "--cached_tokens", "8"], "replaces --cached_tokens"),
    (["--context", "16,x"], "comma list"),
    (["--context", "16,16"], "distinct"),
    (["--kernels", "-1"], "--kernels"),
    (["--inductor_bytes"], "add --kernels"),
    (["--kernels", "5", "--inductor_bytes", "--compile_cache", "cc"], "drop --compile_cache"),
    (["--kernels", "5", "--profile_steps", "0"], "profile_steps"),
])
def test_sweep_and_kernel_flags_are_checked(tmp_path, extra, match):
    with pytest.raises(SystemExit, match=match):
        main(["--model", "tiny-v41", "--device", "cpu", "--out_dir", str(tmp_path), *extra])


def test_inductor_bytes_compiles_with_inductor_byte_counts():
    """--inductor_bytes: compiled modes compile with benchmark_kernel (Inductor's kernel_num_gb in each Triton
    kernel's launch record) and no FX graph cache; eager and the default change nothing."""
    import argparse

    from bench.bench_prefill import _compile_settings

    cfg = torch._inductor.config
    before = (cfg.benchmark_kernel, cfg.fx_graph_cache)
    with _compile_settings("passes", argparse.Namespace(inductor_bytes=True)):
        assert cfg.benchmark_kernel is True and cfg.fx_graph_cache is False
    assert (cfg.benchmark_kernel, cfg.fx_graph_cache) == before
    for mode, on in (("eager", True), ("compile", False)):
        with _compile_settings(mode, argparse.Namespace(inductor_bytes=on)):
            assert (cfg.benchmark_kernel, cfg.fx_graph_cache) == before


@pytest.mark.parametrize("fake_quant", [True, False])
def test_random_cache_holds_fq4_index_keys_like_the_model(fake_quant):
    """The random prefix's indexer keys are what the model writes (fq4 with fake quant on), so pass B's FP8 score
    meets the cache a real prefix gives it (round 11: random normal keys sent every row to its bf16 fallback)."""
    from bench.prefill_workload import fill_random
    from minidi.model.presets import preset
    from minidi.model.quant import fq4_ue8m0
    from minidi.runtime.cache import CacheManager

    cfg = dataclasses.replace(preset("tiny-v41"), fake_quant=fake_quant)
    cm = CacheManager(cfg, max_slots=1, max_tokens=256, device="cpu")
    fill_random(cm, 0)
    assert cm.tensors.index_k
    for k in cm.tensors.index_k.values():
        assert k.abs().sum() > 0
        assert torch.equal(fq4_ue8m0(k.float(), 32).to(k.dtype), k) == fake_quant

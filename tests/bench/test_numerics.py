"""The numerics harness (``bench/numerics.py``, ``bench/fidelity.py``): its metrics, the fp32 twin, the teacher-forced
probe (a perturbed layer shows up in that layer only), and one CPU run end to end with the ``aot_eager`` backend
(eager's own kernels: every compiled layer must then be bit-equal to eager; tiny V4: 3 layer kinds to compile)."""

from __future__ import annotations

import json

import pytest
import torch
import torch._dynamo

import minidi
from bench import fidelity, numerics, prefill_workload


def test_metrics():
    ref = torch.randn(64, 32, dtype=torch.float64)
    assert fidelity.rel_rms(ref, ref) == 0.0
    assert fidelity.rel_rms(ref * 1.01, ref) == pytest.approx(0.01, rel=1e-9)
    assert fidelity.max_abs(ref + 0.5, ref) == pytest.approx(0.5)
    ref_idx = torch.tensor([[0, 3, -1], [2, -1, -1], [-1, -1, -1]])
    test_idx = torch.tensor([[3, 1, -1], [2, 0, -1], [0, 1, 2]])
    assert fidelity.agreement(test_idx, ref_idx, columns=4) == pytest.approx(2 / 3)  # picks 3 and 2 of 0, 3, 2
    assert fidelity.agreement(test_idx, torch.full((3, 3), -1), columns=4) is None


def test_fp32_twin_shares_the_quantised_tensors():
    model = minidi.load_model("tiny-v41")
    twin = fidelity.fp32_twin(model)
    assert twin.cfg.dtype == "float32" and model.cfg.dtype == "bfloat16"
    src = dict(model.named_parameters())
    for name, p in twin.named_parameters():
        if src[name].dtype == torch.bfloat16:
            assert p.dtype == torch.float32 and torch.equal(p, src[name].float()), name
        else:
            assert p is src[name], name  # FP8 / FP4 / scales / fp32 tensors: the same storage
    ids = torch.arange(9) * 7
    assert torch.isfinite(twin(ids)).all()


def _workload(name: str = "tiny-v41"):
    notes: list[str] = []
    model = prefill_workload.build_model(name, "cpu", "bfloat16", 1, "auto", None, 0, notes)
    return model, prefill_workload.build_workload(model, 12, 40, 1, 0, notes)


def test_probe_finds_the_perturbed_layer_and_keeps_the_step_eager():
    model, wl = _workload()
    snap = fidelity.model_cache_snapshot(wl.cache.tensors)
    with torch.no_grad():
        want = model.step(wl.meta, wl.cache.tensors)
        bad = 2

        def perturbed(x, pre, meta, lc, shared, engram_ids=None):
            x, pre = model.layers[bad]._call_impl(x, pre, meta, lc, shared, engram_ids)
            lc.window.add_(1.0)  # a wrong cache write too
            return x * 1.01, pre

        compiled = [None] * len(model.layers)
        compiled[bad] = perturbed
        compiled[bad + 1] = model.layers[bad + 1]._call_impl  # an exact "compiled" layer
        fidelity.model_cache_restore(wl.cache.tensors, snap)
        probe = fidelity.LayerProbe(model, compiled, fidelity.fp32_twin(model))
        with probe:
            got = model.step(wl.meta, wl.cache.tensors)
    assert torch.equal(got, want)  # the probe hands eager's outputs on: the step is eager's
    assert all(b._compiled_call_impl is None for b in model.layers)  # uninstalled
    recs = probe.records
    assert [r["layer"] for r in recs] == list(range(len(model.layers)))
    assert 0.005 < recs[bad]["compiled_rel_rms"] < 0.02  # 1 % (in bf16 steps)
    assert recs[bad]["compiled_cache_rel_rms"] > 0.1
    assert recs[bad + 1]["compiled_rel_rms"] == 0.0 and recs[bad + 1]["compiled_cache_rel_rms"] in (0.0, None)
    assert "compiled_rel_rms" not in recs[0]
    assert all(0 < r["eager_vs_fp32_rel_rms"] < 0.5 for r in recs)  # bf16 noise: present, bounded


def test_harness_end_to_end_on_cpu(tmp_path):
    torch._dynamo.reset()
    out = tmp_path / "numerics.jsonl"
    result = numerics.main(["--model", "tiny-v4", "--modes", "compile", "--backend", "aot_eager",
                            "--prefill_batch_size", "12", "--cached_tokens", "40", "--result_jsonl", str(out)])
    line = json.loads(out.read_text().splitlines()[-1])
    assert line == json.loads(json.dumps(result))
    mode = line["modes"]["compile"]
    assert len(mode["layers"]) == 4 and mode["pass_matches"] is None
    assert all(r["compiled_rel_rms"] == 0.0 for r in mode["layers"])  # aot_eager runs eager's kernels
    assert mode["logits"]["rel_rms"] == 0.0 and mode["logits"]["argmax_agree"] == 1.0
    assert any("compiled_experts_agree" in r for r in mode["layers"])  # V4 keeps its top-k inside the layer
    assert line["eager_vs_fp32_logits"]["rel_rms"] > 0

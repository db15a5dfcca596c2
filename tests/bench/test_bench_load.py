"""``bench/bench_load.py`` end to end on the CPU with the tiny model: the phases run, the result line has its fields.
Only what the benchmark reports is checked, never how fast it was."""

from __future__ import annotations

from bench.bench_load import bench_config, main


def test_bench_config_cuts_the_schedule():
    cfg = bench_config("v41-flash", 3)
    assert (cfg.n_layers, cfg.compress_ratios, cfg.kv_source_layers, cfg.engram_layers) == (3, (0, 0, 2), (2,), ())
    assert cfg.n_routed_experts == 384 and cfg.dim == 5120 and not cfg.validate()
    assert bench_config("tiny-v41", 3).engram_layers == (1,)


def test_bench_load_tiny(tmp_path, capsys):
    jsonl = tmp_path / "r.jsonl"
    res = main(["--model", "tiny-v41", "--layers", "3", "--device", "cpu", "--ep", "2", "--shard_gb", "0.001",
                "--dir", str(tmp_path / "ckpt"), "--no_naive", "--result_jsonl", str(jsonl)])
    assert not (tmp_path / "ckpt").exists()  # removed afterwards
    assert res["n_shards"] > 1 and res["largest_shard_bytes"] > 0 and res["disk_read_gbps"] > 0
    assert set(res["loads"]) == {"ep1", "ep2_rank0"}
    ep1, rank = res["loads"]["ep1"], res["loads"]["ep2_rank0"]
    assert 0 < rank["bytes"] < ep1["bytes"] <= res["checkpoint_bytes"]  # the rank reads only its experts
    assert ep1["gbps"] > 0 and ep1["maxrss_bytes"] > 0 and "pct_of_disk" in ep1
    assert isinstance(res["stream_ge_70pct_of_disk"], bool) and isinstance(res["host_growth_lt_2x_shard"], bool)
    assert jsonl.read_text().strip().splitlines()[-1].startswith('{"bench": "load"')
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith('{"bench": "load"')

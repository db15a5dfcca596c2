"""Checkpoint load throughput against the disk's own read speed, and the loader's peak host memory.

    python bench/bench_load.py --dir /path/on/the/disk/ckpt --layers 2 --device cuda     # H200: ~18 GB, ~2 min
    python bench/bench_load.py --model tiny-v41 --layers 3 --device cpu                  # CPU smoke (seconds)

1. writes a synthetic checkpoint of the first ``--layers`` layers of ``--model`` in the release layout (every routed
   expert, FP4/FP8 + scales, ``write_checkpoint`` shards of ``--shard_gb``; random weights from the weight table).
   At full size the Engram layers are left out (one table is 98 GB; the expert layers are what an EP rank streams).
2. measures the disk: every shard read once with large sequential reads (64 MiB ``readinto``) after evicting the
   files from the page cache (``/proc/sys/vm/drop_caches`` when writable, else ``posix_fadvise(DONTNEED)`` after a
   ``sync``; the card says which, and "cached" when neither worked).
3. loads with the streaming loader (``load_checkpoint(..., device)`` + ``TensorReader``) at EP1 and as rank 0 of
   ``--ep`` (reading only its experts), each in a fresh process after evicting the cache again: GB/s over the bytes
   read, % of the disk's speed, peak host memory (``ru_maxrss``; after the CUDA context, and its growth during the
   load). Also the old path at EP1 (``safe_open.get_tensor`` into host memory, then ``.to(device)``) for contrast.
Targets (issue 24): streaming >= 70 % of the disk's read speed; peak host memory growth < 2x the largest shard.
Prints a card, a table and, last, one JSON line (appended to ``--result_jsonl`` when given).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from minidi.model.config import ModelConfig
from minidi.model.presets import preset

REPO = Path(__file__).resolve().parent.parent  # the child phases import minidi from here (PYTHONPATH)
READ_CHUNK = 64 << 20


def bench_config(model: str, layers: int) -> ModelConfig:
    """The first ``layers`` layers of a preset, with the layer schedule cut to match (sources, candidate layer);
    full-size Engram layers dropped (their tables do not fit the disk)."""
    base = preset(model)
    keep = lambda xs: tuple(x for x in xs if x < layers)  # noqa: E731
    kv = keep(base.kv_source_layers)
    eng = [(L, n) for L, n in zip(base.engram_layers, base.engram_num_embeddings) if L < layers]
    if base.engram_num_embeddings and max(base.engram_num_embeddings) > 10**8:
        eng = []
    kw = dict(n_layers=layers, compress_ratios=base.compress_ratios[:layers])
    if base.is_v41:
        cand = base.candidate_source_layer if base.candidate_source_layer in kv else (kv[-1] if kv else -1)
        kw.update(kv_source_layers=kv, index_source_layers=keep(base.index_source_layers), candidate_source_layer=cand,
                  engram_layers=tuple(L for L, _ in eng), engram_num_embeddings=tuple(n for _, n in eng))
    else:
        kw.update(n_hash_layers=min(base.n_hash_layers, layers))
    return preset(model, **kw).with_(name=f"{model}-{layers}l")


def maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def shard_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


def evict(folder: Path) -> str:
    """Drop ``folder``'s shard files from the page cache; returns how ('drop_caches', 'fadvise' or 'cached')."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        pass
    if not hasattr(os, "posix_fadvise"):
        return "cached"
    for p in shard_files(folder):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "fadvise"


def filesystem(folder: Path) -> str:
    """The mount (type, device) holding ``folder``, from /proc/mounts (tmpfs would measure RAM, not a disk)."""
    best = ("?", "?", "")
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            dev, mnt, typ = line.split()[:3]
            if str(folder.resolve()).startswith(mnt) and len(mnt) >= len(best[2]):
                best = (typ, dev, mnt)
    except OSError:
        pass
    return f"{best[0]} ({best[1]} on {best[2]})"


# ---- phases (each in its own process, so ru_maxrss is the phase's own peak) ----------------------------------------
def phase_write(args: argparse.Namespace) -> dict:
    from minidi.runtime.checkpoint import write_checkpoint
    from minidi.runtime.random_weights import random_state_dict

    cfg = bench_config(args.model, args.layers)
    dev = args.device if args.device != "cpu" else "cpu"
    t0 = time.perf_counter()
    # one routed-expert set drawn and aliased by every layer (write_checkpoint still writes each layer's copy in
    # full): the files are the real layout and size, the draw is one layer's
    sd = random_state_dict(cfg, seed=0, device=dev, share_experts=True)
    if dev != "cpu":
        torch.cuda.synchronize()
    t1 = time.perf_counter()
    folder = Path(args.dir)
    shutil.rmtree(folder, ignore_errors=True)
    write_checkpoint(folder, cfg, sd, max_shard_bytes=int(args.shard_gb * (1 << 30)))
    os.sync()
    t2 = time.perf_counter()
    files = shard_files(folder)
    return {"generate_s": t1 - t0, "write_s": t2 - t1, "checkpoint_bytes": sum(p.stat().st_size for p in files),
            "n_shards": len(files), "largest_shard_bytes": max(p.stat().st_size for p in files),
            "n_tensors": len(sd)}


def phase_disk(args: argparse.Namespace) -> dict:
    folder = Path(args.dir)
    how = evict(folder)
    buf = bytearray(READ_CHUNK)
    mv = memoryview(buf)
    total = 0
    t0 = time.perf_counter()
    for p in shard_files(folder):
        with open(p, "rb", buffering=0) as f:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
            while k := f.readinto(mv):
                total += k
    dt = time.perf_counter() - t0
    return {"cache": how, "bytes": total, "s": dt, "gbps": total / dt / 1e9}


def phase_load(args: argparse.Namespace) -> dict:
    from minidi.runtime.build import rank_experts_only
    from minidi.runtime.checkpoint import load_checkpoint
    from minidi.runtime.stream_load import TensorReader

    folder = Path(args.dir)
    cfg = ModelConfig.from_hf_config(folder)
    if args.ep > 1:
        cfg = cfg.with_(ep_size=args.ep, ep_rank=args.rank)
    only = rank_experts_only(cfg) if args.ep > 1 else None
    dev = torch.device(args.device)
    if dev.type == "cuda":
        torch.empty(1, device=dev)  # the CUDA context is not the loader's memory: count from after it
    how = evict(folder)
    base = maxrss_bytes()
    t0 = time.perf_counter()
    if args.naive:  # the old path: every tensor into host memory first, then moved
        from safetensors import safe_open

        host, nbytes = {}, 0
        for p in shard_files(folder):
            with safe_open(str(p), framework="pt") as f:
                for n in f.keys():
                    if only is None or only(n):
                        host[n] = f.get_tensor(n)
                        nbytes += host[n].numel() * host[n].element_size()
        tensors = {n: t.to(dev) for n, t in host.items()}
        del host
    else:
        reader = TensorReader(dev, progress=None)
        _, tensors = load_checkpoint(folder, cfg=cfg, device=dev, only=only, reader=reader)
        nbytes = reader.bytes_read
    if dev.type == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    peak = maxrss_bytes()
    return {"cache": how, "ep": args.ep, "rank": args.rank, "naive": args.naive, "bytes": nbytes, "s": dt,
            "gbps": nbytes / dt / 1e9, "n_tensors": len(tensors), "maxrss_bytes": peak,
            "host_growth_bytes": peak - base}


PHASES = {"write": phase_write, "disk": phase_disk, "load": phase_load}


def run_phase(args: argparse.Namespace, phase: str, *extra: str) -> dict:
    """Run one phase in a fresh interpreter; its last stdout line is the phase's JSON."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--_phase", phase, "--dir", str(args.dir), "--model",
           args.model, "--layers", str(args.layers), "--device", args.device, "--shard_gb", str(args.shard_gb),
           *extra]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(cmd, env=env, check=True, stdout=subprocess.PIPE, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="bench_load_ckpt", help="folder for the synthetic checkpoint (on the disk to "
                    "measure, not tmpfs); removed afterwards unless --keep")
    ap.add_argument("--model", default="v41-flash")
    ap.add_argument("--layers", type=int, default=2, help="first N layers of --model (2 at full size: ~18 GB)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--ep", type=int, default=4, help="EP size of the one-rank measurement (rank 0)")
    ap.add_argument("--shard_gb", type=float, default=4.0, help="max shard size in GiB (the release's are ~4)")
    ap.add_argument("--no_naive", action="store_true", help="skip the old host-first path")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint folder")
    ap.add_argument("--result_jsonl", default=None)
    ap.add_argument("--_phase", choices=tuple(PHASES), help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--naive", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._phase:
        res = PHASES[args._phase](args)
        print(json.dumps(res))
        return res

    folder = Path(args.dir).resolve()
    args.dir = str(folder)
    cfg = bench_config(args.model, args.layers)
    dev_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"device {dev_name}; checkpoint {cfg.name}: {cfg.n_layers} layers, dim {cfg.dim}, {cfg.n_routed_experts} "
          f"experts, engram layers {list(cfg.engram_layers)}; folder {folder} on {filesystem(folder.parent)}")
    try:
        w = run_phase(args, "write")
        print(f"wrote {w['checkpoint_bytes'] / 1e9:.2f} GB in {w['n_shards']} shards (largest "
              f"{w['largest_shard_bytes'] / 1e9:.2f} GB): generate {w['generate_s']:.1f} s, write {w['write_s']:.1f} s")
        disk = run_phase(args, "disk")
        loads = {"ep1": run_phase(args, "load", "--ep", "1"),
                 f"ep{args.ep}_rank0": run_phase(args, "load", "--ep", str(args.ep), "--rank", "0")}
        if not args.no_naive:
            loads["ep1_naive"] = run_phase(args, "load", "--ep", "1", "--naive")
    finally:
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)

    shard = w["largest_shard_bytes"]
    print(f"\ndisk: {disk['bytes'] / 1e9:.2f} GB sequential in {disk['s']:.2f} s = {disk['gbps']:.2f} GB/s "
          f"(page cache: {disk['cache']})")
    print(f"{'load':<14}{'GB':>8}{'s':>8}{'GB/s':>8}{'% disk':>8}{'maxrss GB':>11}{'growth GB':>11}{'/shard':>8}")
    for k, r in loads.items():
        r["pct_of_disk"] = 100 * r["gbps"] / disk["gbps"]
        r["growth_over_shard"] = r["host_growth_bytes"] / shard
        print(f"{k:<14}{r['bytes'] / 1e9:>8.2f}{r['s']:>8.2f}{r['gbps']:>8.2f}{r['pct_of_disk']:>8.0f}"
              f"{r['maxrss_bytes'] / 1e9:>11.2f}{r['host_growth_bytes'] / 1e9:>11.2f}{r['growth_over_shard']:>8.2f}")
    streamed = [r for k, r in loads.items() if not r["naive"]]
    result = {
        "bench": "load", "device": dev_name, "model": cfg.name, "layers": cfg.n_layers, "experts": cfg.n_routed_experts,
        "checkpoint_bytes": w["checkpoint_bytes"], "n_shards": w["n_shards"], "largest_shard_bytes": shard,
        "page_cache": disk["cache"], "filesystem": filesystem(folder.parent), "disk_read_gbps": disk["gbps"],
        "write": w, "loads": loads,
        "stream_ge_70pct_of_disk": all(r["pct_of_disk"] >= 70 for r in streamed),
        "host_growth_lt_2x_shard": all(r["growth_over_shard"] < 2 for r in streamed),
    }
    line = json.dumps(result)
    if args.result_jsonl:
        with open(args.result_jsonl, "a") as f:
            f.write(line + "\n")
    print(line)
    return result


if __name__ == "__main__":
    main()

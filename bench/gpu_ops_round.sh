#!/usr/bin/env bash
# One device call: GPU tests of the ops, then their benchmarks. Usage: bash bench/gpu_ops_round.sh NAME... 
# (names: tests sparse_attention moe_small_ops fp4_grouped_gemm indexer). Logs and JSON go to $OUT.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
for name in "$@"; do
  start=$(date +%s)
  case "$name" in
    tests) timeout 240 python3 -m pytest -q -m gpu tests/ops -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1; tail -15 "$OUT/gpu_tests.log" ;;
    *) timeout 200 python3 "bench/bench_${name}.py" --out "$OUT/${name}.json" > "$OUT/${name}.log" 2>&1; tail -25 "$OUT/${name}.log" ;;
  esac
  echo "== $name took $(( $(date +%s) - start ))s"
done

#!/usr/bin/env bash
# Round 5, call 1 (nvidia-h200-x2), default build (unswapped SS_EP4 / SS_EP1 FP4 tiles, Triton 3.6's ptxas 12.8).
# GPU 0: V4.1 EP4 --modes passes,compile in one process: the same-run ratio of issue 6.
# GPU 1: stock compile first (fills the shared Inductor / Triton caches while GPU 0 compiles its passes graphs;
#        steady-state timings do not depend on it), then the FP4 race sweep with swapped one-warpgroup tiles
#        (triton issue 11047: the wgmma wait does not sync across warpgroups), the rows repro on one of them, and
#        the op GPU tests with the new defaults.
set -uo pipefail
cd "$(dirname "$0")/../.."
export TRITON_INTERPRET=0 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
W=/tmp/r5c1; mkdir -p $W/g0_same_run $W/g1_compile $W/g1_ops
E="--no_cuda_graph --prefill_batch_size 4096"
(
  export CUDA_VISIBLE_DEVICES=0
  OUT=$W/g0_same_run timeout 585 bash bench/gpu_prefill_round.sh --model v41-flash --emulate-ep 4 \
    --modes passes,compile $E > /dev/null 2>&1
) &
(
  export CUDA_VISIBLE_DEVICES=1
  OUT=$W/g1_compile timeout 290 bash bench/gpu_prefill_round.sh --model v41-flash --emulate-ep 4 --modes compile $E \
    > /dev/null 2>&1
  timeout 130 python bench/debug/fp4_config_race.py --out $W/g1_ops/race.json > $W/g1_ops/race.log 2>&1
  for b in "BM=128,BN=128,BK=64,num_warps=4,num_stages=3,swap=1" "BM=64,BN=128,BK=128,num_warps=4,num_stages=4,swap=1"; do
    timeout 40 python bench/debug/fp4_rows_repro.py --experts 96 --repeats 3 --base "$b" \
      --out $W/g1_ops/repro_${b//[=,]/_}.json > $W/g1_ops/repro_${b//[=,]/_}.log 2>&1
  done
  timeout 110 python -m pytest -q -m gpu tests/ops/test_fp4_grouped_gemm.py tests/ops/test_moe_gather.py \
    tests/ops/test_moe_activation.py -rs -p no:cacheprovider > $W/g1_ops/gpu_tests.txt 2>&1
  echo "rc=$?" >> $W/g1_ops/gpu_tests.txt
) &
wait
bash bench/gpu_pack.sh $W "$OUT/results.tgz"
grep -h '^\[' $W/*/log.txt | cut -c1-220
python - $W/g1_ops/race.json <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except Exception as err:
    sys.exit(f"race.json: {err}")
print(d["ptxas"], d["swap_tiles_enabled"])
for c in d["cases"]:
    print(" ", c["ep"], c["path"], c["config"], c.get("runs_differing"), max(c.get("bad_vs_ref", [-1])), c.get("ms"),
          c.get("error", "")[:80])
PY
for f in $W/g1_ops/repro_*.log; do echo "$f"; cut -c1-200 "$f" | grep -v '^{"case' | tail -8; done
tail -3 $W/g1_ops/gpu_tests.txt

#!/usr/bin/env bash
# Round 5, call 2 (nvidia-h200-x2): the EP4 FP4 default becomes SWAP1WG_EP4 (swapped, one warpgroup, 2 programs per
# SM; race-free in call 1), Triton 3.6's own ptxas 12.8.
# GPU 0: V4.1 EP4 --modes passes,compile in one process: the same-run ratio of issue 6.
# GPU 1: stock compile first (fills the shared Inductor / Triton caches while GPU 0 compiles its passes graphs), then
#        the op GPU tests with the new default, the rows repro on it (5 repeats per grid variant) and the race sweep
#        (8 repeats, more one-warpgroup candidates).
set -uo pipefail
cd "$(dirname "$0")/../.."
export TRITON_INTERPRET=0 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
W=/tmp/r5c2; mkdir -p $W/g0_same_run $W/g1_compile $W/g1_ops
E="--no_cuda_graph --prefill_batch_size 4096"
(
  export CUDA_VISIBLE_DEVICES=0
  OUT=$W/g0_same_run timeout 560 bash bench/gpu_prefill_round.sh --model v41-flash --emulate-ep 4 \
    --modes passes,compile $E > /dev/null 2>&1
) &
(
  export CUDA_VISIBLE_DEVICES=1
  OUT=$W/g1_compile timeout 285 bash bench/gpu_prefill_round.sh --model v41-flash --emulate-ep 4 --modes compile $E \
    > /dev/null 2>&1
  timeout 80 python -m pytest -q -m gpu tests/ops/test_fp4_grouped_gemm.py tests/ops/test_moe_gather.py \
    tests/ops/test_moe_activation.py -rs -p no:cacheprovider > $W/g1_ops/gpu_tests.txt 2>&1
  echo "rc=$?" >> $W/g1_ops/gpu_tests.txt
  timeout 50 python bench/debug/fp4_rows_repro.py --experts 96 --repeats 5 \
    --base "BM=128,BN=128,BK=64,num_warps=4,num_stages=3,swap=1,progs_per_sm=2" \
    --out $W/g1_ops/repro_swap1wg_ep4.json > $W/g1_ops/repro_swap1wg_ep4.log 2>&1
  timeout 140 python bench/debug/fp4_config_race.py --repeats 8 --out $W/g1_ops/race.json > $W/g1_ops/race.log 2>&1
) &
wait
bash bench/gpu_pack.sh $W "$OUT/results.tgz"
grep -h '^\[' $W/*/log.txt | cut -c1-220
tail -3 $W/g1_ops/gpu_tests.txt
cut -c1-160 $W/g1_ops/repro_swap1wg_ep4.log | grep -v '^{"case' | tail -8
grep -h '^{"ep' $W/g1_ops/race.log | python -c "
import json, sys
for line in sys.stdin:
    c = json.loads(line)
    print(' ', c['ep'], c['path'], c['config'], c.get('default'), c.get('runs_differing'), max(c.get('bad_vs_ref', [-1])),
          c.get('ms'), c.get('error', '')[:80])"

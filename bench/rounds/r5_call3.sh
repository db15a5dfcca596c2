#!/usr/bin/env bash
# Round 5, call 3 (nvidia-h200-x2): the EP1 FP4 default becomes SWAP1WG_EP1 (swapped, one warpgroup, m64 n128 k64,
# 2 programs per SM; race-free in call 2's sweep); EP4 keeps SWAP1WG_EP4. Triton 3.6's own ptxas 12.8.
# GPU 0: V4.1 EP1 (shared experts) --modes passes,compile in one process.
# GPU 1: stock compile of the same shapes first (warms the shared caches), then the op GPU tests with the new
#        defaults, the rows repro on SWAP1WG_EP1 at the EP1 shape, and the EP1 race sweep (8 repeats).
set -uo pipefail
cd "$(dirname "$0")/../.."
export TRITON_INTERPRET=0 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
W=/tmp/r5c3; mkdir -p $W/g0_same_run $W/g1_compile $W/g1_ops
E="--no_cuda_graph --prefill_batch_size 4096"
(
  export CUDA_VISIBLE_DEVICES=0
  OUT=$W/g0_same_run timeout 530 bash bench/gpu_prefill_round.sh --model v41-flash --modes passes,compile $E \
    > /dev/null 2>&1
) &
(
  export CUDA_VISIBLE_DEVICES=1
  OUT=$W/g1_compile timeout 270 bash bench/gpu_prefill_round.sh --model v41-flash --modes compile $E > /dev/null 2>&1
  timeout 75 python -m pytest -q -m gpu tests/ops/test_fp4_grouped_gemm.py tests/ops/test_moe_gather.py \
    tests/ops/test_moe_activation.py -rs -p no:cacheprovider > $W/g1_ops/gpu_tests.txt 2>&1
  echo "rc=$?" >> $W/g1_ops/gpu_tests.txt
  timeout 45 python bench/debug/fp4_rows_repro.py --experts 384 --rows 64 --repeats 4 \
    --base "BM=64,BN=128,BK=64,num_warps=4,num_stages=4,swap=1,progs_per_sm=2" \
    --out $W/g1_ops/repro_swap1wg_ep1.json > $W/g1_ops/repro_swap1wg_ep1.log 2>&1
  timeout 90 python bench/debug/fp4_config_race.py --only EP1 --repeats 8 --out $W/g1_ops/race.json \
    > $W/g1_ops/race.log 2>&1
) &
wait
bash bench/gpu_pack.sh $W "$OUT/results.tgz"
grep -h '^\[' $W/*/log.txt | cut -c1-220
tail -3 $W/g1_ops/gpu_tests.txt
cut -c1-160 $W/g1_ops/repro_swap1wg_ep1.log | grep -v '^{"case' | tail -8
grep -h '^{"ep' $W/g1_ops/race.log | python -c "
import json, sys
for line in sys.stdin:
    c = json.loads(line)
    print(' ', c['ep'], c['path'], c['config'], c.get('default'), c.get('runs_differing'), max(c.get('bad_vs_ref', [-1])),
          c.get('ms'), c.get('error', '')[:80])"

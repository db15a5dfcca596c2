#!/usr/bin/env bash
# Round 4, call 1 (nvidia-h200-x2): GPU 0 = GPU tests of the ops + the rows= repro; GPU 1 = V4.1 EP4 passes "all,H"
# with --expert_loads. Results packed into $OUT/results.tgz.
set -uo pipefail
cd "$(dirname "$0")/../.."
export TRITON_INTERPRET=0 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
W=/tmp/r4c1; mkdir -p $W/g0 $W/g1
E="--no_cuda_graph --prefill_batch_size 4096"
(
  export CUDA_VISIBLE_DEVICES=0
  timeout 220 python -m pytest -q -m gpu tests/ops/test_fp4_grouped_gemm.py tests/ops/test_topk.py \
    tests/ops/test_indexer_score.py tests/ops/test_moe_activation.py -x -p no:cacheprovider > $W/g0/gpu_tests.txt 2>&1
  echo "rc=$?" >> $W/g0/gpu_tests.txt
  for ex in 96 100 48; do
    timeout 100 python bench/debug/fp4_rows_repro.py --experts $ex --repeats 2 --out $W/g0/repro_e$ex.json \
      > $W/g0/repro_e$ex.log 2>&1
  done
) &
(
  export CUDA_VISIBLE_DEVICES=1
  OUT=$W/g1 timeout 560 bash bench/gpu_prefill_round.sh --model v41-flash --emulate-ep 4 --modes passes \
    --passes all,H --expert_loads $E > /dev/null 2>&1
) &
wait
bash bench/gpu_pack.sh $W "$OUT/results.tgz"
tail -5 $W/g0/gpu_tests.txt; grep -h '^\[' $W/g1/log.txt | tail -3

#!/usr/bin/env bash
# Round 4, call 2 (nvidia-h200-x2).
# GPU 0: V4.1 EP4 --modes passes,compile --passes all,H,I (the same-run ratio).
# GPU 1: stock compile of the same workload first (it fills the shared Inductor / Triton caches while GPU 0 compiles
#        its passes graphs, so GPU 0's compile mode starts warm; timings are steady-state either way), with
#        --expert_loads; then the GPU tests of the ops, the small-op bench (H, I), the FP4 op bench and the repro.
set -uo pipefail
cd "$(dirname "$0")/../.."
export TRITON_INTERPRET=0 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
W=/tmp/r4c2; mkdir -p $W/g0 $W/g1 $W/ops
E="--no_cuda_graph --prefill_batch_size 4096"
(
  export CUDA_VISIBLE_DEVICES=0
  OUT=$W/g0 timeout 585 bash bench/gpu_prefill_round.sh --model v41-flash --emulate-ep 4 --modes passes,compile \
    --passes all,H,I $E > /dev/null 2>&1
) &
(
  export CUDA_VISIBLE_DEVICES=1
  OUT=$W/g1 timeout 300 bash bench/gpu_prefill_round.sh --model v41-flash --emulate-ep 4 --modes compile \
    --expert_loads $E > /dev/null 2>&1
  timeout 120 python -m pytest -q -m gpu tests/ops/test_moe_activation.py tests/ops/test_moe_gather.py \
    tests/ops/test_fp4_grouped_gemm.py tests/ops/test_topk.py tests/ops/test_indexer_score.py -p no:cacheprovider \
    > $W/ops/gpu_tests.txt 2>&1; echo "rc=$?" >> $W/ops/gpu_tests.txt
  timeout 60 python bench/bench_moe_small_ops.py --only H,I --out $W/ops/small_ops_HI.json > $W/ops/small_ops_HI.txt 2>&1
  timeout 60 python bench/debug/fp4_rows_repro.py --experts 96 --repeats 3 --out $W/ops/repro_e96.json \
    > $W/ops/repro_e96.log 2>&1
  timeout 90 python bench/bench_fp4_grouped_gemm.py --sweep none --no-naive --out $W/ops/fp4.json \
    > $W/ops/fp4.txt 2>&1
) &
wait
bash bench/gpu_pack.sh $W "$OUT/results.tgz"
tail -3 $W/ops/gpu_tests.txt; grep -h '^\[' $W/g0/log.txt $W/g1/log.txt | cut -c1-200

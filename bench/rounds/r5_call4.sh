#!/usr/bin/env bash
# Round 5, call 4 (nvidia-h200-x2, the session's last device time): V4-Flash on the race-free defaults
# (SWAP1WG_EP4 / SWAP1WG_EP1), passes only, 5 timed steps and 1 profiled step (round 4's V4 number ran racy tiles).
# GPU 0: V4-Flash emulated EP4. GPU 1: V4-Flash EP1 (shared experts).
set -uo pipefail
cd "$(dirname "$0")/../.."
export TRITON_INTERPRET=0 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
W=/tmp/r5c4; mkdir -p $W/v4_ep4_passes $W/v4_ep1_passes
E="--no_cuda_graph --prefill_batch_size 4096 --steps 5 --profile_steps 1 --warmup 1 --modes passes"
(CUDA_VISIBLE_DEVICES=0 OUT=$W/v4_ep4_passes timeout 285 bash bench/gpu_prefill_round.sh --model v4-flash \
   --emulate-ep 4 $E > /dev/null 2>&1) &
(CUDA_VISIBLE_DEVICES=1 OUT=$W/v4_ep1_passes timeout 285 bash bench/gpu_prefill_round.sh --model v4-flash \
   $E > /dev/null 2>&1) &
wait
bash bench/gpu_pack.sh $W "$OUT/results.tgz"
grep -h '^\[' $W/*/log.txt | cut -c1-220

#!/usr/bin/env bash
# Round 4, call 5 (nvidia-h200-x2, ptxas 13.5): GPU 0 = V4-Flash EP4 passes all,H,I (the top-k fix: uses_fused_bound);
# GPU 1 = V4.1-Flash EP1 passes all,H,I. Passes only, 5 timed steps, 1 profiled step (the device budget's end).
set -uo pipefail
cd "$(dirname "$0")/../.."
export TRITON_INTERPRET=0 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
[ -x .tools/ptxas-13.5/ptxas ] || python -c "import lzma,os; p='.tools/ptxas-13.5/ptxas'; open(p,'wb').write(lzma.open(p+'.xz').read()); os.chmod(p,0o755)"
export TRITON_PTXAS_PATH=$PWD/.tools/ptxas-13.5/ptxas
W=/tmp/r4c5; mkdir -p $W/v4_ep4_passes $W/v41_ep1_passes
E="--no_cuda_graph --prefill_batch_size 4096 --steps 5 --profile_steps 1 --passes all,H,I --modes passes"
(CUDA_VISIBLE_DEVICES=0 OUT=$W/v4_ep4_passes timeout 330 bash bench/gpu_prefill_round.sh --model v4-flash \
   --emulate-ep 4 $E > /dev/null 2>&1) &
(CUDA_VISIBLE_DEVICES=1 OUT=$W/v41_ep1_passes timeout 330 bash bench/gpu_prefill_round.sh --model v41-flash \
   $E > /dev/null 2>&1) &
wait
bash bench/gpu_pack.sh $W "$OUT/results.tgz"
grep -h '^\[' $W/*/log.txt | cut -c1-220

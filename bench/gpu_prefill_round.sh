#!/usr/bin/env bash
# One prefill-benchmark round on the GPU device: bench_prefill.py with the given arguments, results under $OUT.
#   bash bench/gpu_prefill_round.sh --model v41-flash --emulate-ep 4 --modes passes,compile
# Writes $OUT/results.jsonl (one line per mode, appended as each mode finishes), traces, log.txt, gpu.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
export TRITON_INTERPRET=0 PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
OUT=${OUT:-bench_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,memory.used,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
python - <<'PY' >> "$OUT/gpu.txt" 2>&1
import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)
PY
python -c "import logging,sys; sys.argv=['bench_prefill.py']+sys.argv[1:]; \
logging.basicConfig(level=logging.WARNING, format='%(asctime)s %(name)s %(message)s'); \
logging.getLogger('minidi.passes').setLevel(logging.INFO); \
sys.path.insert(0,'bench'); import runpy; runpy.run_path('bench/bench_prefill.py', run_name='__main__')" \
  --result_jsonl "$OUT/results.jsonl" --out_dir "$OUT" "$@" 2>&1 | tee "$OUT/log.txt"

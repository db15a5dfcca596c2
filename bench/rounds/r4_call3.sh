#!/usr/bin/env bash
# (Ran at a8006ad. Since then fp4_config_race.py writes "swap_tiles_enabled" instead of "rs_wgmma_safe".)
# Round 4, call 3 (nvidia-h200-x2): which FP4 GEMM configs are race-free and how fast.
# GPU 0: Triton 3.6's own ptxas (12.8). GPU 1: ptxas 13.5 (carried in .tools/, from the nvidia-cuda-nvcc wheel),
# where triton issue 9433 (register-operand MMA race) is fixed: the race sweep, the rows repro, the op GPU tests.
set -uo pipefail
cd "$(dirname "$0")/../.."
export TRITON_INTERPRET=0 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
W=/tmp/r4c3; mkdir -p $W/ptxas128 $W/ptxas135
[ -x .tools/ptxas-13.5/ptxas ] || python -c "import lzma,os; p='.tools/ptxas-13.5/ptxas'; open(p,'wb').write(lzma.open(p+'.xz').read()); os.chmod(p,0o755)"
(
  export CUDA_VISIBLE_DEVICES=0
  timeout 250 python bench/debug/fp4_config_race.py --out $W/ptxas128/race.json > $W/ptxas128/race.log 2>&1
) &
(
  export CUDA_VISIBLE_DEVICES=1 TRITON_PTXAS_PATH=$PWD/.tools/ptxas-13.5/ptxas
  timeout 250 python bench/debug/fp4_config_race.py --out $W/ptxas135/race.json > $W/ptxas135/race.log 2>&1
  timeout 60 python bench/debug/fp4_rows_repro.py --experts 96 --repeats 3 --out $W/ptxas135/repro_e96.json \
    > $W/ptxas135/repro_e96.log 2>&1
  timeout 100 python -m pytest -q -m gpu tests/ops/test_fp4_grouped_gemm.py -p no:cacheprovider \
    > $W/ptxas135/gpu_tests.txt 2>&1; echo "rc=$?" >> $W/ptxas135/gpu_tests.txt
) &
wait
bash bench/gpu_pack.sh $W "$OUT/results.tgz"
for f in $W/*/race.json; do python - "$f" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print(sys.argv[1], d["ptxas"], d["rs_wgmma_safe"])
for c in d["cases"]:
    print(" ", c["ep"], c["path"], c["config"], c.get("runs_differing"), max(c.get("bad_vs_ref", [-1])), c.get("ms"), c.get("error", "")[:80])
PY
done
tail -2 $W/ptxas135/gpu_tests.txt

#!/usr/bin/env bash
# Set up (if needed) and run the test suite on CPU; Triton kernels run through the interpreter.
# Arguments go to pytest (e.g. `bash scripts/test.sh tests/model/test_golden.py`). Progress: one line per test file
# with the running count of tests ([ 120/1070]); about 21 minutes on 2 cores for the whole suite (clean-clone CI at
# 979c516, the machine otherwise idle: 956 passed, 114 skipped in 1,229.1 s).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export TRITON_INTERPRET=1
exec .venv/bin/python -m pytest -o console_output_style=count --durations=25 "$@"

#!/usr/bin/env bash
# Set up (if needed) and run the test suite on CPU; Triton kernels run through the interpreter.
# Arguments go to pytest (e.g. `bash scripts/test.sh tests/model/test_golden.py`). Progress: one line per test file
# with the running count of tests ([ 120/1070]); 19-25 minutes on 2 cores for the whole suite (clean-clone CI, the
# machine otherwise idle: 972 passed, 136 skipped in 1,115.4 s at ea91b19, 1,501.1 s at 467d0f4; the 25 slowest tests
# are listed at the end).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export TRITON_INTERPRET=1
exec .venv/bin/python -m pytest -o console_output_style=count --durations=25 "$@"

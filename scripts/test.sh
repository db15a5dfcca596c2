#!/usr/bin/env bash
# Set up (if needed) and run the test suite on CPU; Triton kernels run through the interpreter.
# Arguments go to pytest (e.g. `bash scripts/test.sh tests/model/test_golden.py`). Two worker processes
# (pytest-xdist, MINIDI_TEST_WORKERS to change; each test file stays in one worker, so a file's compiled fixtures are
# built once); progress as lines of dots with the running count ([ 120/1200]). The whole suite: 15-19 minutes on 2
# cores (clean-clone CI at 09a5a8f, the machine otherwise idle: 1,051 passed, 149 skipped in 886.1 s; 1,113.1 s at
# 222e8fa with other work beside it; one process took 19-25 minutes for 972 tests); the 25 slowest tests are listed
# at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export TRITON_INTERPRET=1
exec .venv/bin/python -m pytest -n "${MINIDI_TEST_WORKERS:-2}" --dist loadfile -o console_output_style=count --durations=25 "$@"

#!/usr/bin/env bash
# Set up (if needed) and run the test suite on CPU; Triton kernels run through the interpreter.
# Arguments go to pytest (e.g. `bash scripts/test.sh tests/model/test_golden.py`). Two worker processes
# (pytest-xdist, MINIDI_TEST_WORKERS to change; each test file stays in one worker, so a file's compiled fixtures are
# built once); progress as lines of dots with the running count ([ 120/1200]). The default suite: 11-20 minutes on
# 2 cores (a clean clone at f50401d, empty Inductor / Triton caches, the machine otherwise idle: 1,521 passed, 340
# skipped in 660 s; CI took 934 s at 7b869f2 on its own machine); MINIDI_SLOW_TESTS=1 also runs
# the slow-marked tests (tests/conftest.py); the 25 slowest tests are listed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export TRITON_INTERPRET=1
exec .venv/bin/python -m pytest -n "${MINIDI_TEST_WORKERS:-2}" --dist loadfile -o console_output_style=count --durations=25 "$@"

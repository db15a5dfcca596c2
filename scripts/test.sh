#!/usr/bin/env bash
# Set up (if needed) and run the test suite on CPU; Triton kernels run through the interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export TRITON_INTERPRET=1
exec .venv/bin/python -m pytest -q "$@"

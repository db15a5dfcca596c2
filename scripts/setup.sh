#!/usr/bin/env bash
# Set up a virtual environment in .venv with minidi and its dev tools, on a fresh machine.
# Where no CUDA GPU is present, the CPU build of torch is installed first (a bare `torch>=2.11` would pull a
# multi-GB CUDA build; see docs/setup.md). Idempotent: re-running only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
    .venv/bin/python -m pip install -q "torch>=2.11"
  else
    .venv/bin/python -m pip install -q "torch==2.13.0"
  fi
fi
.venv/bin/python -m pip install -q -e ".[dev,bench]"

#!/usr/bin/env bash
# Set up a virtual environment in .venv with minidi and its dev tools, on a fresh machine.
# Where no CUDA GPU is present, the CPU build of torch is installed first: a bare `torch>=2.11` requirement would
# pull a multi-GB CUDA build (README, "Two commands"). Idempotent: re-running only installs what is missing, and
# nothing at all while pyproject.toml and this script are unchanged since the last complete run (a stamp in .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
STAMP=.venv/.minidi-setup-stamp
say() { echo "setup: $*"; }
inputs_hash() { .venv/bin/python -c 'import hashlib, sys; print(hashlib.sha256(b"".join(open(f, "rb").read() for f in sys.argv[1:])).hexdigest())' pyproject.toml scripts/setup.sh; }

if [ -x .venv/bin/python ]; then
  if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$(inputs_hash)" ]; then
    say ".venv is up to date (pyproject.toml and scripts/setup.sh unchanged); nothing to install"
    exit 0
  fi
else
  say "creating .venv with $("$PY" --version 2>&1)"
  "$PY" -m venv .venv
fi
say "upgrading pip"
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
    say "installing torch>=2.11 (CUDA build: an NVIDIA GPU is present; several GB, minutes)"
    .venv/bin/python -m pip install -q "torch>=2.11"
  else
    say "installing torch==2.13.0 (CPU build: no NVIDIA GPU found)"
    .venv/bin/python -m pip install -q "torch==2.13.0"
  fi
else
  say "torch $(.venv/bin/python -c 'import torch; print(torch.__version__)') already installed"
fi
say "installing minidi (editable) with triton, safetensors, numpy and the dev + bench extras (about a minute)"
.venv/bin/python -m pip install -q -e ".[dev,bench]"
inputs_hash > "$STAMP"
say "done"

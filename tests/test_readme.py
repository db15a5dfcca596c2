"""README.md's code, checked so that it cannot go stale.

- Every ```python block runs as written, in order, in one fresh interpreter (the blocks read as one session: the
  engine block uses the model of the block before). CPU and tiny presets; GPU-only lines stay comments there.
  ``TRITON_INTERPRET`` is removed from the environment, as in a user's shell.
- Every ```bash block: the scripts and files it names exist, and ``-m`` modules are importable.
- Every repository path the README names in backticks exists (a dangling reference such as a missing doc fails).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
FENCE = re.compile(r"^```(\w+)[^\n]*\n(.*?)^```", re.S | re.M)


def blocks(lang: str) -> list[str]:
    return [body for kind, body in FENCE.findall(README) if kind == lang]


def test_python_blocks_run_as_written():
    code = "\n".join(blocks("python"))
    assert code.count("minidi.load_model(") >= 2 and "engine.generate(" in code  # the blocks were found
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=1800)  # ~1 min of CPU; generous for a busy machine
    assert run.returncode == 0, f"README python blocks failed:\n{run.stdout}\n{run.stderr[-4000:]}"
    assert "Result(request_id=" in run.stdout and "logits=[512] float32" in run.stdout, run.stdout


def test_bash_blocks_name_existing_scripts_and_modules():
    text = "\n".join(blocks("bash"))
    paths = re.findall(r"(?<![\w/.-])((?:scripts|bench|tests|\.ci)/[\w./-]+)", text)
    modules = re.findall(r"-m\s+([\w.]+)", text)
    assert "scripts/setup.sh" in paths and "scripts/test.sh" in paths, paths
    missing = [p for p in paths if not (ROOT / p).exists()]
    assert not missing, missing
    assert modules and all(importlib.util.find_spec(m) is not None for m in modules), modules


def test_paths_named_in_the_readme_exist():
    named = set(re.findall(r"`((?:minidi|docs|tests|bench|scripts|perf|notes|\.ci)/[^`\s]*)`", README))
    assert len(named) > 10, named
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, missing

"""The passes folder is one row of peers: no rewrite imports another rewrite (shared matchers live in
``patterns.py``), nothing in ``minidi/passes`` imports ``minidi.runtime``, and ``uuid()`` hashes the shared modules."""

from __future__ import annotations

import ast
from pathlib import Path

import minidi.passes

PASSES = Path(minidi.passes.__file__).parent


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            out.add("." * node.level + (node.module or ""))
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_no_rewrite_imports_another():
    for f in sorted(PASSES.glob("rewrite_*.py")):
        bad = {m for m in _imports(f) if "rewrite_" in m}
        assert not bad, f"{f.name} imports {bad}"


def test_passes_never_import_runtime():
    for f in sorted(PASSES.glob("*.py")):
        assert not {m for m in _imports(f) if m.startswith("minidi.runtime")}, f.name


def test_uuid_hashes_the_shared_modules(monkeypatch):
    from minidi.passes import PassManager, fx_utils, manager, patterns

    seen: list = []
    real = manager._source_hash
    monkeypatch.setattr(manager, "_source_hash", lambda mods, extra="": seen.extend(mods) or real(mods, extra))
    PassManager("E").uuid()
    assert patterns in seen and fx_utils in seen

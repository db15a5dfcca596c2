"""Portable compiled artifacts for warm starts: ``minidi.compile(..., compile_cache=DIR)``.

    step = minidi.compile(model, "all", strict=True, regional=True, compile_cache="/data/minidi-cc")
    step(meta, cache)          # a miss: compiles, then writes DIR/<key>/artifacts.bin + manifest.json
    step.compile_cache.status  # "hit" in a later process (same key): the artifacts were loaded before compiling

What is saved: ``torch.compiler.save_cache_artifacts()`` after the first step, i.e. the entries this process wrote to
Inductor's FX graph cache (generated code, Triton kernels bundled on the GPU), AOTAutograd's cache, the autotuner's
cache and Dynamo's PGO profiles, and the same blob from each compile worker that compiled a layer kind
(``compile_workers.py``): ``artifacts.bin`` is the list of those blobs. A warm start hands them to ``torch.compiler.load_cache_artifacts`` before anything
compiles, so Inductor's lowering, code generation and C++ / Triton compiles are skipped wherever the caches hit, on
any machine with the same key. Dynamo still traces every graph and minidi's passes still run on it: their match
counts are checked as on a cold start (``strict``), and also compared with the counts the manifest recorded.

The key (``key_fields``): the model config (every field) and its construction choices (Engram rows), the passes,
``strict``, ``op_backend``, ``faithful_rounding``, the code generation settings (``codegen``: ``autotune``,
``cpu_simd``), the shape policy (``dynamic``, ``regional``, ``fullgraph``), the inner backend, a hash of every
minidi source file, the torch / triton / python versions, ``TRITON_INTERPRET`` and the device kind and name. The
entry is the folder named by the key's hash, so a different key never reads it. A miss says why: no entry (and, when
the folder holds entries for other keys, the fields that differ from the nearest one), or an entry that cannot be
used (manifest unreadable, key fields differ from the manifest's, artifact bytes whose hash differs from the
manifest's, torch refusing the bytes). A miss compiles as without a cache and rewrites the entry; nothing of an
unusable entry is loaded.

Also here, for ``compile.py``: ``cacheable_minidi_calls`` (lets AOTAutograd's cache keep graphs that call minidi's
op wrappers; without it every start re-traces AOT, and its graphs missed Inductor's cache in a second process too).
The first call's split by phase and the cache's check and save after it: ``first_step.py``.

On a GPU the FX graph cache entries carry their Triton kernels; minidi's own ops are Triton kernels behind custom
ops, compiled by Triton's JIT at their first call into Triton's cache folder: the entry keeps the kernel folders the
first step added there (``triton.tar``) and a warm start puts them back before compiling. On a CPU the
entries carry the generated C++ source, not the compiled libraries: a fresh machine runs the C++ compiler again
(lowering and code generation are still skipped).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
import json
import logging
import os
import pickle
import platform
import tarfile
import time
from pathlib import Path
from typing import Any

import torch

from minidi.model import stages

log = logging.getLogger("minidi.compile")

MANIFEST, ARTIFACTS, TRITON, PRECOMPILED = "manifest.json", "artifacts.bin", "triton.tar", "precompiled.bin"
FORMAT = 3  # entry layout version: a change makes every older entry a miss (3: artifacts.bin holds a list of blobs)


@functools.cache
def source_hash() -> str:
    """sha256 over every minidi source file (path and bytes): any code change is a new key (read once per
    process)."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for p in sorted(root.rglob("*.py")):
        h.update(str(p.relative_to(root)).encode())
        h.update(p.read_bytes())
    return h.hexdigest()


def device_of(model: Any) -> torch.device:
    for p in getattr(model, "parameters", lambda: iter(()))():
        return p.device
    return torch.device("cpu")


def device_fields(device: torch.device) -> dict[str, Any]:
    if device.type == "cuda":
        return {"device": "cuda", "device_name": torch.cuda.get_device_name(device),
                "capability": ".".join(map(str, torch.cuda.get_device_capability(device)))}
    return {"device": device.type, "device_name": platform.processor() or platform.machine()}


def version_fields() -> dict[str, Any]:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:  # the CPU-only torch build without triton
        triton_version = None
    return {"torch": torch.__version__, "triton": triton_version, "python": platform.python_version(),
            "cuda": torch.version.cuda, "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "")}


def _jsonable(x: Any) -> Any:
    return json.loads(json.dumps(x, default=str))


def key_fields(model: Any, *, passes: list[str], strict: bool, op_backend: str, faithful_rounding: bool,
               codegen: dict[str, bool], dynamic: bool | None, regional: bool, fullgraph: bool, backend: Any,
               compile_kwargs: dict[str, Any]) -> dict[str, Any]:
    """Everything a compiled artifact depends on, as plain JSON (the key is its hash)."""
    cfg = getattr(model, "cfg", None)
    config = dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else {"model": type(model).__qualname__}
    return _jsonable({
        "format": FORMAT, "config": config, "engram_rows": getattr(model, "engram_rows", None),
        "passes": list(passes), "strict": strict, "op_backend": op_backend, "faithful_rounding": faithful_rounding,
        "codegen": dict(codegen),
        "dynamic": dynamic, "regional": regional, "fullgraph": fullgraph, "stage_markers": stages.enabled(),
        "backend": backend if isinstance(backend, str) else f"{backend.__module__}.{backend.__qualname__}",
        "compile_kwargs": {k: repr(v) for k, v in sorted(compile_kwargs.items())},
        "minidi_source": source_hash(), **version_fields(), **device_fields(device_of(model)),
    })


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def differing(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Dotted names of the fields whose values differ (``config.n_layers``, ``passes``)."""
    fa, fb = _flatten(a), _flatten(b)
    return sorted(k for k in fa.keys() | fb.keys() if fa.get(k, "<absent>") != fb.get(k, "<absent>"))


class CompileCache:
    """One key's entry in a compile-cache folder: ``load()`` before compiling, ``save(...)`` after the first step.

    ``status``: "hit" (artifacts loaded), "miss" (``reason`` says why) or "off"; ``artifact_bytes`` the entry's size;
    ``load_s`` / ``save_s`` the seconds spent; ``manifest`` the loaded entry's manifest (its ``counts``)."""

    def __init__(self, root: str | os.PathLike, fields: dict[str, Any], device: torch.device | None = None) -> None:
        self.root = Path(root).expanduser()
        self.device = device or torch.device("cpu")
        self._triton_before = _listing(triton_dir(self.device))
        self.fields = fields
        self.key = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:32]
        self.path = self.root / self.key
        self.status, self.reason = "off", ""
        self.manifest: dict[str, Any] | None = None
        self.precompiled: bytes | None = None  # a hit's precompiled graphs (``precompiled.py``), if it saved any
        self.artifact_bytes, self.load_s, self.save_s = 0, 0.0, 0.0
        self.saved = False
        self.worker_artifacts: list[bytes] = []  # compile workers' own recorded artifacts (``compile_workers.py``)

    # -- warm start ----------------------------------------------------------------------------------------------
    def load(self) -> str:
        t0 = time.perf_counter()
        try:
            self.status, self.reason = self._load()
        finally:
            self.load_s = time.perf_counter() - t0
        if self.status == "hit":
            log.info("minidi.compile: compile cache hit: %s (%.1f MB of artifacts loaded in %.1f s)", self.path,
                     self.artifact_bytes / 1e6, self.load_s)
        else:
            log.info("minidi.compile: compile cache miss: %s; compiling, the entry is (re)written after the first "
                     "step (%s)", self.reason, self.path)
        return self.status

    def _load(self) -> tuple[str, str]:
        mpath, apath = self.path / MANIFEST, self.path / ARTIFACTS
        if not mpath.exists():
            return "miss", "no entry for this key" + self._nearest_note()
        try:
            manifest = json.loads(mpath.read_text())
            want_sha, fields = manifest["artifacts_sha256"], manifest["fields"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            return "miss", f"stale entry: manifest unreadable ({type(e).__name__}: {e})"
        if fields != self.fields:
            diff = ", ".join(differing(fields, self.fields))
            return "miss", f"stale entry: key fields differ from its manifest ({diff})"
        try:
            blob = apath.read_bytes()
        except OSError as e:
            return "miss", f"stale entry: artifacts unreadable ({type(e).__name__})"
        if hashlib.sha256(blob).hexdigest() != want_sha:
            return "miss", (f"corrupted entry: {ARTIFACTS} ({len(blob)} bytes) does not match the sha256 its manifest "
                            "recorded")
        optional: dict[str, bytes] = {}  # the entry's other files its manifest vouches for (absent: not saved)
        for name, sha_field in ((TRITON, "triton_sha256"), (PRECOMPILED, "precompiled_sha256")):
            if not manifest.get(sha_field):
                continue
            try:
                optional[name] = (self.path / name).read_bytes()
            except OSError as e:
                return "miss", f"stale entry: {name} unreadable ({type(e).__name__})"
            if hashlib.sha256(optional[name]).hexdigest() != manifest[sha_field]:
                return "miss", f"corrupted entry: {name} does not match the sha256 its manifest recorded"
        kernels, precompiled = optional.get(TRITON, b""), optional.get(PRECOMPILED)
        try:
            blobs = pickle.loads(blob)  # a trusted entry (its sha256 checked above): this process's and workers'
            if not isinstance(blobs, list) or not all(isinstance(b, bytes) for b in blobs):
                raise TypeError(f"{ARTIFACTS} holds {type(blobs).__name__}, not a list of blobs")
            infos = [torch.compiler.load_cache_artifacts(b) for b in blobs]
        except Exception as e:  # a format torch no longer reads: rebuilt, never half-used
            return "miss", f"stale entry: torch refused the artifacts ({type(e).__name__}: {e})"
        if not infos or any(info is None for info in infos):
            return "miss", "stale entry: torch read no artifacts from it"
        if kernels:
            try:
                _unpack_kernels(kernels, triton_dir(self.device))
            except (OSError, tarfile.TarError) as e:  # costs these kernels' JIT compiles, not the hit
                log.warning("minidi.compile: compile cache: saved Triton kernels not restored (%s: %s)",
                            type(e).__name__, e)
        self.manifest, self.precompiled = manifest, precompiled
        self.artifact_bytes = len(blob) + len(kernels) + len(precompiled or b"")
        return "hit", ""

    def _nearest_note(self) -> str:
        """For a miss with no entry: which fields differ from the closest entry the folder holds (if any)."""
        best: list[str] | None = None
        for m in sorted(self.root.glob(f"*/{MANIFEST}")) if self.root.is_dir() else []:
            try:
                diff = differing(json.loads(m.read_text())["fields"], self.fields)
            except (OSError, ValueError, KeyError, TypeError):
                continue
            if best is None or len(diff) < len(best):
                best = diff
        if best is None:
            return ""
        shown = ", ".join(best[:8]) + (f" and {len(best) - 8} more" if len(best) > 8 else "")
        return f" (the folder's nearest entry differs in: {shown})"

    # -- after the first step -------------------------------------------------------------------------------------
    def check_counts(self, counts: dict[str, int]) -> None:
        """On a hit: the passes ran again on the traced graphs; their counts must be the ones the entry recorded."""
        if self.status != "hit" or self.manifest is None:
            return
        recorded = self.manifest.get("counts")
        if recorded is not None and recorded != counts:
            log.warning("minidi.compile: compile cache %s: pass counts %s differ from the entry's %s; the entry is "
                        "rewritten", self.path, counts, recorded)
            self.status, self.reason = "miss", f"pass counts {counts} differ from the entry's {recorded}"

    def save(self, counts: dict[str, int] | None, compile_s: float, *, precompiled: bytes | None = None,
             layer_counts: dict[int, dict[str, int]] | None = None) -> None:
        """Write the entry (after a miss): the artifacts this process recorded and the manifest, atomically; with
        ``precompiled`` (the layers' ahead-of-time graphs) also those and ``layer_counts`` (the pass counts of each
        layer that compiled a graph: a warm start that loads them runs no passes)."""
        if self.status == "hit":
            return
        t0 = time.perf_counter()
        saved = torch.compiler.save_cache_artifacts()
        blobs = ([saved[0]] if saved is not None and saved[0] else []) + [b for b in self.worker_artifacts if b]
        if not blobs:
            log.warning("minidi.compile: compile cache: torch recorded no artifacts to save (the caches were off, "
                        "or the backend %r writes none); nothing written", self.fields.get("backend"))
            return
        blob = pickle.dumps(blobs)
        info = saved[1] if saved is not None and saved[0] else None
        kernels, n_kernels = _pack_kernels(triton_dir(self.device), self._triton_before)
        kinds = {k: len(v) for k, v in getattr(info, "artifacts", {}).items()}
        if self.worker_artifacts:
            kinds["compile workers' artifact sets"] = len(self.worker_artifacts)
        manifest = {"fields": self.fields, "key": self.key, "artifacts_sha256": hashlib.sha256(blob).hexdigest(),
                    "artifact_bytes": len(blob), "artifacts": kinds, "counts": counts,
                    "triton_sha256": hashlib.sha256(kernels).hexdigest() if kernels else None,
                    "triton_bytes": len(kernels), "triton_kernels": n_kernels,
                    "precompiled_sha256": hashlib.sha256(precompiled).hexdigest() if precompiled else None,
                    "precompiled_bytes": len(precompiled or b""),
                    "layer_counts": {str(k): v for k, v in (layer_counts or {}).items()} if precompiled else None,
                    "compile_s": round(compile_s, 1), "written": time.strftime("%Y-%m-%d %H:%M:%S")}
        self.path.mkdir(parents=True, exist_ok=True)
        tmp = f".tmp{os.getpid()}"
        files = {name: data for name, data in ((ARTIFACTS, blob), (TRITON, kernels), (PRECOMPILED, precompiled))
                 if data}
        for name, data in files.items():
            (self.path / (name + tmp)).write_bytes(data)
        (self.path / (MANIFEST + tmp)).write_text(json.dumps(manifest, indent=1, sort_keys=True))
        # the artifacts first, then the manifest that vouches for them: a reader never sees a manifest whose
        # artifacts are still being written (a torn pair fails the sha256 check and is rebuilt)
        for name in files:
            os.replace(self.path / (name + tmp), self.path / name)
        os.replace(self.path / (MANIFEST + tmp), self.path / MANIFEST)
        self.artifact_bytes, self.saved = len(blob) + len(kernels) + len(precompiled or b""), True
        if n_kernels:
            kinds["minidi triton kernel dirs"] = n_kernels
        if precompiled:
            kinds[f"precompiled graphs ({len(precompiled) / 1e6:.1f} MB)"] = 1
        self.save_s = time.perf_counter() - t0
        log.info("minidi.compile: compile cache saved: %s (%.1f MB, %s; %.1f s)", self.path, len(blob) / 1e6,
                 ", ".join(f"{v} {k}" for k, v in kinds.items()) or "no artifacts listed", self.save_s)

    def summary(self) -> dict[str, Any]:
        """The benchmark's record: status, reason, entry, artifact size, seconds."""
        return {"status": self.status, "reason": self.reason or None, "path": str(self.path),
                "artifact_bytes": self.artifact_bytes, "load_s": round(self.load_s, 2),
                "save_s": round(self.save_s, 2), "saved": self.saved}


# ---- minidi's own Triton kernels ---------------------------------------------------------------------------------
def triton_dir(device: torch.device) -> Path | None:
    """Where Triton caches the kernels minidi's ops compile (their JIT, not Inductor's artifacts): TRITON_CACHE_DIR,
    which Inductor sets on a GPU to its own folder's ``triton/<device>`` when it first loads a kernel (the same torch
    function decides it here, before that happens), else None: the CPU's interpreter compiles nothing."""
    if env := os.environ.get("TRITON_CACHE_DIR"):
        return Path(env)
    if device.type != "cuda":
        return None
    try:
        from torch._inductor.runtime.cache_dir_utils import triton_cache_dir
    except ImportError:  # pragma: no cover
        return None
    return Path(triton_cache_dir(device.index if device.index is not None else torch.cuda.current_device()))


def _listing(folder: Path | None) -> set[str]:
    try:
        return set(os.listdir(folder)) if folder is not None else set()
    except OSError:
        return set()


def _pack_kernels(folder: Path | None, before: set[str]) -> tuple[bytes, int]:
    """The Triton cache entries written since ``before`` (one folder per compiled kernel) as an uncompressed tar;
    best effort: a failure costs the next start these kernels' JIT compiles, never the entry."""
    new = sorted(_listing(folder) - before)
    if folder is None or not new:
        return b"", 0
    buf = io.BytesIO()
    try:
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for name in new:
                for f in sorted((folder / name).iterdir()):
                    if f.is_file() and not f.name.startswith(("lock", "tmp")):
                        tar.add(f, arcname=f"{name}/{f.name}", recursive=False)
    except OSError as e:
        log.warning("minidi.compile: compile cache: Triton kernels not saved (%s: %s)", type(e).__name__, e)
        return b"", 0
    return buf.getvalue(), len(new)


def _unpack_kernels(data: bytes, folder: Path | None) -> None:
    """Put the saved kernels into this process's Triton cache folder (files it already has are kept)."""
    if folder is None:
        log.warning("minidi.compile: compile cache: no Triton cache folder here; the saved kernels stay unused")
        return
    with tarfile.open(fileobj=io.BytesIO(data), mode="r") as tar:
        for m in tar.getmembers():
            parts = Path(m.name).parts
            if not m.isfile() or m.name.startswith("/") or ".." in parts or len(parts) != 2:
                continue  # only <kernel>/<file>, never a path outside the folder
            dest = folder / m.name
            if dest.exists():
                continue
            dest.parent.mkdir(parents=True, exist_ok=True)
            src = tar.extractfile(m)
            if src is not None:
                tmp = dest.with_name(f"{dest.name}.tmp{os.getpid()}")
                tmp.write_bytes(src.read())
                os.replace(tmp, dest)


def clear_recorded_artifacts() -> None:
    """Forget the artifacts this process recorded so far (an earlier compile's), so that the entry holds this
    compile's only. A private torch API: a no-op where it is missing."""
    try:
        from torch.compiler._cache import CacheArtifactManager
    except ImportError:  # pragma: no cover
        return
    if callable(getattr(CacheArtifactManager, "clear", None)):
        CacheArtifactManager.clear()


# ---- what minidi.compile uses ---------------------------------------------------------------------------------
def cacheable_minidi_calls(gm: Any) -> Any:
    """The passes insert calls of minidi's op wrappers (``minidi.ops.*``: Python functions that pick the kernel or
    its reference) into Dynamo's graph. AOTAutograd's cache refuses graphs that call Python functions it does not
    know (it bypasses itself: every warm start would trace AOT again), unless they are listed in Inductor's
    ``unsafe_marked_cacheable_functions`` with a string that keys their behaviour: here the hash of minidi's
    sources (any change to the wrappers or kernels is a new cache key) and whether the Triton interpreter runs (a
    wrapper picks the kernel or its reference while AOT traces it, from that and the tensors' device, which the
    graph's inputs already key). Patched around the inner backend's call (absent in old torch: no-op)."""
    import contextlib

    import torch._inductor.config as inductor_config

    from minidi.ops._triton_utils import interpreting

    names = {f"{t.__module__}.{t.__name__}" for t in (nd.target for nd in gm.graph.nodes if nd.op == "call_function")
             if str(getattr(t, "__module__", "")).startswith("minidi.") and hasattr(t, "__name__")}
    if not names or not hasattr(inductor_config, "unsafe_marked_cacheable_functions"):
        return contextlib.nullcontext()
    marked = dict(inductor_config.unsafe_marked_cacheable_functions)
    behaviour = f"minidi-{source_hash()}-interpreter={interpreting()}"
    marked.update({name: behaviour for name in sorted(names)})  # sorted: the config's hash
    # (a key of Inductor's caches) must not depend on the process's string-hash seed
    return inductor_config.patch(unsafe_marked_cacheable_functions=marked)


__all__ = ["CompileCache", "cacheable_minidi_calls", "clear_recorded_artifacts", "differing",
           "key_fields", "source_hash"]

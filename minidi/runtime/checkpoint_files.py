"""The files of a checkpoint folder, which is untrusted input: each file probed (missing, unreadable, a symlink
loop, not a regular file), each index entry kept inside the folder (absolute paths and ``..`` refused; symlinks must
resolve inside it or, for the Hugging Face cache layout ``<repo>/snapshots/<rev>/``, inside ``<repo>/blobs``), the
index's weight map read with duplicate keys refused, and problems listed with their counts. ``checkpoint.py``
loads through these."""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path, PurePosixPath, PureWindowsPath

from safetensors import safe_open

from minidi.runtime.safetensors_header import diagnose_header

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
_MAX_LISTED = 100  # per problem category; the count is always given


def probe(p: Path) -> str | None:
    """Why ``p`` cannot be read as a file (``missing``, a symlink loop, unreadable, not a file), or None."""
    try:
        st = os.stat(p)
    except FileNotFoundError:
        if os.path.islink(p):
            return f"is a broken symlink (to {os.readlink(p)})"
        return "is missing"
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "is a symlink loop"
        return f"is unreadable ({e.strerror or e})"
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file" + (" (a directory)" if stat.S_ISDIR(st.st_mode) else "")
    try:
        os.close(os.open(p, os.O_RDONLY))
    except OSError as e:
        return f"is unreadable ({e.strerror or e})"
    return None


def probe_dir(p: Path) -> str | None:
    """Why the checkpoint folder cannot be used, or None."""
    try:
        st = os.stat(p)
    except FileNotFoundError:
        return f"checkpoint folder {p} does not exist" + (" (broken symlink)" if os.path.islink(p) else "")
    except OSError as e:
        if e.errno == errno.ELOOP:
            return f"checkpoint folder {p} is a symlink loop"
        return f"checkpoint folder {p} is unreadable ({e.strerror or e})"
    if not stat.S_ISDIR(st.st_mode):
        return f"not a directory: {p}"
    try:
        os.listdir(p)
    except OSError as e:
        return f"checkpoint folder {p} is unreadable ({e.strerror or e})"
    return None


def allowed_roots(path: Path) -> list[Path]:
    """Where the files of a checkpoint may live: the folder itself, plus ``<repo>/blobs`` for the Hugging Face cache
    layout (``<repo>/snapshots/<rev>/<file>`` are symlinks to ``../../blobs/<sha>``)."""
    roots = [Path(os.path.realpath(path))]
    if path.absolute().parent.name == "snapshots":
        roots.append(Path(os.path.realpath(path.absolute().parent.parent / "blobs")))
    return roots


def outside_folder(path: Path, rel: str, roots: list[Path]) -> str | None:
    """Why the index entry ``rel`` does not name a file inside the checkpoint folder, or None."""
    if not rel or "\x00" in rel:
        return "is empty or holds a NUL byte"
    if PurePosixPath(rel).is_absolute() or PureWindowsPath(rel).is_absolute() or PureWindowsPath(rel).drive:
        return "is an absolute path (shards must be named relative to the checkpoint folder)"
    if ".." in PurePosixPath(rel.replace("\\", "/")).parts:
        return "climbs out of the checkpoint folder with '..'"
    real = Path(os.path.realpath(path / rel))  # never raises on a loop (probe reports those)
    if not any(real == r or r in real.parents for r in roots):
        return f"resolves outside the checkpoint folder (to {real})"
    return None


def read_json_file(path: Path, name: str, problems: list[str]) -> bool:
    """True if ``path / name`` is a readable file inside the folder; else the reason goes to ``problems``."""
    why = probe(path / name)
    if why is None:
        why = outside_folder(path, name, allowed_roots(path))
    if why is not None:
        problems.append(f"{name} {why}")
    return why is None


def _no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict:
    keys = [k for k, _ in pairs]
    dups = sorted({k for k in keys if keys.count(k) > 1}) if len(set(keys)) != len(keys) else []
    if dups:
        raise ValueError(f"duplicate names {dups[:_MAX_LISTED]}")
    return dict(pairs)


def read_weight_map(path: Path, problems: list[str]) -> dict[str, str] | None:
    """name -> shard file from the index, or the names of a single ``model.safetensors``; None if unusable."""
    index = path / INDEX_NAME
    if os.path.lexists(index):
        if not read_json_file(path, INDEX_NAME, problems):
            return None
        try:
            raw = json.loads(index.read_bytes().decode("utf-8"), object_pairs_hook=_no_duplicate_keys)
        except (OSError, ValueError) as e:
            problems.append(f"unreadable index {INDEX_NAME}: {e}")
            return None
        wm = raw.get("weight_map") if isinstance(raw, dict) else None
        if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
            problems.append(f"malformed index {INDEX_NAME}: needs a 'weight_map' object of name -> shard file")
            return None
        return wm
    if os.path.lexists(path / SINGLE_NAME):
        if not read_json_file(path, SINGLE_NAME, problems):
            return None
        try:
            with safe_open(str(path / SINGLE_NAME), framework="pt") as f:
                return {k: SINGLE_NAME for k in f.keys()}
        except Exception as e:  # noqa: BLE001 - safetensors raises several error types for bad files
            problems.append(f"corrupt shard {SINGLE_NAME}: {header_detail(path / SINGLE_NAME, e)}")
            return None
    problems.append(f"no {INDEX_NAME} and no {SINGLE_NAME} in {path}")
    return None


def header_detail(fpath: Path, e: Exception) -> str:
    """safetensors' message plus our own reading of the header, which names the bad tensor entries."""
    detail = diagnose_header(fpath)
    return f"{type(e).__name__}: {e}" + ("; " + "; ".join(detail) if detail else "")


def named_list(title: str, items: list[str]) -> str:
    shown = ", ".join(items[:_MAX_LISTED])
    more = f" ... (+{len(items) - _MAX_LISTED} more)" if len(items) > _MAX_LISTED else ""
    return f"{title} ({len(items)}): {shown}{more}"

"""One C++ compile per graph for Inductor's CPU kernels, instead of one per kernel (issue 20: CPU compile time).

Inductor compiles every C++ kernel of a CPU graph as its own shared library (``AsyncCompile.cpp_pybinding`` ->
``CppPythonBindingsCodeCache``): one ``g++`` run per kernel. Each run first loads Inductor's precompiled header
(``cpp_prefix.h``, a ~131 MB ``.gch``), and for minidi's small kernels that load is most of the run: on this 2-core
CPU, g++ took 0.46 s for the header alone, 0.56 s with one kernel and 0.69 s with ten
(``docs/benchmarks/cpu_compile_round26/gxx_pch_timing.txt``). Tiny V4.1's graphs have 131 distinct kernels: its cold
compile took 78.6-85.4 s batched against 109.5-123.1 s (docs/benchmarks/README.md, round 26).

While ``batching()`` is active (``compile_settings.codegen_config`` turns it on for CPU graphs, and
``PrecompiledCalls.loads`` while a warm start deserialises its graphs), the kernels a graph's
module asks for are collected instead of compiled, and its ``async_compile.wait`` compiles them as a few translation
units (one per compile thread): each kernel's code in a namespace of its own, its ``kernel`` function renamed there,
one Python binding module with a function per kernel, built from Inductor's own binding template. The kernels are the
same code under the same compile command (the one ``CppPythonBindingsCodeCache`` gives a CPU kernel), so their
machine code does not change; the libraries land in Inductor's code cache like any other (a warm start that loads the
same graph hashes the same unit and loads it). A kernel whose source (and vector ISA) an earlier graph of the process
already built is not built again, as Inductor's own cache would not (layer kinds share many kernels).

Another process finds them too: each unit built leaves its source and, per kernel, the unit and slot that hold it
in Inductor's cache folder (``INDEX_DIR``). A kernel found there loads its unit through Inductor's code cache, which
keys the library on the unit's source and today's compile command, so it loads the library already built (or builds
it again where the command changed). This is what lets a process load graphs that compile workers built
(``compile_workers.py``: their units hold other sets of kernels than this process would group) or a warm start
reuse the libraries of the run that saved its entry, without a g++ run (tiny V4.1 on 2 cores: the main process
rebuilt ~7 s of C++ when loading its workers' graphs).

Falls back to Inductor's own path, per kernel, for a source it cannot place in a namespace (a preprocessor line other
than ``#include`` / ``#pragma``, no single ``extern "C" void kernel(``), for a torch whose binding template or code
cache lacks what is used here, and for a unit that fails to compile (so g++'s error names the one kernel, as before).
``MINIDI_CPP_KERNEL_BATCH=0`` turns it off.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator

ENV = "MINIDI_CPP_KERNEL_BATCH"
_ENTRY = re.compile(r'extern\s+"C"\s+void\s+kernel\(')
_NS = "minidi_k{}"
_STATE = threading.local()  # .active: batching() depth in this thread
_LOCK = threading.Lock()
_INSTALLED: list[bool] = []
STATS = {"units": 0, "kernels": 0, "fallback_kernels": 0, "found_kernels": 0}  # units built, kernels in them,
# kernels not batched, kernels loaded from another process' units (``_recorded``)
_BUILT: dict[tuple, Callable[..., Any]] = {}  # kernel key (``_key``) -> its function, built in this process
INDEX_DIR = "minidi_cpp_units"  # in Inductor's cache folder: <unit>.cpp sources, <kernel digest>.slot -> "unit i"
_UNITS: dict[tuple[str, str], Any] = {}  # (index folder, unit digest) -> its module, loaded by ``_recorded`` here


def cache_clear() -> None:
    """Forget the kernels built so far (registered with Inductor's ``fresh_cache``, which clears its own)."""
    with _LOCK:
        _BUILT.clear()
        _UNITS.clear()


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


@contextlib.contextmanager
def batching() -> Iterator[None]:
    """Inductor's C++ kernels requested in this thread (and this context) are compiled per graph, in a few units."""
    if not enabled() or not install():
        yield
        return
    _STATE.active = getattr(_STATE, "active", 0) + 1
    try:
        yield
    finally:
        _STATE.active -= 1


def split_kernel(source: str) -> tuple[list[str], str] | None:
    """(its #include lines, the rest with ``kernel`` no longer extern "C") of one kernel's source, or None where the
    source cannot go into a namespace."""
    includes, body = [], []
    for line in source.splitlines():
        s = line.lstrip()
        if s.startswith("#include"):
            includes.append(s)
        elif s.startswith("#") and not s.startswith("#pragma"):
            return None
        else:
            body.append(line)
    text = "\n".join(body)
    if len(_ENTRY.findall(text)) != 1:
        return None
    return includes, _ENTRY.sub("void kernel(", text)


def binding_source(template: str, call_entry: str, argtypes: list[list[str]]) -> str:
    """The Python bindings of one unit: ``kernel_i`` calls namespace i's ``kernel``, in one module named ``kernel``
    (the entry Inductor's loader imports); pieces of Inductor's own template (``suffix_template``), so the argument
    parsing and the module set-up are the installed torch's. Raises ValueError where the template has changed."""
    def fmt(entry: str, types: list[str], call: str) -> str:
        parse = ", ".join(f"parse_arg<{t.replace('const ', '')}>(args, {n})" for n, t in enumerate(types))
        return template.format(arg_len=len(types), call_entry_func=call.format(parse), entry_func=entry,
                               extra_parse_arg="")

    if not call_entry.startswith("kernel("):
        raise ValueError(f"unexpected call_entry_function {call_entry!r}")
    whole = fmt("kernel", argtypes[0], call_entry)
    head = whole[:whole.index("static PyObject* kernel_py(")]
    tail = whole[whole.index("static struct PyModuleDef"):]
    if "PyInit_kernel(" not in tail or "py_methods" not in tail:
        raise ValueError("unexpected module definition in the binding template")
    funcs, methods = [], []
    for i, types in enumerate(argtypes):
        one = fmt(f"kernel_{i}", types, f"{_NS.format(i)}::{call_entry}")
        funcs.append(one[one.index(f"static PyObject* kernel_{i}_py("):one.index("static PyMethodDef")])
        methods.append(f'    {{"kernel_{i}", kernel_{i}_py, METH_VARARGS, ""}},\n')
    table = "static PyMethodDef py_methods[] = {\n" + "".join(methods) + "    {NULL, NULL, 0, NULL}};\n\n"
    return head + "".join(funcs) + table + tail


def unit_source(kernels: list[tuple[list[str], str]], binding: str) -> str:
    """One translation unit: the kernels' includes once, each kernel in its namespace, then the bindings."""
    includes = list(dict.fromkeys(inc for incs, _ in kernels for inc in incs))
    spaces = [f"namespace {_NS.format(i)} {{\n{body}\n}}  // {_NS.format(i)}\n" for i, (_, body) in enumerate(kernels)]
    return "\n".join(includes) + "\n" + "\n".join(spaces) + binding


def _key(argtypes: list[str], source: str) -> tuple:
    """What decides a kernel's library: its source, its arguments and the vector ISA that picks its compile flags
    (Inductor keys its own cache on the source and the compile command)."""
    try:
        from torch._inductor.cpu_vec_isa import pick_vec_isa

        isa = str(pick_vec_isa())
    except ImportError:
        isa = "?"
    return source, tuple(argtypes), isa


class _Deferred:
    """A kernel awaiting its graph's unit; resolves to the kernel's Python function (Inductor's futures' protocol)."""

    def __init__(self, owner: Any, argtypes: list[str], source: str, parts: tuple[list[str], str],
                 key: tuple) -> None:
        self.owner, self.argtypes, self.source, self.parts, self.key = owner, argtypes, source, parts, key
        self.fn: Callable[..., Any] | None = None

    def result(self, timeout: float | None = None) -> Callable[..., Any]:
        if self.fn is None:
            compile_pending(self.owner)
        assert self.fn is not None
        return self.fn

    def __call__(self, *args: Any) -> Any:
        return self.result()(*args)


def _pending(owner: Any) -> list[_Deferred]:
    return owner.__dict__.setdefault("_minidi_cpp_batch", [])


def _chunks(items: list[_Deferred], n: int) -> list[list[_Deferred]]:
    """n groups of about equal source length, each in request order."""
    n = max(1, min(n, len(items)))
    total = sum(len(d.source) for d in items)
    groups: list[list[_Deferred]] = [[]]
    acc = 0
    for d in items:
        if acc >= total * len(groups) / n and len(groups) < n and groups[-1]:
            groups.append([])
        groups[-1].append(d)
        acc += len(d.source)
    return groups


def _stock(d: _Deferred) -> Callable[..., Any]:
    """Inductor's own path for one kernel (its own library), resolved."""
    fn = _ORIGINAL["cpp_pybinding"](d.owner, d.argtypes, d.source)
    return fn.result() if hasattr(fn, "result") else fn


def _index_dir() -> str | None:
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        return os.path.join(cache_dir(), INDEX_DIR)
    except (ImportError, OSError):
        return None


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _kernel_digest(key: tuple) -> str:
    source, argtypes, isa = key
    return _digest("\0".join((source, "\1".join(argtypes), isa)))


def _write_new(path: str, text: str) -> None:
    """``text`` into ``path`` whole or not at all (another process reads it at any moment)."""
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _record(group: list[_Deferred], source: str) -> None:
    """Leave the unit's source and each kernel's slot in it where another process looks (``_recorded``)."""
    folder = _index_dir()
    if folder is None:
        return
    unit = _digest(source)
    try:
        os.makedirs(folder, exist_ok=True)
        _write_new(os.path.join(folder, f"{unit}.cpp"), source)  # anew: a damaged copy would be ignored for ever
        for i, d in enumerate(group):
            _write_new(os.path.join(folder, f"{_kernel_digest(d.key)}.slot"), f"{unit} {i}")
    except OSError:  # the index only saves compiles: a folder that cannot be written costs them, nothing else
        pass


def _recorded(key: tuple) -> Callable[..., Any] | None:
    """The kernel from a unit some process built (``_record``), loaded through Inductor's code cache; None where no
    unit holds it or its files do not read back as written."""
    folder = _index_dir()
    if folder is None:
        return None
    try:
        with open(os.path.join(folder, f"{_kernel_digest(key)}.slot")) as f:
            unit, slot = f.read().split()
        i = int(slot)
    except (OSError, ValueError):
        return None
    module = _UNITS.get((folder, unit))  # a unit's other kernels: loaded once, not read and hashed per kernel
    if module is None:
        module = _load_unit(folder, unit)
        if module is None:
            return None
        with _LOCK:
            module = _UNITS.setdefault((folder, unit), module)
    fn = getattr(module, f"kernel_{i}", None)
    if fn is not None:
        with _LOCK:
            STATS["found_kernels"] += 1
    return fn


def _load_unit(folder: str, unit: str) -> Any:
    """The module of a recorded unit (its source read back and checked against its digest), through Inductor's code
    cache: the library built from this source and today's compile command; None where it does not read or build."""
    try:
        with open(os.path.join(folder, f"{unit}.cpp")) as f:
            source = f.read()
    except OSError:
        return None
    if _digest(source) != unit:
        return None
    from torch._inductor.codecache import CppPythonBindingsCodeCache as cache

    try:
        return cache.load_async(source, "cpu")()
    except Exception:  # noqa: BLE001 - a unit that no longer builds: this graph's own units are built instead
        return None


def _compile_unit(group: list[_Deferred]) -> None:
    from torch._inductor.codecache import CppPythonBindingsCodeCache as cache

    try:
        binding = binding_source(cache.suffix_template, cache.call_entry_function, [d.argtypes for d in group])
        source = unit_source([d.parts for d in group], binding)
        module = cache.load_async(source, "cpu")()
        fns = [getattr(module, f"kernel_{i}") for i in range(len(group))]
    except Exception:  # noqa: BLE001 - the stock path per kernel, whose error (if any) names its kernel
        for d in group:
            d.fn = _stock(d)
        with _LOCK:
            STATS["fallback_kernels"] += len(group)
        return
    with _LOCK:
        for d, fn in zip(group, fns):
            d.fn = _BUILT.setdefault(d.key, fn)
        STATS["units"] += 1
        STATS["kernels"] += len(group)
    _record(group, source)


def compile_pending(owner: Any) -> None:
    """Compile every kernel ``owner`` (an ``AsyncCompile``) has collected: one unit per compile thread."""
    from torch._inductor.async_compile import get_compile_threads

    first: dict[tuple, _Deferred] = {}  # a source asked for twice in this graph is built once
    twins = []
    for d in _pending(owner):
        if d.fn is not None:
            continue
        if d.key in first:
            twins.append(d)
        else:
            first[d.key] = d
    _pending(owner).clear()
    if first:
        _compile_groups(_chunks(list(first.values()), get_compile_threads()))
    for d in twins:
        d.fn = first[d.key].fn


def _compile_groups(groups: list[list[_Deferred]]) -> None:
    if len(groups) == 1:
        _compile_unit(groups[0])
        return
    with ThreadPoolExecutor(len(groups)) as pool:  # g++ runs as a subprocess: threads suffice
        list(pool.map(_compile_unit, groups))


_ORIGINAL: dict[str, Callable[..., Any]] = {}


def _timed(key: str) -> contextlib.AbstractContextManager:
    try:
        from torch._dynamo.utils import dynamo_timed
    except ImportError:
        return contextlib.nullcontext()
    return dynamo_timed(key)


def _cpp_pybinding(self: Any, argtypes: list[str], source_code: str) -> Any:
    if not getattr(_STATE, "active", 0):
        return _ORIGINAL["cpp_pybinding"](self, argtypes, source_code)
    key = _key(argtypes, source_code)
    if (built := _BUILT.get(key)) is not None:
        return built  # an earlier graph's kernel: Inductor's cache would hand back its library too
    if (found := _recorded(key)) is not None:  # another process' unit holds it
        with _LOCK:
            return _BUILT.setdefault(key, found)
    parts = split_kernel(source_code)
    if parts is None:
        with _LOCK:
            STATS["fallback_kernels"] += 1
        return _ORIGINAL["cpp_pybinding"](self, argtypes, source_code)
    d = _Deferred(self, list(argtypes), source_code, parts, key)
    _pending(self).append(d)
    return d


def _wait(self: Any, scope: dict[str, Any]) -> None:
    with _timed("async_compile.wait"):  # where Inductor times its own kernel compiles (the benchmark's split)
        compile_pending(self)
    for key, value in list(scope.items()):
        if isinstance(value, _Deferred):
            scope[key] = value.result()
    _ORIGINAL["wait"](self, scope)


def _register_cache_clear() -> None:
    """Inductor's ``fresh_cache`` (tests, ``torch._inductor.utils.fresh_cache``) clears ``_BUILT`` with its caches."""
    try:
        from torch._inductor.codecache import clear_on_fresh_cache
    except ImportError:
        return

    class _Built:
        cache_clear = staticmethod(cache_clear)

    clear_on_fresh_cache(_Built)


def install() -> bool:
    """Wrap ``AsyncCompile.cpp_pybinding`` / ``wait`` once per process (the wrappers defer only inside
    ``batching()``). False where this torch lacks what is used (then nothing is wrapped)."""
    with _LOCK:
        if _INSTALLED:
            return _INSTALLED[0]
        try:
            from torch._inductor.async_compile import AsyncCompile, get_compile_threads  # noqa: F401
            from torch._inductor.codecache import CppPythonBindingsCodeCache as cache

            ok = all(hasattr(cache, a) for a in ("suffix_template", "call_entry_function", "load_async"))
            ok = ok and hasattr(AsyncCompile, "cpp_pybinding") and hasattr(AsyncCompile, "wait")
            if ok:
                binding_source(cache.suffix_template, cache.call_entry_function, [["float*"]])
        except (ImportError, ValueError, KeyError, IndexError):
            ok = False
        if ok:
            _ORIGINAL["cpp_pybinding"], _ORIGINAL["wait"] = AsyncCompile.cpp_pybinding, AsyncCompile.wait
            AsyncCompile.cpp_pybinding, AsyncCompile.wait = _cpp_pybinding, _wait
            _register_cache_clear()
        _INSTALLED.append(ok)
        return ok


__all__ = ["ENV", "INDEX_DIR", "STATS", "batching", "binding_source", "cache_clear", "compile_pending", "enabled",
           "install", "split_kernel", "unit_source"]

"""Compile a Gluon kernel for sm_90a on the CPU (Triton's compiler and ptxas need no GPU): the helper of the Hopper
kernels' compile tests."""

from __future__ import annotations

from typing import Any

import torch


def compile_sm90(fn: Any, descs: dict[str, Any], ptrs: dict[str, torch.dtype], consts: dict[str, Any],
                 aligned: tuple[str, ...] = (), **options: Any) -> Any:
    """``fn`` compiled for sm_90a: ``descs`` its TMA descriptor arguments, ``ptrs`` the dtype of each pointer
    argument, ``consts`` its constexprs; every other argument an i32. ``aligned``: the arguments specialised as
    divisible by 16, as Triton's launcher specialises a 16-byte aligned pointer or such an integer. Returns Triton's
    compiled kernel (``.asm``)."""
    import triton
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    sig = {}
    for name in fn.arg_names:
        if name in descs:
            sig[name] = native_specialize_impl(BaseBackend, descs[name], False, True, True)[0]
        elif name in ptrs:
            sig[name] = native_specialize_impl(BaseBackend, torch.empty(4, dtype=ptrs[name]), False, True, True)[0]
        elif name in consts:
            sig[name] = "constexpr"
        else:
            sig[name] = "i32"
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    return triton.compile(GluonASTSource(fn, sig, {c: consts[c] for c in consts}, attrs),
                          target=GPUTarget("cuda", 90, 32), options=options)


def sass(kern: Any) -> str:
    """The SASS of a compiled kernel (Triton's bundled cuobjdump on its cubin)."""
    import subprocess
    import tempfile

    from triton import knobs

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kern.asm["cubin"])
        f.flush()
        return subprocess.run([knobs.nvidia.cuobjdump.path, "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout


def _instructions(sass_text: str) -> tuple[list[int], list[str]]:
    """(addresses, instruction texts) of a SASS listing."""
    import re

    addr, text = [], []
    for line in sass_text.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s*(.*?)\s*;", line)
        if m:
            addr.append(int(m.group(1), 16))
            text.append(m.group(2))
    return addr, text


def _dest(ins: str) -> str | None:
    """The destination register of an instruction (its first operand; a predicate guard skipped)."""
    t = ins.split()
    t = t[1:] if t and t[0].startswith("@") else t
    return t[1].rstrip(",") if len(t) > 1 else None


def inflight_a_writes(sass_text: str, count_waits: bool = False) -> tuple[int, list[str]]:
    """Register-operand wgmma hazard check on SASS: for each group of ``HGMMA`` ending in ``gsb0``, the
    instructions that write one of its A registers while it may still run (following backward branches, i.e. into
    the next loop iteration). The wgmma reads those registers until it completes; ptxas 12.8-13.4 may allocate other
    values over them (round 18). A group is done at the next ``WARPGROUP.DEPBAR``; with ``count_waits`` (kernels that
    wait with groups outstanding) only at a ``WARPGROUP.DEPBAR.LE gsb0, N`` reached after N later groups were
    committed on the path. Returns (number of groups, offending instructions)."""
    import re

    addr, text = _instructions(sass_text)
    where = {a: i for i, a in enumerate(addr)}
    groups, regs = [], set()
    for i, ins in enumerate(text):
        m = re.match(r"HGMMA\.\S+ R\d+, R(\d+),", ins)
        if m:
            regs |= {f"R{int(m.group(1)) + j}" for j in range(4)}
            if "gsb0" in ins:
                groups.append((i, regs))
                regs = set()

    def done(ins: str, later: int) -> bool:
        if not count_waits:
            return "DEPBAR" in ins
        m = re.match(r"WARPGROUP\.DEPBAR\.LE gsb0, (0x[0-9a-f]+)", ins)
        return bool(m) and later >= int(m.group(1), 16)  # only groups newer than ours may still run

    bad = []
    for end, regs in groups:
        i, later, seen = end + 1, 0, set()
        while i < len(text) and (i, later) not in seen and not done(text[i], later):
            seen.add((i, later))
            later += bool(count_waits and re.match(r"HGMMA\.\S+ .*gsb0", text[i]))
            if _dest(text[i]) in regs:
                bad.append(text[i])
            m = re.match(r"(@!?U?P\w+ )?BRA (0x[0-9a-f]+)", text[i])
            if m and int(m.group(2), 16) in where and (not m.group(1) or int(m.group(2), 16) < addr[i]):
                i = where[int(m.group(2), 16)]  # an unconditional jump, or a loop's back-edge
            else:
                i += 1
    return len(groups), bad

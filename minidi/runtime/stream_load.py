"""Streaming tensor reads: safetensors shards -> their target device, one tensor at a time, with bounded host memory.

``load_checkpoint`` validates every header entry (names, shapes, dtypes, the safetensors header itself through
``safe_open``) and then asks a ``TensorReader`` for the bytes of each wanted tensor, shard by shard, in file order:

    reader = TensorReader("cuda")            # or "cpu"; progress lines on stderr once a load takes > 3 s
    cfg, tensors = load_checkpoint(folder, device="cuda", reader=reader)
    reader.bytes_read, reader.peak_staging_bytes

- CPU target: each tensor is ``torch.empty`` + ``readinto`` from the file (no mmap, no second host copy).
- other devices: large sequential reads into two pinned staging buffers of ``chunk_bytes`` (double buffered: the
  disk read of chunk i+1 overlaps the host-to-device copy of chunk i), copied into the device tensor. Peak host
  memory is the two buffers (``peak_staging_bytes``), whatever the checkpoint size.
- ``staging=True`` forces the staging path on the CPU too (tests count its bytes).
Reads are ``posix_fadvise(SEQUENTIAL)``, so the kernel's read-ahead keeps the disk busy while a chunk is copied.
"""

from __future__ import annotations

import json
import os
import struct
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Iterator

import torch

ST_TO_TORCH: dict[str, torch.dtype] = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F8_E8M0": torch.float8_e8m0fnu,
}


def read_header(f: IO[bytes]) -> tuple[dict[str, dict], int]:
    """The safetensors header ``{name: {dtype, shape, data_offsets}}`` and the file offset where data begins."""
    f.seek(0)
    (n,) = struct.unpack("<Q", f.read(8))
    header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


class _Progress:
    """Progress over bytes on ``stream``: silent for the first ``after_s`` seconds (small loads print nothing), then
    a bar redrawn in place on a terminal, or a line every ``every_s`` seconds in a log; a last line at the end."""

    def __init__(self, enabled: bool | None, after_s: float, every_s: float, stream: IO[str]) -> None:
        self.enabled, self.after_s, self.every_s, self.stream = enabled, after_s, every_s, stream
        self.t0 = self.last = time.perf_counter()
        self.total: int | None = None
        self.shown = False
        self.tty = bool(getattr(stream, "isatty", lambda: False)())

    def line(self, done: int) -> str:
        dt = max(time.perf_counter() - self.t0, 1e-9)
        rate = f"{done / dt / 1e9:.2f} GB/s"
        if not self.total:
            return f"loading checkpoint: {done / 1e9:.2f} GB, {dt:.1f} s, {rate}"
        frac = min(done / self.total, 1.0)
        bar = "#" * int(30 * frac) + "." * (30 - int(30 * frac))
        return (f"loading checkpoint [{bar}] {done / 1e9:.2f}/{self.total / 1e9:.2f} GB ({100 * frac:.0f}%), "
                f"{dt:.1f} s, {rate}")

    def update(self, done: int) -> None:
        if self.enabled is False:
            return
        now = time.perf_counter()
        if now - self.t0 < self.after_s or now - self.last < (0.5 if self.tty else self.every_s):
            return
        self.last, self.shown = now, True
        self.stream.write(("\r" if self.tty else "") + self.line(done) + ("" if self.tty else "\n"))
        self.stream.flush()

    def finish(self, done: int) -> None:
        if self.shown or (self.enabled and self.total):
            self.stream.write(("\r" if self.tty else "") + self.line(done) + "\n")
            self.stream.flush()


class TensorReader:
    """Reads tensors from safetensors shards straight into tensors on ``device`` (see the module docstring).

    Counters: ``bytes_read`` and ``tensors_read`` (what was materialised), ``peak_staging_bytes`` (host staging
    memory held at once), ``read_order`` (names in the order read).
    progress: None = lines after ``progress_after_s`` seconds; True = also a final line for any load; False = never.
    """

    def __init__(
        self,
        device: torch.device | str = "cpu",
        *,
        chunk_bytes: int = 64 << 20,
        staging: bool | None = None,
        progress: bool | None = None,
        progress_after_s: float = 3.0,
        progress_every_s: float = 10.0,
        stream: IO[str] | None = None,
    ) -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.chunk_bytes = int(chunk_bytes)
        if self.chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be > 0, got {chunk_bytes}")
        self.staging = self.device.type != "cpu" if staging is None else staging
        self.progress = _Progress(progress, progress_after_s, progress_every_s, stream or sys.stderr)
        self.bytes_read = 0
        self.tensors_read = 0
        self.peak_staging_bytes = 0
        self.read_order: list[str] = []
        self._bufs: list[torch.Tensor] = []
        self._events: list[object | None] = [None, None]
        self._next = 0

    # ---- called by load_checkpoint ------------------------------------------------------------------------------
    def begin(self, total_bytes: int | None) -> None:
        """Start of a load of ``total_bytes`` (for the progress bar; None = unknown)."""
        self.progress.total = total_bytes
        self.progress.t0 = self.progress.last = time.perf_counter()

    @contextmanager
    def shard(self, fpath: str | Path) -> Iterator["_Shard"]:
        with open(fpath, "rb", buffering=0) as f:
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
            yield _Shard(self, f, Path(fpath))

    def finish(self) -> None:
        """Wait for the last copies; release the staging buffers; print the last progress line."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self._bufs, self._events = [], [None, None]
        self.progress.finish(self.bytes_read)

    # ---- the copy ----------------------------------------------------------------------------------------------
    def _staging_buffers(self) -> list[torch.Tensor]:
        if not self._bufs:
            pin = self.device.type == "cuda"
            self._bufs = [torch.empty(self.chunk_bytes, dtype=torch.uint8, pin_memory=pin) for _ in range(2)]
            self.peak_staging_bytes = max(self.peak_staging_bytes, 2 * self.chunk_bytes)
        return self._bufs

    def _fill(self, f: IO[bytes], offset: int, dst: torch.Tensor, fpath: Path, name: str) -> None:
        """Copy ``dst.numel()`` bytes at file ``offset`` into ``dst`` (flat uint8 on the target device)."""
        n = dst.numel()
        if not self.staging:
            _readinto_exact(f, offset, memoryview(dst.numpy()), fpath, name)
            self._count(n)
            return
        bufs = self._staging_buffers()
        pos = 0
        while pos < n:
            k = min(self.chunk_bytes, n - pos)
            i = self._next
            self._next ^= 1
            ev = self._events[i]
            if ev is not None:  # the copy out of this buffer (two chunks ago) must be done before it is refilled
                ev.synchronize()
            _readinto_exact(f, offset + pos, memoryview(bufs[i].numpy())[:k], fpath, name)
            dst[pos:pos + k].copy_(bufs[i][:k], non_blocking=self.device.type == "cuda")
            if self.device.type == "cuda":
                self._events[i] = torch.cuda.Event()
                self._events[i].record(torch.cuda.current_stream(self.device))
            pos += k
            self._count(k)

    def _count(self, k: int) -> None:
        self.bytes_read += k
        self.progress.update(self.bytes_read)


class _Shard:
    """One open shard: its header, and ``read(name)`` -> the tensor on the reader's device."""

    def __init__(self, reader: TensorReader, f: IO[bytes], fpath: Path) -> None:
        self.reader, self.f, self.fpath = reader, f, fpath
        self.header, self.data_start = read_header(f)

    def file_order(self, names: list[str]) -> list[str]:
        """``names`` sorted by their data offset (sequential reads); names not in this shard last, in their order."""
        def key(n: str) -> tuple[int, int]:
            e = self.header.get(n)
            return (0, e["data_offsets"][0]) if e is not None else (1, 0)

        return sorted(names, key=key)

    def read(self, name: str) -> torch.Tensor:
        e = self.header[name]
        dtype, shape = ST_TO_TORCH[e["dtype"]], tuple(e["shape"])
        begin, end = e["data_offsets"]
        out = torch.empty(shape, dtype=dtype, device=self.reader.device)
        flat = out.reshape(-1).view(torch.uint8)  # [nbytes]
        if flat.numel() != end - begin:
            raise ValueError(f"tensor {name} in shard {self.fpath.name}: shape {list(shape)} {e['dtype']} needs "
                             f"{flat.numel()} bytes, its data offsets span {end - begin}")
        if flat.numel():
            self.reader._fill(self.f, self.data_start + begin, flat, self.fpath, name)
        self.reader.tensors_read += 1
        self.reader.read_order.append(name)
        return out


def _readinto_exact(f: IO[bytes], offset: int, mv: memoryview, fpath: Path, name: str) -> None:
    f.seek(offset)
    got = 0
    while got < len(mv):
        k = f.readinto(mv[got:])
        if not k:
            raise ValueError(f"tensor {name} in shard {fpath.name}: the file ends {len(mv) - got} bytes early "
                             f"(at offset {offset + got})")
        got += k

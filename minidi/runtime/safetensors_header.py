"""Name the bad entry of a safetensors header that ``safe_open`` refused.

safetensors checks the header as a whole and reports e.g. "invalid shape, data type, or offset for tensor" or
"incomplete metadata, file not fully covered" without saying which tensor. In a 46-shard download the name is what
tells a truncated transfer from a mislabelled tensor, so on a refused shard the loader re-reads the header here
(8-byte little-endian length + JSON; never the data) and lists every entry that breaks the format.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

# bits per element of every safetensors dtype (sub-byte formats pack several per byte)
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64,
    "U64": 64, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}
MAX_HEADER = 100 << 20  # safetensors' own limit


def diagnose_header(fpath: str | Path) -> list[str]:
    """One line per problem found in the header of ``fpath`` (naming the tensor); empty if none is found."""
    fpath = Path(fpath)
    try:
        size = os.path.getsize(fpath)
        with open(fpath, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return [f"file of {size} bytes is shorter than the 8-byte header length"]
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER or 8 + n > size:
                return [f"header length {n} runs past the end of the {size}-byte file (truncated or not safetensors)"]
            text = f.read(n)
    except OSError as e:
        return [f"cannot read the header: {e.strerror or e}"]
    try:
        header = json.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        return [f"header is not valid JSON: {e}"]
    if not isinstance(header, dict):
        return [f"header is a JSON {type(header).__name__}, not an object"]
    data = size - 8 - n
    out: list[str] = []
    spans: list[tuple[int, int, str]] = []
    for name, e in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(e, dict):
            out.append(f"tensor {name}: header entry is not an object")
            continue
        dt, shape, offs = e.get("dtype"), e.get("shape"), e.get("data_offsets")
        if dt not in DTYPE_BITS:
            out.append(f"tensor {name}: unknown dtype {dt!r}")
            continue
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
            out.append(f"tensor {name}: shape {shape!r} is not a list of non-negative ints")
            continue
        if not (isinstance(offs, list) and len(offs) == 2 and all(isinstance(o, int) and o >= 0 for o in offs)
                and offs[0] <= offs[1]):
            out.append(f"tensor {name}: data_offsets {offs!r} are not [begin, end] with 0 <= begin <= end")
            continue
        need = math.prod(shape) * DTYPE_BITS[dt]
        if need % 8 or need // 8 != offs[1] - offs[0]:
            out.append(f"tensor {name}: shape {shape} of {dt} needs {need / 8:g} bytes but data_offsets {offs} "
                       f"span {offs[1] - offs[0]}")
        if offs[1] > data:
            out.append(f"tensor {name}: data_offsets {offs} run past the end of the data ({data} bytes): "
                       "truncated file?")
        spans.append((offs[0], offs[1], name))
    spans.sort()
    end = 0
    for b, e, name in spans:
        if b != end:
            out.append(f"tensor {name}: data starts at byte {b}, the previous tensor ends at {end} "
                       f"({'gap' if b > end else 'overlap'})")
        end = max(end, e)
    if spans and not out and end != data:
        out.append(f"tensors cover {end} bytes of data, the file holds {data} (trailing bytes)")
    return out

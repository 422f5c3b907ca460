"""A GGUF file's metadata and tensor table, read from the memory-mapped bytes.

`gguf.GGUFReader` parses every metadata value into numpy views, one pair per string: seconds
for a 150k-token vocabulary and its merges. Here numeric arrays are one `np.frombuffer` each
and a string array is one pass over its length prefixes, each string cut out of the mapped
bytes and decoded once. Tensors are memory-mapped byte ranges (`gguf.quants.dequantize` reads
them). Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md (version 2 and 3,
little-endian).
"""

from __future__ import annotations

import dataclasses
import struct
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType, GGUFValueType

V = GGUFValueType
SCALARS = {V.UINT8: "<u1", V.INT8: "<i1", V.UINT16: "<u2", V.INT16: "<i2", V.UINT32: "<u4",
           V.INT32: "<i4", V.FLOAT32: "<f4", V.BOOL: "?", V.UINT64: "<u8", V.INT64: "<i8",
           V.FLOAT64: "<f8"}
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")


class GGUFTensor(NamedTuple):
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF's ne: innermost dimension first (numpy order reversed)
    n_bytes: int  # its size by the table; data is shorter in a truncated file
    data: np.ndarray  # uint8 [n_bytes], memory-mapped


@dataclasses.dataclass(frozen=True)
class GGUFFile:
    fields: dict[str, Any]  # key -> int | float | bool | str | list of those
    tensors: list[GGUFTensor]


class _Cursor:
    """Reads little-endian values at a moving offset; a read past the end raises ValueError."""

    def __init__(self, buf: np.ndarray):
        self.buf, self.mem, self.at = buf, memoryview(buf), 0

    def take(self, n: int) -> int:
        start, self.at = self.at, self.at + n
        if self.at > len(self.buf):
            raise ValueError(f"the file ends inside its header (byte {start} + {n} of "
                             f"{len(self.buf)})")
        return start

    def u32(self) -> int:
        return _U32.unpack_from(self.mem, self.take(4))[0]

    def u64(self) -> int:
        return _U64.unpack_from(self.mem, self.take(8))[0]

    def string(self) -> str:
        n = self.u64()
        start = self.take(n)
        return str(self.mem[start:start + n], "utf-8")

    def strings(self, count: int) -> list[str]:
        """`count` strings: one walk over the length prefixes, then one decode per string."""
        mem, end = self.mem, len(self.buf)
        starts, lengths, at = [0] * count, [0] * count, self.at
        for i in range(count):
            if at + 8 > end:
                raise ValueError(f"the file ends inside string {i} of an array of {count}")
            n = _U64.unpack_from(mem, at)[0]
            starts[i], lengths[i], at = at + 8, n, at + 8 + n
        if at > end:
            raise ValueError(f"the file ends inside the last string of an array of {count}")
        self.at = at
        return [str(mem[s:s + n], "utf-8") for s, n in zip(starts, lengths)]

    def value(self, kind: int) -> Any:
        kind = V(kind)
        if kind == V.STRING:
            return self.string()
        if kind in SCALARS:
            dtype = np.dtype(SCALARS[kind])
            return np.frombuffer(self.buf, dtype, 1, self.take(dtype.itemsize))[0].item()
        if kind != V.ARRAY:
            raise ValueError(f"unknown metadata value type {kind}")
        item, count = V(self.u32()), self.u64()
        if item == V.STRING:
            return self.strings(count)
        if item in SCALARS:
            dtype = np.dtype(SCALARS[item])
            return np.frombuffer(self.buf, dtype, count, self.take(count * dtype.itemsize)).tolist()
        return [self.value(item) for _ in range(count)]  # arrays of arrays


def read_gguf(path: str | Path) -> GGUFFile:
    """The metadata and tensor table of the GGUF file at path. Raises ValueError on a file
    that is not GGUF or whose header is cut off (a cut in tensor data shows as a tensor whose
    data is shorter than n_bytes)."""
    buf = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(buf)
    if len(buf) < 4 or bytes(buf[:4]) != b"GGUF":
        raise ValueError("no GGUF magic at the start of the file")
    cur.take(4)
    version = cur.u32()
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not supported (2 and 3 are; a big-endian "
                         "file also reads as another version)")
    num_tensors, num_fields = cur.u64(), cur.u64()
    fields: dict[str, Any] = {}
    for _ in range(num_fields):
        key = cur.string()
        if key in fields:
            raise ValueError(f"metadata key {key!r} appears twice")
        fields[key] = cur.value(cur.u32())
    table = []
    for _ in range(num_tensors):
        name = cur.string()
        shape = tuple(cur.u64() for _ in range(cur.u32()))
        table.append((name, GGMLQuantizationType(cur.u32()), shape, cur.u64()))
    align = fields.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
    if not isinstance(align, int) or align <= 0 or align & (align - 1):
        raise ValueError(f"general.alignment = {align!r} is not a power of two")
    start = -(-cur.at // align) * align
    tensors = []
    for name, kind, shape, offset in table:
        block, size = GGML_QUANT_SIZES[kind]
        n_bytes = int(np.prod(shape, dtype=np.int64)) * size // block
        at = start + offset
        tensors.append(GGUFTensor(name, kind, shape, n_bytes, buf[at:at + n_bytes]))
    if len({t.name for t in tensors}) != len(tensors):
        raise ValueError("a tensor name appears twice")
    return GGUFFile(fields, tensors)

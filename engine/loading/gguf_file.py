"""Reading a GGUF file's header: the metadata key/values and the tensor table, with the
tensors' bytes as views of a memory map (nothing is read until a tensor is touched).

gguf's own `GGUFReader` builds a numpy view per array element, which for a 262k-token
vocabulary (Gemma's) takes a minute or more; here string arrays are one Python loop over
the bytes and numeric arrays one `frombuffer` each. Layout: github.com/ggml-org/ggml
docs/gguf.md (version 2 and 3, little-endian)."""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

_MAGIC = b"GGUF"
_STRING, _ARRAY = 8, 9
# GGUF value type -> struct format of one scalar.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
          6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}


@dataclass
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # innermost dimension first, as GGUF lists them
    data: np.ndarray  # raw bytes [outer dims..., bytes of one innermost row] (read-only)


@dataclass
class GGUFFile:
    fields: dict[str, Any]  # key -> int, float, bool, str, list[str] or numpy array
    tensors: list[GGUFTensor]


class _Cursor:
    def __init__(self, buf: mmap.mmap) -> None:
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("Q")
        self.pos += n
        return self.buf[self.pos - n:self.pos].decode("utf-8", errors="replace")

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.scalar("I"), self.scalar("Q")
            if item == _STRING:
                return [self.string() for _ in range(count)]
            if item not in _NUMPY:
                return [self.value(item) for _ in range(count)]
            values = np.frombuffer(self.buf, _NUMPY[item], count, self.pos).copy()
            self.pos += values.nbytes
            return values
        return self.scalar(_SCALARS[kind])


def read_gguf(path: str) -> GGUFFile:
    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    cur = _Cursor(buf)
    if buf[:4] != _MAGIC:
        raise ValueError(f"{path} is not a GGUF file (bad magic)")
    cur.pos = 4
    version = cur.scalar("I")
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3)")
    n_tensors, n_fields = cur.scalar("Q"), cur.scalar("Q")
    fields: dict[str, Any] = {}
    for _ in range(n_fields):
        key = cur.string()
        fields[key] = cur.value(cur.scalar("I"))
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = tuple(cur.scalar("Q") for _ in range(cur.scalar("I")))
        infos.append((name, dims, GGMLQuantizationType(cur.scalar("I")), cur.scalar("Q")))
    alignment = int(fields.get("general.alignment", 32))
    data_start = -(-cur.pos // alignment) * alignment
    whole = np.frombuffer(buf, np.uint8)
    tensors = []
    for name, dims, qtype, offset in infos:
        block, block_bytes = GGML_QUANT_SIZES[qtype]
        row_bytes = dims[0] // block * block_bytes
        rows = int(np.prod(dims[1:], dtype=np.int64)) if len(dims) > 1 else 1
        start = data_start + offset
        data = whole[start:start + rows * row_bytes].reshape(*reversed(dims[1:]), row_bytes)
        tensors.append(GGUFTensor(name, qtype, dims, data))
    return GGUFFile(fields, tensors)

"""The GGUF container: its metadata and its tensors' bytes, read in one pass over the header.

    magic "GGUF" | version (2, 3) | tensor count | metadata count       little-endian
    metadata:  key (u64 length + UTF-8) | value type (u32) | value      arrays: element type, u64 count, elements
    tensors:   name | n dims (u32) | dims (u64 each, innermost first) | ggml type (u32) | offset (u64)
    padding to `general.alignment` (32 by default), then the tensor data, each at its offset

`gguf.GGUFReader` reads the same header, but walks every element of every array into its own
numpy view: a 150k-token vocabulary and its merges took it 7-28 s per read on our two cores
(idle to loaded), and transformers' config reading for these families reads the file that way
again.  Here string arrays are stepped over (only their count is kept, unless asked for),
numeric arrays are one `frombuffer`, and the tensor data is one read-only memory map sliced per
tensor, so nothing is read until a tensor is.  The type numbers, block sizes and value types
are the `gguf` package's own (`GGMLQuantizationType`, `GGML_QUANT_SIZES`, `GGUFValueType`).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType, GGUFValueType

V = GGUFValueType
_SCALARS = {V.UINT8: "<B", V.INT8: "<b", V.UINT16: "<H", V.INT16: "<h", V.UINT32: "<I", V.INT32: "<i",
            V.FLOAT32: "<f", V.BOOL: "<?", V.UINT64: "<Q", V.INT64: "<q", V.FLOAT64: "<d"}
_NUMPY = {V.UINT8: "<u1", V.INT8: "<i1", V.UINT16: "<u2", V.INT16: "<i2", V.UINT32: "<u4", V.INT32: "<i4",
          V.FLOAT32: "<f4", V.BOOL: "?", V.UINT64: "<u8", V.INT64: "<i8", V.FLOAT64: "<f8"}
# Element types of the unquantized tensors, as numpy reads them (BF16: its 16 raw bits).
_ELEMENTS = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
             GGMLQuantizationType.BF16: np.uint16, GGMLQuantizationType.F64: np.float64,
             GGMLQuantizationType.I8: np.int8, GGMLQuantizationType.I16: np.int16,
             GGMLQuantizationType.I32: np.int32, GGMLQuantizationType.I64: np.int64}

_KNOWN_TYPES = {t.value for t in GGMLQuantizationType}


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor: `shape` in PyTorch order; `data` a read-only view of the mapped file, the
    values for unquantized types (BF16 as uint16 bits), else [rows, bytes per row] raw bytes."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape))


@dataclass(frozen=True)
class GGUFFile:
    path: Path
    metadata: dict[str, Any]  # string arrays as their length unless asked for by name
    tensors: list[GGUFTensor]

    def tensor(self, name: str) -> GGUFTensor | None:
        return next((t for t in self.tensors if t.name == name), None)


class _Cursor:
    def __init__(self, buf: np.ndarray, path: Path):
        self.buf, self.pos, self.path = buf, 0, path

    def scalar(self, fmt: str):
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.scalar("<Q")
        s = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def value(self, vtype: int, keep_strings: bool):
        vtype = V(vtype)
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == V.STRING:
            return self.string()
        if vtype != V.ARRAY:
            raise ValueError(f"{self.path.name}: GGUF metadata value of unknown type {vtype}")
        etype, count = V(self.scalar("<I")), self.scalar("<Q")
        if etype in _NUMPY:
            dt = np.dtype(_NUMPY[etype])
            out = np.frombuffer(self.buf, dtype=dt, count=count, offset=self.pos).tolist()
            self.pos += count * dt.itemsize
            return out
        if etype == V.STRING:
            if keep_strings:
                return [self.string() for _ in range(count)]
            for _ in range(count):  # variable length: walk the lengths, decode nothing
                self.pos += 8 + self.scalar("<Q")
            return count
        return [self.value(etype, keep_strings) for _ in range(count)]  # arrays of arrays


def read_gguf(path: Path, string_arrays: tuple[str, ...] = ()) -> GGUFFile:
    """The header of GGUF file `path` and views of its tensors (see the module doc); the string
    arrays named in `string_arrays` are read in full."""
    buf = np.memmap(path, mode="r", dtype=np.uint8)
    c = _Cursor(buf, path)
    if bytes(buf[:4]) != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file (no GGUF magic)")
    version = struct.unpack_from("<I", buf, 4)[0]
    if version not in (2, 3):
        raise ValueError(f"{path.name}: GGUF version {version} is not supported (2 and 3 are; big-endian files are not)")
    n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)
    c.pos = 24
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = c.string()
        metadata[key] = c.value(c.scalar("<I"), key in string_arrays)
    infos = []
    for _ in range(n_tensors):
        name = c.string()
        dims = [c.scalar("<Q") for _ in range(c.scalar("<I"))]
        code = c.scalar("<I")
        if code not in _KNOWN_TYPES:
            raise ValueError(f"{path.name}: GGUF tensor {name!r} has ggml type {code}, which the gguf package "
                             "does not know (a newer file?)")
        infos.append((name, GGMLQuantizationType(code), tuple(reversed(dims)), c.scalar("<Q")))
    align = int(metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT))
    start = -(-c.pos // align) * align
    tensors = [GGUFTensor(name, qtype, shape, _view(buf, start + off, qtype, shape)) for name, qtype, shape, off in infos]
    return GGUFFile(path, metadata, tensors)


def _view(buf: np.ndarray, offset: int, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> np.ndarray:
    n = int(np.prod(shape))
    if qtype in _ELEMENTS:
        dt = np.dtype(_ELEMENTS[qtype])
        return np.frombuffer(buf, dtype=dt, count=n, offset=offset).reshape(shape)
    block, nbytes = GGML_QUANT_SIZES[qtype]
    row = shape[-1] // block * nbytes
    rows = n // shape[-1]
    return np.frombuffer(buf, dtype=np.uint8, count=rows * row, offset=offset).reshape(rows, row)

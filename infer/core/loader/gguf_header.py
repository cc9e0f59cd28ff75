"""A GGUF file's metadata and tensor table, read without decoding its vocabulary.

gguf-py's `GGUFReader` turns every element of every metadata array into NumPy
views up front: for SmolLM2's 49k-token vocabulary and 49k merges that is
a slow pass and a memory peak before a single weight is read
(docs/backends/torch-measurements.md), and the engine needs only
scalars from the metadata (the tokenizer comes from a cache, or from
transformers' own GGUF conversion). This reader walks the same layout (GGUF
v2/v3: header, key/value pairs, tensor infos, aligned data) and keeps arrays
as (type, count, offset) until `contents()` asks for their values. Tensor data
stay views of one read-only memmap, in the shapes `GGUFReader` gives them, and
the type tables come from gguf-py itself.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

_SCALARS = {  # value type -> struct format (little-endian)
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
# Tensor types stored as plain elements; every other type is blocks of bytes.
_PLAIN = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
          GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8, GGMLQuantizationType.I16: np.int16,
          GGMLQuantizationType.I32: np.int32, GGMLQuantizationType.I64: np.int64}


@dataclass
class GGUFField:
    """One metadata value: a scalar or string now, an array's values on demand."""

    type: GGUFValueType
    value: Any = None  # scalars and strings
    item_type: GGUFValueType | None = None  # arrays
    count: int = 0
    offset: int = 0  # of an array's first item
    _file: GGUFHeader | None = field(default=None, repr=False)

    def contents(self) -> Any:
        if self.type != GGUFValueType.ARRAY:
            return self.value
        return self._file._array(self)


@dataclass
class GGUFTensor:
    """A tensor's table entry; ``data`` is a view of the file (uint8 blocks for quantized types)."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray  # ggml order: the fastest-moving dimension first
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray


class GGUFVersionError(ValueError):
    """A well-formed GGUF of a version this reader does not know."""

    def __init__(self, version: int):
        super().__init__(f"GGUF version {version} is not supported (2 and 3 are)")
        self.version = version


class GGUFHeader:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._mm = np.memmap(self.path, mode="r")
        self._buf = memoryview(self._mm)
        if bytes(self._buf[:4]) != b"GGUF":
            raise ValueError("not a GGUF file (bad magic)")
        version = self._unpack("<I", 4)
        if version not in (2, 3):
            raise GGUFVersionError(version)
        n_tensors, n_kv = self._unpack("<Q", 8), self._unpack("<Q", 16)
        pos = 24
        self.fields: dict[str, GGUFField] = {}
        for _ in range(n_kv):
            key, pos = self._string(pos)
            vtype = GGUFValueType(self._unpack("<I", pos))
            self.fields[key], pos = self._value(vtype, pos + 4)
        infos = []
        for _ in range(n_tensors):
            name, pos = self._string(pos)
            n_dims = self._unpack("<I", pos)
            dims = np.frombuffer(self._buf, np.uint64, n_dims, pos + 4).astype(np.int64)
            pos += 4 + 8 * n_dims
            ttype, offset = GGMLQuantizationType(self._unpack("<I", pos)), self._unpack("<Q", pos + 4)
            infos.append((name, dims, ttype, offset))
            pos += 12
        align_field = self.fields.get("general.alignment")
        align = int(align_field.value) if align_field is not None else 32
        start = -(-pos // align) * align
        self.tensors = [self._tensor(name, dims, ttype, start + offset) for name, dims, ttype, offset in infos]

    def release(self, start: int, length: int) -> None:
        """Drop the process's resident pages of file bytes [start, start + length) (a tensor
        read and converted): the mapping is read-only, so a later read faults them back in from
        the page cache. Without this, every tensor read stays in the process's RSS until the
        reader goes, beside its converted copy."""
        mm = getattr(self._mm, "_mmap", None)
        if mm is None or not hasattr(mmap, "MADV_DONTNEED") or length <= 0:
            return
        page = mmap.PAGESIZE
        lo, hi = start // page * page, min(-(-(start + length) // page) * page, len(self._mm))
        if hi > lo:
            mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)

    # -- metadata -------------------------------------------------------------
    def _unpack(self, fmt: str, pos: int) -> Any:
        if pos + struct.calcsize(fmt) > len(self._buf):
            raise ValueError(f"truncated: metadata runs past the end of the file at byte {pos}")
        return struct.unpack_from(fmt, self._buf, pos)[0]

    def _string(self, pos: int) -> tuple[str, int]:
        n = self._unpack("<Q", pos)
        if pos + 8 + n > len(self._buf):
            raise ValueError(f"truncated: a string at byte {pos} runs past the end of the file")
        return bytes(self._buf[pos + 8:pos + 8 + n]).decode("utf-8"), pos + 8 + n

    def _value(self, vtype: GGUFValueType, pos: int) -> tuple[GGUFField, int]:
        if vtype == GGUFValueType.STRING:
            text, end = self._string(pos)
            return GGUFField(vtype, text), end
        if vtype in _SCALARS:
            return GGUFField(vtype, self._unpack(_SCALARS[vtype], pos)), pos + struct.calcsize(_SCALARS[vtype])
        if vtype != GGUFValueType.ARRAY:
            raise ValueError(f"unknown GGUF value type {vtype} at byte {pos}")
        item, count = GGUFValueType(self._unpack("<I", pos)), self._unpack("<Q", pos + 4)
        first = end = pos + 12
        if item in _SCALARS:
            end += count * struct.calcsize(_SCALARS[item])
        elif item == GGUFValueType.STRING:  # skipped by their lengths, not decoded
            for _ in range(count):
                end += 8 + self._unpack("<Q", end)
        else:  # nested arrays: walk them
            for _ in range(count):
                end = self._value(item, end)[1]
        if end > len(self._buf):
            raise ValueError(f"truncated: an array at byte {pos} runs past the end of the file")
        return GGUFField(vtype, item_type=item, count=count, offset=first, _file=self), end

    def _array(self, f: GGUFField) -> list:
        pos, out = f.offset, []
        for _ in range(f.count):
            value, pos = self._value(f.item_type, pos)
            out.append(value.contents())
        return out

    # -- tensors --------------------------------------------------------------
    def _tensor(self, name: str, dims: np.ndarray, ttype: GGMLQuantizationType, offset: int) -> GGUFTensor:
        n = int(np.prod(dims))
        block, type_size = GGML_QUANT_SIZES[ttype]
        n_bytes = n * type_size // block
        np_dims = tuple(int(d) for d in reversed(dims.tolist()))
        if offset + n_bytes > len(self._mm):
            data = np.empty(0, np.uint8)  # the checkpoint reports this tensor as truncated
        elif ttype in _PLAIN:
            data = np.frombuffer(self._mm, _PLAIN[ttype], n, offset).reshape(np_dims)
        else:
            data = np.frombuffer(self._mm, np.uint8, n_bytes, offset).reshape(quant_shape_to_byte_shape(np_dims, ttype))
        return GGUFTensor(name, ttype, dims, n, n_bytes, offset, data)

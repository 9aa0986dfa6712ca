"""A GGUF file's metadata and tensor index, read straight from a memory map.

`gguf.GGUFReader` builds numpy views for every element of every metadata array: ~5 s of CPU for SmolLM2's
49k-token vocabulary and 48k merges, paid by every process that reads the tokenizer, the config or the weights
(each service at startup, and again at each restart). This reads the same format (versions 2 and 3,
little-endian) with `struct`, decoding each string once; a tensor's data is a read-only numpy view of the mapped
file, shaped as gguf's reader shapes it (what `gguf.quants.dequantize` takes).
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
# a scalar's struct format, and the numpy dtype its arrays are read as
_SCALARS: dict[GGUFValueType, tuple[struct.Struct, str]] = {
    GGUFValueType.UINT8: (struct.Struct("<B"), "<u1"),
    GGUFValueType.INT8: (struct.Struct("<b"), "<i1"),
    GGUFValueType.UINT16: (struct.Struct("<H"), "<u2"),
    GGUFValueType.INT16: (struct.Struct("<h"), "<i2"),
    GGUFValueType.UINT32: (struct.Struct("<I"), "<u4"),
    GGUFValueType.INT32: (struct.Struct("<i"), "<i4"),
    GGUFValueType.FLOAT32: (struct.Struct("<f"), "<f4"),
    GGUFValueType.BOOL: (struct.Struct("<?"), "?"),
    GGUFValueType.UINT64: (struct.Struct("<Q"), "<u8"),
    GGUFValueType.INT64: (struct.Struct("<q"), "<i8"),
    GGUFValueType.FLOAT64: (struct.Struct("<d"), "<f8"),
}
# tensor types stored as plain elements (gguf's reader gives these their own dtype; the rest are bytes)
_ELEMENT_DTYPES = {
    GGMLQuantizationType.F32: "<f4", GGMLQuantizationType.F16: "<f2", GGMLQuantizationType.F64: "<f8",
    GGMLQuantizationType.I8: "<i1", GGMLQuantizationType.I16: "<i2", GGMLQuantizationType.I32: "<i4",
    GGMLQuantizationType.I64: "<i8",
}


class GGUFTensor(NamedTuple):
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF's order: the innermost dimension first
    data: np.ndarray  # read-only: elements for plain types, bytes [..., bytes per row] for quantized ones


class GGUFFile:
    """`metadata`: every key's value as Python values (arrays as lists); `tensors`: in file order."""

    def __init__(self, path: Path) -> None:
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            self.metadata, self.tensors = _Parser(self._map, path).parse()
        except (struct.error, UnicodeDecodeError, IndexError) as e:
            raise ValueError(f"{path}: not a readable GGUF file ({e})") from e

    def tensor_names(self) -> set[str]:
        return {t.name for t in self.tensors}


class _Parser:
    def __init__(self, buf: mmap.mmap, path: Path) -> None:
        self.buf, self.path, self.offset = buf, path, 0

    def parse(self) -> tuple[dict[str, Any], list[GGUFTensor]]:
        if self.buf[:4] != _MAGIC:
            raise ValueError(f"{self.path}: not a GGUF file (magic {bytes(self.buf[:4])!r})")
        self.offset = 4
        version = self._u32()
        if version not in _VERSIONS:
            raise ValueError(f"{self.path}: GGUF version {version} (or a big-endian file); readable: {_VERSIONS}")
        num_tensors, num_keys = self._u64(), self._u64()
        metadata: dict[str, Any] = {}
        for _ in range(num_keys):
            key = self._string()
            if key in metadata:
                raise ValueError(f"{self.path}: metadata key {key!r} twice")
            metadata[key] = self._value(GGUFValueType(self._u32()))
        infos = [self._tensor_info() for _ in range(num_tensors)]
        alignment = metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"{self.path}: general.alignment {alignment!r}: must be a power of two")
        data_start = -(-self.offset // alignment) * alignment
        tensors, names = [], set()
        for name, dims, tensor_type, offset in infos:
            if name in names:
                raise ValueError(f"{self.path}: tensor {name!r} twice")
            names.add(name)
            tensors.append(self._tensor(name, dims, tensor_type, data_start + offset))
        return metadata, tensors

    def _u32(self) -> int:
        (value,) = _U32.unpack_from(self.buf, self.offset)
        self.offset += 4
        return int(value)

    def _u64(self) -> int:
        (value,) = _U64.unpack_from(self.buf, self.offset)
        self.offset += 8
        return int(value)

    def _string(self) -> str:
        return self._strings(1)[0]

    def _value(self, value_type: GGUFValueType) -> Any:
        if value_type == GGUFValueType.STRING:
            return self._string()
        if value_type == GGUFValueType.ARRAY:
            item_type, count = GGUFValueType(self._u32()), self._u64()
            if item_type == GGUFValueType.STRING:
                return self._strings(count)
            if item_type in _SCALARS:
                dtype = np.dtype(_SCALARS[item_type][1])
                values = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.offset)
                self.offset += count * dtype.itemsize
                return values.tolist()
            return [self._value(item_type) for _ in range(count)]  # arrays of arrays
        scalar = _SCALARS.get(value_type)
        if scalar is None:
            raise ValueError(f"{self.path}: unknown metadata value type {value_type}")
        (value,) = scalar[0].unpack_from(self.buf, self.offset)
        self.offset += scalar[0].size
        return value

    def _strings(self, count: int) -> list[str]:
        # the hot loop of a vocabulary: locals only
        buf, offset, unpack, size = self.buf, self.offset, _U64.unpack_from, len(self.buf)
        strings = []
        for _ in range(count):
            (length,) = unpack(buf, offset)
            offset += 8
            if offset + length > size:
                raise ValueError(f"{self.path}: a string runs past the end of the file")
            strings.append(str(buf[offset : offset + length], "utf-8"))
            offset += length
        self.offset = offset
        return strings

    def _tensor_info(self) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
        name = self._string()
        dims = tuple(self._u64() for _ in range(self._u32()))
        tensor_type = GGMLQuantizationType(self._u32())
        return name, dims, tensor_type, self._u64()

    def _tensor(self, name: str, dims: tuple[int, ...], tensor_type: GGMLQuantizationType, start: int) -> GGUFTensor:
        num_elements = int(np.prod(dims, dtype=np.int64))
        block_size, type_size = GGML_QUANT_SIZES[tensor_type]
        if num_elements % block_size:
            raise ValueError(f"{self.path}: tensor {name!r} of {num_elements} elements is not whole blocks of "
                             f"{block_size} ({tensor_type.name})")
        num_bytes = num_elements // block_size * type_size
        if start + num_bytes > len(self.buf):
            raise ValueError(f"{self.path}: tensor {name!r} runs past the end of the file")
        shape = tuple(reversed(dims))
        element_dtype = _ELEMENT_DTYPES.get(tensor_type)
        if element_dtype is not None:
            data = np.frombuffer(self.buf, dtype=element_dtype, count=num_elements, offset=start).reshape(shape)
        else:
            data = np.frombuffer(self.buf, dtype=np.uint8, count=num_bytes, offset=start)
            data = data.reshape(quant_shape_to_byte_shape(shape, tensor_type))
        return GGUFTensor(name, tensor_type, dims, data)

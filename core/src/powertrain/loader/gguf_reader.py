"""A direct reader for a GGUF file's header, metadata and tensor index.

gguf-py's ``GGUFReader`` builds a numpy view for every part of every value: for a tokenizer's
~100,000 strings that is ~250,000 memmap views and most of a model's start-up time. This reader
walks the same bytes with ``struct`` and slicing, reads numeric arrays with one ``np.frombuffer``
each, and returns plain Python values; tensor data stays in the memory-mapped file as numpy views
that ``gguf.quants.dequantize`` accepts.

Values are what ``GGUFReader``'s ``field.contents()`` returns (a test checks this against it),
except that nested arrays stay nested where gguf-py flattens them. The keys ``GGUF.version``,
``GGUF.tensor_count`` and ``GGUF.kv_count`` are included as gguf-py does.

Layout (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md): magic ``GGUF``, version
(uint32), tensor count and key/value count (uint64), the key/value pairs, one info record per
tensor (name, dimensions fastest first, ggml type, offset), padding to ``general.alignment``, data.
"""

from __future__ import annotations

import math
import mmap
import struct
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import attrs
import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# GGUF value types (gguf.GGUFValueType).
_UINT8, _INT8, _UINT16, _INT16, _UINT32, _INT32, _FLOAT32, _BOOL, _STRING, _ARRAY, _UINT64, _INT64, _FLOAT64 = range(13)
#: Scalar value type -> (struct letter, numpy dtype letter).
_SCALARS = {
    _UINT8: ("B", "u1"),
    _INT8: ("b", "i1"),
    _UINT16: ("H", "u2"),
    _INT16: ("h", "i2"),
    _UINT32: ("I", "u4"),
    _INT32: ("i", "i4"),
    _FLOAT32: ("f", "f4"),
    _BOOL: ("?", "?"),
    _UINT64: ("Q", "u8"),
    _INT64: ("q", "i8"),
    _FLOAT64: ("d", "f8"),
}
#: Tensor types whose data gguf-py exposes as typed arrays (every other type as raw bytes).
_PLAIN_TENSOR_DTYPES = {
    GGMLQuantizationType.F32: "f4",
    GGMLQuantizationType.F16: "f2",
    GGMLQuantizationType.F64: "f8",
    GGMLQuantizationType.I8: "i1",
    GGMLQuantizationType.I16: "i2",
    GGMLQuantizationType.I32: "i4",
    GGMLQuantizationType.I64: "i8",
}


class GGUFFormatError(ValueError):
    """The bytes are not a well-formed GGUF file; the message says where reading stopped and why."""


@attrs.frozen
class GGUFTensorInfo:
    """One entry of the tensor index; ``data`` is a read-only view into the memory-mapped file."""

    name: str
    tensor_type: GGMLQuantizationType
    #: GGUF order: fastest-varying dimension first (the reverse of numpy's).
    shape: tuple[int, ...]
    n_elements: int
    n_bytes: int
    #: Absolute offset of the data in the file.
    data_offset: int
    _buffer: Any = attrs.field(repr=False, eq=False)
    _byte_order: str = attrs.field(repr=False, eq=False)

    @property
    def data(self) -> np.ndarray:
        """The stored data, shaped as gguf-py's ``ReaderTensor.data`` (bytes for block-quantized types)."""
        numpy_shape = tuple(reversed(self.shape))
        if (letter := _PLAIN_TENSOR_DTYPES.get(self.tensor_type)) is not None:
            dtype = np.dtype(self._byte_order + letter)
            count = self.n_elements
        else:
            dtype, count = np.dtype(np.uint8), self.n_bytes
            block_size, type_size = GGML_QUANT_SIZES[self.tensor_type]
            numpy_shape = (*numpy_shape[:-1], numpy_shape[-1] // block_size * type_size)
        return np.frombuffer(self._buffer, dtype=dtype, count=count, offset=self.data_offset).reshape(numpy_shape)

    def release_pages(self) -> None:
        """Drop this tensor's pages from the process's resident memory once its data has been
        copied out: the file stays mapped (a later read faults them back in from the page
        cache), but a loaded model does not also count the file it came from."""
        if not isinstance(self._buffer, mmap.mmap) or not hasattr(mmap, "MADV_DONTNEED"):
            return
        start = self.data_offset - self.data_offset % mmap.PAGESIZE
        self._buffer.madvise(mmap.MADV_DONTNEED, start, self.data_offset + self.n_bytes - start)


@attrs.frozen
class GGUFFile:
    """What ``read_gguf`` found: metadata (key -> Python value), the tensor index, and layout facts."""

    version: int
    metadata: Mapping[str, Any]
    tensors: tuple[GGUFTensorInfo, ...]
    alignment: int
    #: Where tensor data begins (tensor offsets count from here).
    data_offset: int
    #: ``"<"`` for little-endian files, ``">"`` for big-endian ones.
    byte_order: str


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse ``path``'s header, metadata and tensor index; tensor data is mapped, not read.

    Raises ``GGUFFormatError`` for anything malformed: bad magic, an unsupported version, a value
    or tensor that runs past the end of the file, invalid UTF-8, an unknown type, a duplicate key.
    """
    with Path(path).open("rb") as file:
        size = file.seek(0, 2)
        if size < 24:
            raise GGUFFormatError(f"the file has {size} bytes, fewer than a GGUF header's 24")
        buffer = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    return _Parser(buffer, size).parse()


class _Parser:
    def __init__(self, buffer: mmap.mmap, size: int) -> None:
        self.buffer = buffer
        self.size = size
        self.pos = 0
        self.order = "<"

    def parse(self) -> GGUFFile:
        buffer = self.buffer
        if buffer[:4] != MAGIC:
            raise GGUFFormatError(f"no GGUF magic bytes (the file starts with {bytes(buffer[:4])!r})")
        (version,) = struct.unpack_from("<I", buffer, 4)
        if version & 0xFFFF == 0:  # written on a machine of the other byte order, as gguf-py detects it
            self.order = ">"
            (version,) = struct.unpack_from(">I", buffer, 4)
        if version not in SUPPORTED_VERSIONS:
            raise GGUFFormatError(
                f"GGUF version {version} is not supported (readable: {', '.join(map(str, SUPPORTED_VERSIONS))})"
            )
        tensor_count, kv_count = struct.unpack_from(self.order + "QQ", buffer, 8)
        self.pos = 24
        metadata: dict[str, Any] = {
            "GGUF.version": version,
            "GGUF.tensor_count": tensor_count,
            "GGUF.kv_count": kv_count,
        }
        for index in range(kv_count):
            start = self.pos
            key = self._string(f"the name of metadata key {index}")
            if key in metadata:
                raise GGUFFormatError(f"metadata key {key!r} appears twice (again at byte {start})")
            (value_type,) = self._unpack("I", f"the value type of metadata key {key!r}")
            if key == "general.alignment" and value_type != _UINT32:
                raise GGUFFormatError(f"general.alignment has value type {value_type}, not uint32")
            metadata[key] = self._value(value_type, key)

        alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if alignment <= 0 or alignment & (alignment - 1):
            raise GGUFFormatError(f"general.alignment is {alignment}, not a power of two")
        infos = [self._tensor_info(index) for index in range(tensor_count)]
        data_offset = -(-self.pos // alignment) * alignment

        tensors = []
        names: set[str] = set()
        for name, shape, tensor_type, offset in infos:
            if name in names:
                raise GGUFFormatError(f"tensor {name!r} appears twice in the tensor index")
            names.add(name)
            n_elements = math.prod(shape)
            block_size, type_size = GGML_QUANT_SIZES[tensor_type]
            if shape and shape[0] % block_size:
                raise GGUFFormatError(
                    f"tensor {name!r} has {shape[0]} values per row, not a multiple of {tensor_type.name}'s "
                    f"block of {block_size}"
                )
            n_bytes = n_elements * type_size // block_size
            start = data_offset + offset
            if start + n_bytes > self.size:
                raise GGUFFormatError(
                    f"tensor {name!r} ({n_bytes} bytes at byte {start}) ends past the end of the file "
                    f"({self.size} bytes)"
                )
            tensors.append(
                GGUFTensorInfo(name, tensor_type, shape, n_elements, n_bytes, start, self.buffer, self.order)
            )
        return GGUFFile(
            version=version,
            metadata=MappingProxyType(metadata),
            tensors=tuple(tensors),
            alignment=alignment,
            data_offset=data_offset,
            byte_order=self.order,
        )

    # -- primitives: each checks that its bytes are inside the file and advances ``pos`` ------------

    def _past_end(self, what: str, needed: int) -> GGUFFormatError:
        return GGUFFormatError(
            f"{what} needs {needed} bytes at byte {self.pos}, past the end of the file ({self.size} bytes)"
        )

    def _unpack(self, letters: str, what: str) -> tuple[Any, ...]:
        layout = struct.Struct(self.order + letters)
        if self.pos + layout.size > self.size:
            raise self._past_end(what, layout.size)
        values = layout.unpack_from(self.buffer, self.pos)
        self.pos += layout.size
        return values

    def _string(self, what: str) -> str:
        (length,) = self._unpack("Q", what)
        end = self.pos + length
        if end > self.size:
            raise self._past_end(what, length)
        text = _decode(self.buffer[self.pos : end], what)
        self.pos = end
        return text

    def _value(self, value_type: int, key: str) -> Any:
        if value_type == _STRING:
            return self._string(f"the value of {key!r}")
        if value_type in _SCALARS:
            return self._unpack(_SCALARS[value_type][0], f"the value of {key!r}")[0]
        if value_type == _ARRAY:
            return self._array(key)
        raise GGUFFormatError(f"metadata key {key!r} has unknown value type {value_type}")

    def _array(self, key: str) -> list[Any]:
        item_type, count = self._unpack("IQ", f"the array header of {key!r}")
        if item_type in _SCALARS:
            dtype = np.dtype(self.order + _SCALARS[item_type][1])
            if self.pos + count * dtype.itemsize > self.size:
                raise self._past_end(f"the {count} values of {key!r}", count * dtype.itemsize)
            values = np.frombuffer(self.buffer, dtype=dtype, count=count, offset=self.pos).tolist()
            self.pos += count * dtype.itemsize
            return values
        if item_type == _STRING:
            return self._strings(count, key)
        if item_type == _ARRAY:
            return [self._array(key) for _ in range(count)]
        raise GGUFFormatError(f"metadata key {key!r} is an array of unknown value type {item_type}")

    def _strings(self, count: int, key: str) -> list[str]:
        """``count`` length-prefixed strings: the tokenizer's vocabulary and merges, so kept tight."""
        buffer, size, pos = self.buffer, self.size, self.pos
        length_at = struct.Struct(self.order + "Q").unpack_from
        strings: list[str] = []
        append = strings.append
        try:
            for _ in range(count):
                if pos + 8 > size:
                    break
                (length,) = length_at(buffer, pos)
                pos += 8
                end = pos + length
                if end > size:
                    break
                append(str(buffer[pos:end], "utf-8"))
                pos = end
        except UnicodeDecodeError as error:
            self.pos = pos
            raise GGUFFormatError(f"string {len(strings)} of {key!r} at byte {pos} is not UTF-8 ({error})") from None
        self.pos = pos
        if len(strings) < count:
            raise self._past_end(f"string {len(strings)} of {count} in {key!r}", 8 if pos + 8 > size else length)
        return strings

    def _tensor_info(self, index: int) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
        name = self._string(f"the name of tensor {index}")
        (n_dims,) = self._unpack("I", f"the dimension count of tensor {name!r}")
        if self.pos + 8 * n_dims > self.size:
            raise self._past_end(f"the {n_dims} dimensions of tensor {name!r}", 8 * n_dims)
        shape = self._unpack("Q" * n_dims, f"the dimensions of tensor {name!r}")
        raw_type, offset = self._unpack("IQ", f"the type and offset of tensor {name!r}")
        try:
            tensor_type = GGMLQuantizationType(raw_type)
        except ValueError:
            raise GGUFFormatError(f"tensor {name!r} has unknown ggml type {raw_type}") from None
        return name, tuple(shape), tensor_type, offset


def _decode(raw: bytes, what: str) -> str:
    try:
        return str(raw, "utf-8")
    except UnicodeDecodeError as error:
        raise GGUFFormatError(f"{what} is not UTF-8 ({error})") from None

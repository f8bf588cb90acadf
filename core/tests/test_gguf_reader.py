"""powertrain's direct GGUF reader against gguf-py's GGUFReader (the oracle) and GGUFWriter's input."""

from __future__ import annotations

import string
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from powertrain.loader import resolve_model_path
from powertrain.loader.gguf_reader import GGUFFile, GGUFFormatError, read_gguf

V = gguf.GGUFValueType
Q = gguf.GGMLQuantizationType

_ALPHABET = string.ascii_letters + string.digits + " .,<>|_\n\t" + "éßøΩжд中文字😀🚀\u0120\u010a"


def oracle(path: Path) -> tuple[dict[str, Any], list[tuple[Any, ...]]]:
    """gguf-py's reading of ``path``: metadata as ``field.contents()``, and the tensor index with data."""
    reader = gguf.GGUFReader(path)
    metadata = {key: field.contents() for key, field in reader.fields.items()}
    index = [
        (t.name, t.tensor_type, tuple(int(d) for d in t.shape), t.n_elements, t.n_bytes, t.data_offset, t.data)
        for t in reader.tensors
    ]
    return metadata, index


def flatten(value: Any) -> Any:
    """gguf-py flattens arrays of arrays into one list of their items; we keep them nested."""
    if isinstance(value, list) and value and isinstance(value[0], list):
        return [item for inner in value for item in flatten(inner)]
    return value


def assert_same_as_oracle(path: Path) -> GGUFFile:
    read = read_gguf(path)
    metadata, index = oracle(path)
    assert list(read.metadata) == list(metadata)
    for key, value in read.metadata.items():
        assert flatten(value) == metadata[key], key
        assert type(flatten(value)) is type(metadata[key]), key
    assert len(read.tensors) == len(index)
    for tensor, (name, kind, shape, n_elements, n_bytes, offset, data) in zip(read.tensors, index, strict=True):
        assert (tensor.name, tensor.tensor_type, tensor.shape) == (name, kind, shape)
        assert (tensor.n_elements, tensor.n_bytes, tensor.data_offset) == (n_elements, n_bytes, offset)
        assert tensor.data.dtype == data.dtype and tensor.data.shape == data.shape, name
        assert np.array_equal(tensor.data, data, equal_nan=True), name
        assert not tensor.data.flags.writeable
    return read


def test_embedded_file_reads_as_gguf_py_reads_it() -> None:
    path = resolve_model_path("smollm2-135m").path
    read = assert_same_as_oracle(path)
    assert len(read.metadata["tokenizer.ggml.tokens"]) == 49152
    assert read.tensors[0].tensor_type in (Q.Q4_1, Q.Q8_0, Q.F32, Q.Q6_K, Q.Q4_K, Q.F16)


# -- random files written by GGUFWriter ----------------------------------------------------------------------------

_INT_RANGES = {
    V.UINT8: (0, 2**8),
    V.INT8: (-(2**7), 2**7),
    V.UINT16: (0, 2**16),
    V.INT16: (-(2**15), 2**15),
    V.UINT32: (0, 2**32),
    V.INT32: (-(2**31), 2**31),
    V.UINT64: (0, 2**64),
    V.INT64: (-(2**63), 2**63),
}


def random_string(rng: np.random.Generator) -> str:
    return "".join(rng.choice(list(_ALPHABET), size=int(rng.integers(0, 12))))


def random_scalar(rng: np.random.Generator, kind: V) -> Any:
    if kind in _INT_RANGES:
        low, high = _INT_RANGES[kind]
        return int(rng.integers(low, high, dtype=np.uint64 if low == 0 and high == 2**64 else np.int64))
    if kind == V.FLOAT32:
        return float(np.float32(rng.standard_normal() * 10.0 ** rng.integers(-8, 8)))
    if kind == V.FLOAT64:
        return float(rng.standard_normal() * 10.0 ** rng.integers(-200, 200))
    if kind == V.BOOL:
        return bool(rng.integers(2))
    assert kind == V.STRING
    return random_string(rng)


_SCALAR_KINDS = [*_INT_RANGES, V.FLOAT32, V.FLOAT64, V.BOOL, V.STRING]


def random_metadata(rng: np.random.Generator) -> dict[str, tuple[Any, V, V | None]]:
    """key -> (value, type, array item type): every scalar type, arrays of each, and nested arrays."""
    entries: dict[str, tuple[Any, V, V | None]] = {}
    for index in range(60):
        key = f"test.{index}.{random_string(rng)}"
        kind = _SCALAR_KINDS[index % len(_SCALAR_KINDS)]
        shape = index // len(_SCALAR_KINDS) % 4
        if shape == 0:
            entries[key] = (random_scalar(rng, kind), kind, None)
        elif shape in (1, 2):
            items = [random_scalar(rng, kind) for _ in range(int(rng.integers(1, 40)))]
            entries[key] = (items, V.ARRAY, kind)
        else:  # arrays of arrays: GGUFWriter infers the inner type (int32, float32, bool or string)
            inner = {V.STRING: V.STRING, V.BOOL: V.BOOL, V.FLOAT32: V.FLOAT32, V.FLOAT64: V.FLOAT32}.get(kind, V.INT32)
            items = [
                [random_scalar(rng, inner) for _ in range(int(rng.integers(1, 6)))]
                for _ in range(int(rng.integers(1, 5)))
            ]
            entries[key] = (items, V.ARRAY, V.ARRAY)
    return entries


def write_random_gguf(
    path: Path, rng: np.random.Generator, *, endianess: gguf.GGUFEndian = gguf.GGUFEndian.LITTLE
) -> dict[str, Any]:
    entries = random_metadata(rng)
    writer = gguf.GGUFWriter(str(path), arch="llama", endianess=endianess)
    writer.add_custom_alignment(int(rng.choice([8, 32, 64])))
    for key, (value, kind, item_kind) in entries.items():
        writer.add_key_value(key, value, kind, sub_type=item_kind)
    shapes = [(4, 32), (3, 64), (7,), (2, 3, 32)]
    for index, shape in enumerate(shapes):
        data = rng.standard_normal(shape).astype(np.float32)
        writer.add_tensor(f"plain.{index}", data)
        writer.add_tensor(f"half.{index}", data.astype(np.float16))
        if shape[-1] % 32 == 0:
            for kind in (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.BF16):
                quantized = gguf.quants.quantize(data, kind)
                writer.add_tensor(f"{kind.name}.{index}", quantized, raw_dtype=kind)
    writer.add_tensor("ints", rng.integers(-100, 100, (5, 3)).astype(np.int32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {key: value for key, (value, _, _) in entries.items()}


@pytest.mark.parametrize("seed", range(4))
def test_random_gguf_reads_as_written_and_as_gguf_py_reads_it(tmp_path: Path, seed: int) -> None:
    rng = np.random.default_rng(seed)
    path = tmp_path / "random.gguf"
    written = write_random_gguf(path, rng)
    read = assert_same_as_oracle(path)
    for key, value in written.items():
        assert read.metadata[key] == value, key  # nested arrays stay nested
    assert read.byte_order == "<" and read.data_offset % read.alignment == 0


def test_big_endian_gguf(tmp_path: Path) -> None:
    path = tmp_path / "big.gguf"
    written = write_random_gguf(path, np.random.default_rng(7), endianess=gguf.GGUFEndian.BIG)
    read = assert_same_as_oracle(path)
    assert read.byte_order == ">"
    for key, value in written.items():
        assert read.metadata[key] == value, key


# -- damaged files ---------------------------------------------------------------------------------------------------


def test_every_truncation_of_a_small_file_is_a_format_error(tmp_path: Path) -> None:
    source = tmp_path / "whole.gguf"
    write_random_gguf(source, np.random.default_rng(11))
    data = source.read_bytes()
    whole = read_gguf(source)
    end_of_data = max(tensor.data_offset + tensor.n_bytes for tensor in whole.tensors)
    cut = tmp_path / "cut.gguf"
    for size in [*range(0, whole.data_offset + 1, 3), end_of_data - 1]:
        cut.write_bytes(data[:size])
        with pytest.raises(GGUFFormatError):
            read_gguf(cut)


def test_string_array_truncated_says_which_string(tmp_path: Path) -> None:
    path = tmp_path / "strings.gguf"
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_array("tokenizer.ggml.tokens", [f"token{i}" for i in range(1000)])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(GGUFFormatError, match=r"string \d+ of 1000 in 'tokenizer.ggml.tokens'.*past the end"):
        read_gguf(path)


def test_invalid_utf8_names_the_key(tmp_path: Path) -> None:
    path = tmp_path / "utf8.gguf"
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_array("tokenizer.ggml.tokens", ["fine", "bad"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    data = path.read_bytes()
    path.write_bytes(data.replace(b"bad", b"\xff\xfe\xfd"))
    with pytest.raises(GGUFFormatError, match=r"string 1 of 'tokenizer.ggml.tokens'.*not UTF-8"):
        read_gguf(path)


def test_not_gguf_and_unsupported_version(tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(b"GGML" + bytes(60))
    with pytest.raises(GGUFFormatError, match="no GGUF magic"):
        read_gguf(path)
    path.write_bytes(b"GGUF" + (1).to_bytes(4, "little") + bytes(60))
    with pytest.raises(GGUFFormatError, match="version 1 is not supported"):
        read_gguf(path)

"""Memory-mapped row gathers (Engram tables): exact rows, nothing read at load, clear errors.

Dequantization is exact before the final cast: an e4m3 value has a 4-bit significand and an
e8m0 scale is a power of two, so their product is representable in float32 (and float64), and
the bfloat16 cast rounds the same number either way.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from powertrain.loader.errors import CorruptCheckpointError
from powertrain.loader.mapped_rows import GROUP, MappedFp8Rows, MappedTensor
from powertrain.testing.checkpoints import quantize_fp8_ue8m0

PREFIX = "layers.3.engram.embed"
WEIGHT, SCALE = f"{PREFIX}.weight", f"{PREFIX}.scale"


def _table(generator: torch.Generator, rows: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An FP8 table quantized per 32 columns of a row, rows spread over many magnitudes."""
    magnitude = torch.exp2(torch.randint(-20, 10, (rows, 1), generator=generator).float())
    return quantize_fp8_ue8m0(torch.randn(rows, head_dim, generator=generator) * magnitude, (1, GROUP))


def _dequantize(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float64 reference: each value times its group's scale."""
    return (weight.double().unflatten(-1, (-1, GROUP)) * scale.double().unsqueeze(-1)).flatten(-2)


def _write_shards(tmp_path: Path, generator: torch.Generator, weight: torch.Tensor, scale: torch.Tensor) -> dict:
    """Weight and scale in two shards, each among unrelated tensors sorted before and after it."""
    files = {WEIGHT: tmp_path / "model-00001.safetensors", SCALE: tmp_path / "model-00002.safetensors"}
    for name, tensor in ((WEIGHT, weight), (SCALE, scale)):
        others = {
            "a.before": torch.randn(5, 7, generator=generator),
            "b.before": torch.randint(0, 9, (3,), dtype=torch.uint8, generator=generator),
            "z.after": torch.randint(0, 9, (11,), dtype=torch.uint8, generator=generator),
        }
        save_file({name: tensor, **others}, files[name])
    return files


def test_fp8_rows_match_the_full_dequantization(tmp_path: Path, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    rows, head_dim = 97, 128
    files = _write_shards(tmp_path, generator, *_table(generator, rows, head_dim))
    reference = _dequantize(load_file(files[WEIGHT])[WEIGHT], load_file(files[SCALE])[SCALE])

    table = MappedFp8Rows(files, PREFIX)
    ids = torch.randint(0, rows, (3, 5), generator=generator)
    ids[0, :3] = torch.tensor([0, rows - 1, 0])  # both ends, and a repeat
    ids[2, 4] = ids[1, 1]
    got = table.rows(ids)
    assert got.dtype == torch.bfloat16 and got.shape == (3, 5, head_dim)
    assert torch.equal(got.view(torch.int16), reference[ids].to(torch.bfloat16).view(torch.int16))
    assert torch.equal(table.rows(ids, torch.float32), reference[ids].float())


@pytest.mark.parametrize(
    "dtype",
    [torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.bfloat16, torch.float16, torch.float32, torch.int8, torch.uint8],
    ids=str,
)
def test_rows_are_the_stored_bytes(tmp_path: Path, seed: int, dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(seed)
    stored = torch.randint(0, 256, (11, 3, 4 * dtype.itemsize), dtype=torch.uint8, generator=generator)
    path = tmp_path / "table.safetensors"
    save_file({"a.before": torch.zeros(2), "t": stored.view(dtype), "z.after": torch.ones(3, dtype=torch.uint8)}, path)

    tensor = MappedTensor(path, "t")
    assert tensor.shape == (11, 3, 4) and tensor.dtype == dtype
    ids = torch.randint(0, 11, (2, 6), generator=generator)
    got = tensor.rows(ids)
    assert got.dtype == dtype and got.shape == (2, 6, 3, 4)
    assert torch.equal(got.view(torch.uint8), stored[ids])
    assert torch.equal(tensor.rows(torch.tensor(4)).view(torch.uint8), stored[4])


def _rss_kib() -> dict[str, int]:
    fields = (line.split() for line in Path("/proc/self/status").read_text().splitlines())
    return {field[0].rstrip(":"): int(field[1]) for field in fields if field[0] in ("VmRSS:", "RssAnon:", "RssFile:")}


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the process RSS from Linux's /proc")
def test_tables_are_mapped_not_read(tmp_path: Path, seed: int) -> None:
    """A 256 MiB table: mapping it touches none of it; a gather copies only its rows.

    Mapping adds nothing to VmRSS. After the gather, mapped file pages are counted in RssFile
    by the kernel's policy (fault-around, large page-cache folios: a hot cache may map whole
    megabytes per fault), so the check is on RssAnon, the memory the process itself holds.
    """
    generator = torch.Generator().manual_seed(seed)
    rows, head_dim, chunk = 256 * 1024, 1024, 1024
    table_kib = rows * head_dim // 1024
    # The file repeats one chunk of rows, so the test never holds the table (row r is chunk row r % chunk).
    codes = torch.randint(0, 0x7F, (chunk, head_dim), dtype=torch.uint8, generator=generator)  # no NaN codes
    codes |= torch.randint(0, 2, codes.shape, dtype=torch.uint8, generator=generator) << 7
    exponents = torch.randint(100, 140, (chunk, head_dim // GROUP), dtype=torch.uint8, generator=generator)
    end = rows * head_dim
    header = {
        "__metadata__": {"format": "pt"},
        WEIGHT: {"dtype": "F8_E4M3", "shape": [rows, head_dim], "data_offsets": [0, end]},
        SCALE: {"dtype": "F8_E8M0", "shape": [rows, head_dim // GROUP], "data_offsets": [end, end + end // GROUP]},
    }
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path = tmp_path / "engram.safetensors"
    with open(path, "wb") as file:
        file.write(len(raw).to_bytes(8, "little") + raw)
        for part in (codes, exponents):
            block = part.numpy().tobytes()
            for _ in range(rows // chunk):
                file.write(block)
        file.flush()
        os.fsync(file.fileno())
        os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)  # cold, as a checkpoint on disk

    before = _rss_kib()
    table = MappedFp8Rows({WEIGHT: path, SCALE: path}, PREFIX)
    mapped = _rss_kib()
    ids = torch.randint(0, rows, (1000,), generator=generator)
    got = table.rows(ids)
    gathered = _rss_kib()
    print(f"table {table_kib} KiB; RSS KiB before {before}, mapped {mapped}, after 1000 rows {gathered}")

    assert mapped["VmRSS"] - before["VmRSS"] < table_kib // 10
    assert gathered["RssAnon"] - before["RssAnon"] < table_kib // 10
    expected = _dequantize(
        codes.view(torch.float8_e4m3fn)[ids % chunk], exponents.view(torch.float8_e8m0fnu)[ids % chunk]
    )
    assert torch.equal(got.view(torch.int16), expected.to(torch.bfloat16).view(torch.int16))
    del table
    path.unlink()


def test_errors_name_the_tensor_and_the_file(tmp_path: Path, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    rows, head_dim = 97, 64
    weight, scale = _table(generator, rows, head_dim)
    files = _write_shards(tmp_path, generator, weight, scale)

    with pytest.raises(KeyError, match=r"model-00001\.safetensors has no tensor 'nope'; it has 4: a\.before"):
        MappedTensor(files[WEIGHT], "nope")
    with pytest.raises(KeyError, match=rf"index has no '{SCALE}'"):
        MappedFp8Rows({WEIGHT: files[WEIGHT]}, PREFIX)

    table = MappedFp8Rows(files, PREFIX)
    for bad in ([0, rows], [-1, 3]):
        with pytest.raises(IndexError, match=rf"model-00001\.safetensors: tensor '{WEIGHT}' has rows \[0, 97\)"):
            table.rows(torch.tensor(bad))

    wrong = {**files, SCALE: tmp_path / "wrong.safetensors"}
    save_file({SCALE: scale.repeat_interleave(2, dim=1)}, wrong[SCALE])
    with pytest.raises(
        CorruptCheckpointError, match=rf"{PREFIX}: a weight \[97, 64\] .* needs a scale of shape \[97, 2\]"
    ):
        MappedFp8Rows(wrong, PREFIX)

    data = files[WEIGHT].read_bytes()
    length = int.from_bytes(data[:8], "little")
    weight_end = 8 + length + json.loads(data[8 : 8 + length])[WEIGHT]["data_offsets"][1]
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(data[: weight_end - 1])  # cut off the weight's last byte
    with pytest.raises(CorruptCheckpointError, match=rf"truncated\.safetensors: tensor '{WEIGHT}' ends at byte"):
        MappedTensor(truncated, WEIGHT)
    truncated.write_bytes(data[:20])
    with pytest.raises(CorruptCheckpointError, match=r"truncated\.safetensors: truncated safetensors file \(20 bytes"):
        MappedTensor(truncated, WEIGHT)

"""Row gathers from tables that stay in the checkpoint file.

DeepSeek-V4.1's Engram layers keep n-gram tables of ~196B parameters in the safetensors
files: ``layers.N.engram.embed.weight`` (float8_e4m3fn ``[rows, head_dim]``) and its
``.scale`` (float8_e8m0fnu ``[rows, head_dim // 32]``, one power-of-two factor per 32
columns of a row). A step needs only the few rows its hashed token ids select, so the tables
are never read into RAM nor put on an accelerator: ``MappedTensor`` memory-maps one tensor
(only the header is read) and copies just the rows asked for; ``MappedFp8Rows`` dequantizes
them as DeepSeek does. The map is advised ``MADV_RANDOM``: a row fault then reads its page
from disk, not the ~128 KiB of readahead around it.
"""

from __future__ import annotations

import json
import math
import mmap
import os
from collections.abc import Mapping

import numpy as np
import torch

from powertrain.loader.errors import CorruptCheckpointError, UnsupportedCheckpointError

#: Safetensors dtype names -> torch dtypes.
DTYPES: dict[str, torch.dtype] = {
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I8": torch.int8,
    "U8": torch.uint8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
}
#: Columns that share one scale.
GROUP = 32


class MappedTensor:
    """One tensor of a safetensors file, memory-mapped read-only; ``rows`` copies rows out."""

    def __init__(self, path: str | os.PathLike[str], name: str) -> None:
        self.path, self.name = os.fspath(path), name
        where = f"{self.path}: tensor {name!r}"
        with open(self.path, "rb") as file:
            size = os.fstat(file.fileno()).st_size
            length = int.from_bytes(file.read(8), "little") if size >= 8 else None
            if length is None or 8 + length > size:
                raise CorruptCheckpointError(
                    f"{self.path}: truncated safetensors file ({size} bytes, too short for its header). "
                    "Download the checkpoint again."
                )
            try:
                header = json.loads(file.read(length))
            except ValueError as error:
                raise CorruptCheckpointError(f"{self.path}: unreadable safetensors header: {error}") from error
        if name not in header or name == "__metadata__":
            names = sorted(key for key in header if key != "__metadata__")
            raise KeyError(f"{self.path} has no tensor {name!r}; it has {len(names)}: {', '.join(names[:5])}")
        entry = header[name]
        if entry.get("dtype") not in DTYPES:
            raise UnsupportedCheckpointError(
                f"{where} has dtype {entry.get('dtype')!r}; supported: {', '.join(DTYPES)}"
            )
        self._dtype = DTYPES[entry["dtype"]]
        self._shape = tuple(int(dim) for dim in entry["shape"])
        if not self._shape:
            raise ValueError(f"{where} is a scalar: it has no rows")
        begin, end = (int(offset) for offset in entry["data_offsets"])
        row_bytes = math.prod(self._shape[1:]) * self._dtype.itemsize
        if end - begin != self._shape[0] * row_bytes:
            raise CorruptCheckpointError(
                f"{where}: {entry['dtype']} {list(self._shape)} needs {self._shape[0] * row_bytes} bytes, "
                f"data_offsets {[begin, end]} hold {end - begin}"
            )
        start = 8 + length + begin
        if start + end - begin > size:
            raise CorruptCheckpointError(
                f"{where} ends at byte {8 + length + end} but the file has {size} bytes: truncated. "
                "Download the checkpoint again."
            )
        self._array = self._map(start, end - begin).reshape(self._shape[0], row_bytes)

    def _map(self, start: int, nbytes: int) -> np.ndarray:
        if nbytes == 0:
            return np.empty(0, dtype=np.uint8)
        aligned = start - start % mmap.ALLOCATIONGRANULARITY
        with open(self.path, "rb") as file:
            buffer = mmap.mmap(file.fileno(), start + nbytes - aligned, access=mmap.ACCESS_READ, offset=aligned)
        if hasattr(mmap, "MADV_RANDOM"):
            buffer.madvise(mmap.MADV_RANDOM)
        return np.frombuffer(buffer, dtype=np.uint8, count=nbytes, offset=start - aligned)

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (integers, any shape) as ``[*ids.shape, *shape[1:]]`` in the stored dtype."""
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise TypeError(f"{self.path}: row ids of {self.name!r} must be integers, got {ids.dtype}")
        index = ids.detach().to("cpu", torch.int64).numpy()
        if index.size and (index.min() < 0 or index.max() >= self._shape[0]):
            raise IndexError(
                f"{self.path}: tensor {self.name!r} has rows [0, {self._shape[0]}), "
                f"got ids from {index.min()} to {index.max()}"
            )
        data = torch.from_numpy(np.take(self._array, index, axis=0))  # a copy of just these rows
        return data.view(self._dtype).reshape(*ids.shape, *self._shape[1:])


class MappedFp8Rows:
    """An FP8 table ``<prefix>.weight`` with its per-32-column e8m0 ``<prefix>.scale``,
    mapped from the files ``files`` names them in (a checkpoint index's name -> path)."""

    def __init__(self, files: Mapping[str, str | os.PathLike[str]], prefix: str) -> None:
        names = (f"{prefix}.weight", f"{prefix}.scale")
        for name in names:
            if name not in files:
                raise KeyError(f"the checkpoint index has no {name!r}; it names {', '.join(sorted(files)[:5])}")
        self.weight, self.scale = (MappedTensor(files[name], name) for name in names)
        weight, scale = self.weight, self.scale
        if weight.dtype != torch.float8_e4m3fn or scale.dtype not in (torch.float8_e8m0fnu, torch.uint8):
            raise UnsupportedCheckpointError(
                f"{prefix}: expected a float8_e4m3fn weight and float8_e8m0fnu scale, got {weight.dtype} and "
                f"{scale.dtype}"
            )
        want = (weight.shape[0], weight.shape[-1] // GROUP)
        if len(weight.shape) != 2 or weight.shape[1] % GROUP or scale.shape != want:
            raise CorruptCheckpointError(
                f"{prefix}: a weight {list(weight.shape)} ({weight.path}) needs a scale of shape {list(want)} "
                f"(one per {GROUP} columns of a row), got {list(scale.shape)} ({scale.path})"
            )

    @property
    def shape(self) -> tuple[int, ...]:
        return self.weight.shape

    def rows(self, ids: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """Rows ``ids`` dequantized to ``[*ids.shape, head_dim]``: the float32 product, cast to ``dtype``."""
        values = self.weight.rows(ids).float().unflatten(-1, (-1, GROUP))
        scales = self.scale.rows(ids).view(torch.float8_e8m0fnu).float().unsqueeze(-1)
        return (values * scales).flatten(-2).to(dtype)

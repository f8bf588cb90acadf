"""The loaded checkpoint: what a model needs to be built, whatever the file format."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

import attrs
import structlog
import torch

from powertrain.loader.progress import with_progress
from powertrain.tokenizer import Tokenizer

log = structlog.get_logger(__name__)


def _read_only(mapping: Mapping[str, Any]) -> Mapping[str, Any]:
    return MappingProxyType(dict(mapping))


@attrs.frozen(kw_only=True)
class Checkpoint:
    """Config, tokenizer and (lazily) tensors of one checkpoint, in HF transformers' terms.

    ``config`` has config.json semantics and ``tensors()`` yields HF tensor names, so model code
    needs no branch per file format.
    """

    #: The .gguf file or the checkpoint folder.
    path: Path
    format: Literal["gguf", "safetensors"]
    #: HF config.json keys (for GGUF, rebuilt from the file's metadata).
    config: Mapping[str, Any] = attrs.field(converter=_read_only)
    #: HF names of the tensors ``tensors()`` yields, in that order.
    tensor_names: tuple[str, ...] = attrs.field(repr=False)
    tokenizer: Tokenizer
    #: generation_config.json, or {} when the checkpoint has none.
    generation_config: Mapping[str, Any] = attrs.field(converter=_read_only, factory=dict)
    _read_tensors: Callable[[], Iterator[tuple[str, torch.Tensor]]] = attrs.field(
        alias="read_tensors", repr=False, eq=False
    )

    @property
    def num_tensors(self) -> int:
        return len(self.tensor_names)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(HF name, tensor)`` one at a time, read on demand, with a progress bar on a terminal.

        GGUF tensors are dequantized to float32; safetensors keep their stored dtype. Each call
        reads the checkpoint again, so a caller keeps only what it copies into its model.
        """
        started = time.perf_counter()
        count = 0
        for item in with_progress(
            self._read_tensors(), total=self.num_tensors, description=f"Loading {self.path.name}"
        ):
            count += 1
            yield item
        log.info(
            "checkpoint.loaded",
            path=str(self.path),
            format=self.format,
            tensors=count,
            seconds=round(time.perf_counter() - started, 2),
        )

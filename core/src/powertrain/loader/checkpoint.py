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

from powertrain.interfaces import QuantizedWeight
from powertrain.loader.fp4 import dequantize_fp4_stream
from powertrain.loader.fp8 import dequantize_stream
from powertrain.loader.progress import with_progress
from powertrain.tokenizer import Tokenizer

log = structlog.get_logger(__name__)


def _everything(name: str) -> bool:
    return True


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
    #: HF names of the tensors ``tensors()`` yields, in that order (FP8 and FP4 scales folded into their weights).
    tensor_names: tuple[str, ...] = attrs.field(repr=False)
    tokenizer: Tokenizer
    #: generation_config.json, or {} when the checkpoint has none (a GGUF file's
    #: ``general.sampling.*`` keys in its names; an embedded model's recommended settings).
    generation_config: Mapping[str, Any] = attrs.field(converter=_read_only, factory=dict)
    #: Where ``generation_config`` came from (a file, GGUF metadata, a model card), or "".
    generation_source: str = ""
    #: ``read_tensors(wanted)``: the stored tensors whose HF names ``wanted`` accepts.
    _read_tensors: Callable[[Callable[[str], bool]], Iterator[tuple[str, torch.Tensor]]] = attrs.field(
        alias="read_tensors", repr=False, eq=False
    )
    #: ``(rows, cols)`` of the FP8 weight blocks (DeepSeek-V3's quantization_config), or None when the
    #: stored weights are not FP8. ``_read_tensors`` then yields each FP8 weight and its scale together.
    fp8_block: tuple[int, int] | None = None
    #: Routed experts stored as packed FP4 with ue8m0 scales (config.json's ``expert_dtype: fp4``,
    #: DeepSeek-V4). ``_read_tensors`` then yields each such weight and its ``.scale`` together.
    fp4_experts: bool = False
    #: ``QuantizedWeight`` formats of the tensors that could stay quantised (GGUF's block types):
    #: ``_read_tensors(wanted, keep_quantized)`` yields those ``keep_quantized`` accepts as stored.
    quantized_formats: frozenset[str] = frozenset()
    #: Stored tensor name -> the safetensors file holding it (empty for GGUF): what a model
    #: maps instead of reading (``ModelContext.tensor_files``).
    tensor_files: Mapping[str, Path] = attrs.field(converter=_read_only, factory=dict, repr=False)

    @property
    def num_tensors(self) -> int:
        return len(self.tensor_names)

    def tensors(
        self,
        *,
        fp8_dtype: torch.dtype = torch.float32,
        keep_fp8: Callable[[str], bool] | None = None,
        keep_fp4: Callable[[str], bool] | None = None,
        wanted: Callable[[str], bool] | None = None,
        keep_quantized: Callable[[str], bool] | None = None,
    ) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
        """Yield ``(HF name, tensor)`` one at a time, read on demand, with a progress bar on a terminal.

        GGUF tensors are dequantized to float32; safetensors keep their stored dtype, except FP8
        block-scaled weights (``fp8_block`` is set): those are dequantized to ``fp8_dtype`` and their
        ``*_scale_inv`` tensors dropped, unless ``keep_fp8(name)`` asks for the stored FP8 weight
        and its scale (for kernels that multiply FP8 directly); and FP4 experts (``fp4_experts``):
        those are dequantized to ``fp8_dtype`` too, under their weight names, their ``.scale``
        tensors dropped, unless ``keep_fp4(name)`` asks for the packed weight and its scale;
        and GGUF's block-quantised tensors (``quantized_formats``): ``keep_quantized(name)``
        asks for them as stored, a ``QuantizedWeight`` each.
        Tensors ``wanted(name)`` refuses are not read at all (another
        expert-parallel rank's experts). Each call reads the checkpoint again, so a caller keeps
        only what it copies into its model.
        """
        wanted = wanted or _everything
        if keep_quantized is not None and self.quantized_formats:
            stream = self._read_tensors(wanted, keep_quantized)
        else:
            stream = self._read_tensors(wanted)
        if self.fp4_experts:
            stream = dequantize_fp4_stream(stream, fp8_dtype, keep=keep_fp4)
        if self.fp8_block is not None:
            stream = dequantize_stream(stream, self.fp8_block, fp8_dtype, keep=keep_fp8 or (lambda name: False))
        started = time.perf_counter()
        count = 0
        for item in with_progress(stream, total=self.num_tensors, description=f"Loading {self.path.name}"):
            count += 1
            yield item
        log.info(
            "checkpoint.loaded",
            path=str(self.path),
            format=self.format,
            fp8_block=self.fp8_block,
            fp4_experts=self.fp4_experts,
            tensors=count,
            seconds=round(time.perf_counter() - started, 2),
        )

"""FP8 block-scaled weights, as DeepSeek-V3 checkpoints store them.

A weight ``[..., rows, cols]`` is float8_e4m3fn, and ``weight_scale_inv``
``[..., ceil(rows / br), ceil(cols / bc)]`` holds one float32 factor per
``br x bc`` block (the last blocks may be partial): the real weight is
``fp8 * scale_inv`` blockwise. Leading dimensions (stacked experts) are carried along.

``fp8_block_from_config`` reads the block shape from config.json; ``dequantize_stream`` turns
a checkpoint's tensor stream into plain weights (``Checkpoint.tensors()`` uses it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from powertrain.loader.errors import CorruptCheckpointError, UnsupportedCheckpointError

FP8_DTYPE = torch.float8_e4m3fn
#: Largest finite e4m3fn value: a block's absolute maximum is scaled onto it.
FP8_MAX = torch.finfo(FP8_DTYPE).max


def expand_blocks(scale: torch.Tensor, rows: int, cols: int, block: tuple[int, int]) -> torch.Tensor:
    """Per-block factors repeated over each block's elements, cut to ``rows x cols``."""
    br, bc = block
    return scale.repeat_interleave(br, dim=-2)[..., :rows, :].repeat_interleave(bc, dim=-1)[..., :cols]


def _check(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> None:
    rows, cols = weight.shape[-2:]
    want = (*weight.shape[:-2], -(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale.shape) != want:
        raise ValueError(
            f"an FP8 weight of shape {tuple(weight.shape)} with {block[0]}x{block[1]} blocks needs "
            f"weight_scale_inv of shape {want}, got {tuple(scale.shape)}"
        )


def dequantize_blocks(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``weight * scale_inv`` blockwise, in ``dtype`` (computed in float32)."""
    _check(weight, scale_inv, block)
    rows, cols = weight.shape[-2:]
    return (weight.float() * expand_blocks(scale_inv.float(), rows, cols, block)).to(dtype)


def quantize_blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse, as DeepSeek's quantizer does it: each block's absolute maximum maps
    onto ``FP8_MAX``. Returns ``(fp8 weight, float32 scale_inv)``."""
    rows, cols = weight.shape[-2:]
    br, bc = block
    padded = torch.nn.functional.pad(weight.float(), (0, -cols % bc, 0, -rows % br))
    tiles = padded.unflatten(-1, (-1, bc)).unflatten(-3, (-1, br))  # [..., R, br, C, bc]
    amax = tiles.abs().amax(dim=(-3, -1)).clamp(min=1e-12)  # [..., R, C]
    scale_inv = amax / FP8_MAX
    scaled = weight.float() / expand_blocks(scale_inv, rows, cols, block)
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale_inv


#: ``X`` and ``X + SCALE_SUFFIX`` are an FP8 tensor and its block factors (``X.weight_scale_inv``).
SCALE_SUFFIX = "_scale_inv"


def fp8_block_from_config(config: Mapping[str, Any], *, source: str = "") -> tuple[int, int] | None:
    """The ``(rows, cols)`` block of a DeepSeek-style FP8 checkpoint, or None when it is not quantized.

    Reads config.json's ``quantization_config`` as DeepSeek-V3 writes it (``quant_method: fp8``,
    ``fmt: e4m3``, ``weight_block_size``, ``activation_scheme: dynamic``; transformers' own FP8
    configs omit ``fmt``). Anything else would load as garbage, so it is refused.
    """
    where = f"{source}: " if source else ""
    quantization = config.get("quantization_config")
    if quantization is None:
        return None
    supported = (
        "powertrain reads unquantized checkpoints and DeepSeek-style FP8 block-scaled ones (quant_method 'fp8', "
        "fmt 'e4m3', weight_block_size [rows, cols], activation_scheme 'dynamic'). Use the model's unquantized "
        "(BF16) checkpoint instead."
    )
    if not isinstance(quantization, Mapping):
        raise UnsupportedCheckpointError(f"{where}quantization_config is {quantization!r}, not an object. {supported}")
    method, fmt = quantization.get("quant_method"), quantization.get("fmt", "e4m3")
    if method != "fp8":
        raise UnsupportedCheckpointError(f"{where}quantization_config has quant_method {method!r}. {supported}")
    if fmt != "e4m3":
        raise UnsupportedCheckpointError(f"{where}quantization_config has fmt {fmt!r}. {supported}")
    if quantization.get("activation_scheme", "dynamic") != "dynamic":
        raise UnsupportedCheckpointError(
            f"{where}quantization_config has activation_scheme {quantization['activation_scheme']!r} (static "
            f"activation scales). {supported}"
        )
    block = quantization.get("weight_block_size")
    if not (
        isinstance(block, Sequence)
        and len(block) == 2
        and all(isinstance(size, int) and not isinstance(size, bool) and size > 0 for size in block)
    ):
        raise UnsupportedCheckpointError(
            f"{where}quantization_config has weight_block_size {block!r}; expected two positive integers such as "
            f"[128, 128] (per-tensor FP8 scales are not supported). {supported}"
        )
    return int(block[0]), int(block[1])


def is_fp8(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` holds 8-bit float weights (any float8 variant but e8m0, which only scales:
    DeepSeek-V4's FP4 experts' ``.scale`` tensors)."""
    return tensor.dtype.is_floating_point and tensor.dtype.itemsize == 1 and tensor.dtype != torch.float8_e8m0fnu


def dequantize_stream(
    tensors: Iterable[tuple[str, torch.Tensor]],
    block: tuple[int, int],
    dtype: torch.dtype,
    keep: Callable[[str], bool] = lambda name: False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint's ``(name, tensor)`` stream with each FP8 weight ``X`` and its ``X_scale_inv``
    replaced by the dequantized ``X`` in ``dtype``; other tensors pass through.

    The two halves of a pair may come in either order and from different shards, so the first
    one waits (only unpaired tensors are held) and the weight is yielded when its partner arrives.
    Weights for which ``keep(name)`` is true are passed on unchanged, each with its scale, for
    kernels that consume FP8 directly. At the end, an FP8 weight without a scale or a scale
    without an FP8 weight raises ``CorruptCheckpointError`` naming them: loading on would
    silently produce a broken model.
    """
    waiting_weights: dict[str, torch.Tensor] = {}
    waiting_scales: dict[str, torch.Tensor] = {}
    kept_weights: set[str] = set()
    kept_scales: set[str] = set()
    plain: dict[str, torch.dtype] = {}  # not FP8: a scale naming one of them is an error

    for name, tensor in tensors:
        if name.endswith(SCALE_SUFFIX):
            weight_name = name[: -len(SCALE_SUFFIX)]
            if keep(weight_name):
                kept_scales.add(name)
                yield name, tensor
            elif weight_name in waiting_weights:
                yield weight_name, _dequantize(weight_name, waiting_weights.pop(weight_name), tensor, block, dtype)
            else:
                waiting_scales[name] = tensor
        elif is_fp8(tensor):
            if keep(name):
                kept_weights.add(name)
                yield name, tensor
            elif name + SCALE_SUFFIX in waiting_scales:
                yield name, _dequantize(name, tensor, waiting_scales.pop(name + SCALE_SUFFIX), block, dtype)
            else:
                waiting_weights[name] = tensor
        else:
            plain[name] = tensor.dtype
            yield name, tensor

    unscaled = sorted([*waiting_weights, *(name for name in kept_weights if name + SCALE_SUFFIX not in kept_scales)])
    orphans = sorted(
        [*waiting_scales, *(name for name in kept_scales if name[: -len(SCALE_SUFFIX)] not in kept_weights)]
    )
    problems = []
    if unscaled:
        problems.append(f"FP8 weight(s) without a {SCALE_SUFFIX} tensor: {_names(unscaled)}")
    if orphans:
        stored = [
            f"{name[: -len(SCALE_SUFFIX)]} is {plain[name[: -len(SCALE_SUFFIX)]]}"
            for name in orphans
            if name[: -len(SCALE_SUFFIX)] in plain
        ]
        problems.append(
            f"scale(s) without an FP8 weight: {_names(orphans)}" + (f" ({'; '.join(stored[:3])})" if stored else "")
        )
    if problems:
        raise CorruptCheckpointError(
            f"FP8 checkpoint with {block[0]}x{block[1]} blocks: {'; '.join(problems)}. Each FP8 weight X needs its "
            f"block factors X{SCALE_SUFFIX}; a shard is probably missing or was converted incompletely. Download or "
            "convert the checkpoint again."
        )


def _dequantize(
    name: str, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    try:
        return dequantize_blocks(weight, scale_inv, block, dtype)
    except ValueError as error:
        raise CorruptCheckpointError(f"{name}: {error}. Download or convert the checkpoint again.") from error


def _names(names: list[str], shown: int = 5) -> str:
    listed = ", ".join(names[:shown])
    return listed + (f" and {len(names) - shown} more" if len(names) > shown else "")

"""FP4 (e2m1) routed experts, as DeepSeek-V4 checkpoints store them (``expert_dtype: fp4``).

An expert weight ``X.weight`` ``[..., rows, cols]`` is stored as bytes ``[..., rows, cols / 2]``:
two e2m1 codes a byte, the even column in the low nibble (int8 as transformers writes it,
``float4_e2m1fn_x2`` as DeepSeek's reference types it, or uint8: the same bytes). Its sibling
``X.scale`` ``[..., rows, cols / 32]`` holds one power of two per 32 columns, as ue8m0:
``float8_e8m0fnu``, or uint8 exponent bytes ``b`` meaning ``2**(b - 127)``. The real weight is
``e2m1 value * scale`` (transformers' ``Fp8Dequantize._dequantize_one`` computes the same).

``fp4_experts_from_config`` reads the declaration from config.json; ``dequantize_fp4_stream``
folds each such pair into one float weight (``Checkpoint.tensors()`` uses it). A pair is told
by its dtypes and shapes (a byte-typed weight and a scale with ``cols / 32`` groups); the
names only say which tensors are siblings.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from powertrain.loader.errors import CorruptCheckpointError, UnsupportedCheckpointError

#: Columns that share one scale.
FP4_GROUP = 32
#: The value of each e2m1 code: 0..7 the magnitudes, code | 8 their negatives.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
#: Dtypes packed FP4 bytes come in (same bytes: ``.view(torch.uint8)``).
PACKED_DTYPES = (torch.int8, torch.uint8, torch.float4_e2m1fn_x2)
#: Dtypes of ue8m0 scales.
SCALE_DTYPES = (torch.float8_e8m0fnu, torch.uint8)
#: Safetensors names of the two: what a header says before any data is read.
PACKED_STORAGE = frozenset({"I8", "U8", "F4"})

WEIGHT_LEAF, SCALE_LEAF = "weight", "scale"


def fp4_experts_from_config(config: Mapping[str, Any], *, source: str = "") -> bool:
    """Whether config.json declares FP4 experts: ``expert_dtype: "fp4"`` inside
    ``quantization_config`` (V4.1) or at the top level (transformers folds it in)."""
    quantization = config.get("quantization_config")
    inside = quantization.get("expert_dtype") if isinstance(quantization, Mapping) else None
    declared = inside if inside is not None else config.get("expert_dtype")
    if declared in (None, "fp8", "bf16"):
        return False
    if declared != "fp4":
        where = f"{source}: " if source else ""
        raise UnsupportedCheckpointError(
            f"{where}expert_dtype is {declared!r}; powertrain reads routed experts stored as 'fp4' (e2m1 with ue8m0 "
            "scales per 32 columns) or in the checkpoint's weight dtype. Use the model's BF16 checkpoint instead."
        )
    return True


def scale_name(weight_name: str) -> str | None:
    """``X.scale`` for ``X.weight`` (the sibling an FP4 weight's scale is stored under), else None."""
    stem, dot, leaf = weight_name.rpartition(".")
    return f"{stem}.{SCALE_LEAF}" if dot and leaf == WEIGHT_LEAF else None


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Packed e2m1 bytes ``[..., n]`` -> their float32 values ``[..., 2n]`` (low nibble first)."""
    if packed.dtype not in PACKED_DTYPES:
        raise ValueError(f"packed FP4 codes come as {_dtypes(PACKED_DTYPES)}, got {packed.dtype}")
    codes = packed.contiguous().view(torch.uint8)
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    return torch.stack([lut[(codes & 0xF).long()], lut[(codes >> 4).long()]], dim=-1).flatten(-2)


def scale_factors(scale: torch.Tensor) -> torch.Tensor:
    """ue8m0 scales as float32 powers of two (uint8 bytes ``b`` mean ``2**(b - 127)``)."""
    if scale.dtype == torch.uint8:
        return torch.exp2(scale.float() - 127.0)
    if scale.dtype != torch.float8_e8m0fnu:
        raise ValueError(f"FP4 scales come as {_dtypes(SCALE_DTYPES)} (ue8m0), got {scale.dtype}")
    return scale.float()


def check_fp4(packed: torch.Tensor, scale: torch.Tensor) -> None:
    """Raise ValueError unless ``scale`` has one group per 32 of ``packed``'s ``2 * bytes`` columns."""
    if packed.dim() < 1 or scale.dim() != packed.dim():
        raise ValueError(f"FP4 weight {tuple(packed.shape)} and scale {tuple(scale.shape)} differ in rank")
    columns = 2 * packed.shape[-1]
    want = (*packed.shape[:-1], columns // FP4_GROUP)
    if columns % FP4_GROUP or tuple(scale.shape) != want:
        raise ValueError(
            f"an FP4 weight stored as {tuple(packed.shape)} bytes holds {columns} columns, which needs a scale of "
            f"shape {want} (one per {FP4_GROUP} columns), got {tuple(scale.shape)}"
        )


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight ``(packed, scale)`` stands for, ``[..., rows, cols]`` in ``dtype`` (computed in float32, exact)."""
    check_fp4(packed, scale)
    values = unpack_fp4(packed).unflatten(-1, (-1, FP4_GROUP))
    return (values * scale_factors(scale).unsqueeze(-1)).flatten(-2).to(dtype)


def is_packed_fp4(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s dtype is one packed FP4 bytes come in (its shape decides the rest)."""
    return tensor.dtype in PACKED_DTYPES


def dequantize_fp4_stream(
    tensors: Iterable[tuple[str, torch.Tensor]],
    dtype: torch.dtype,
    keep: Callable[[str], bool] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint's ``(name, tensor)`` stream with each FP4 weight ``X.weight`` and its ``X.scale``
    replaced by the dequantized ``X.weight`` in ``dtype``; other tensors pass through, and so do
    both halves of a weight ``keep("X.weight")`` asks for as stored (for a MoE backend that
    multiplies packed FP4 itself).

    The halves may come in either order (the reader yields a scale right after its weight where it
    can); only unpaired ones are held. A ``.scale`` whose ``.weight`` is not byte-typed is no FP4
    scale and passes on with it. At the end, a byte-typed weight without a scale raises
    ``CorruptCheckpointError``, as does a pair whose shapes disagree (naming the tensor, both shapes).
    """
    waiting_weights: dict[str, torch.Tensor] = {}  # scale name -> packed weight
    waiting_scales: dict[str, torch.Tensor] = {}  # scale name -> scale
    not_fp4: set[str] = set()  # scale names of weights that passed on unpacked
    for name, tensor in tensors:
        sibling = scale_name(name)
        weight_name = name if sibling is not None else name.removesuffix(SCALE_LEAF) + WEIGHT_LEAF
        if keep is not None and keep(weight_name):
            yield name, tensor
            continue
        if sibling is not None and is_packed_fp4(tensor):
            if sibling in waiting_scales:
                yield name, _dequantize(name, tensor, waiting_scales.pop(sibling), dtype)
            else:
                waiting_weights[sibling] = tensor
        elif name.endswith(f".{SCALE_LEAF}") and name not in not_fp4:
            if name in waiting_weights:
                weight_name = name.removesuffix(SCALE_LEAF) + WEIGHT_LEAF
                yield weight_name, _dequantize(weight_name, waiting_weights.pop(name), tensor, dtype)
            else:
                waiting_scales[name] = tensor
        else:
            if sibling is not None:
                not_fp4.add(sibling)
                if sibling in waiting_scales:
                    yield sibling, waiting_scales.pop(sibling)  # the scale of a weight that is not FP4
            yield name, tensor
    yield from waiting_scales.items()  # tensors named *.scale beside no weight: not FP4 scales
    if waiting_weights:
        names = sorted(name.removesuffix(SCALE_LEAF) + WEIGHT_LEAF for name in waiting_weights)
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        raise CorruptCheckpointError(
            f"FP4 expert weight(s) without their .scale tensor: {shown}. Each packed weight X.weight needs its ue8m0 "
            "scales X.scale; a shard is probably missing or was converted incompletely. Download the checkpoint again."
        )


def _dequantize(name: str, packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    try:
        return dequantize_fp4(packed, scale, dtype)
    except ValueError as error:
        raise CorruptCheckpointError(f"{name}: {error}. Download or convert the checkpoint again.") from error


def _dtypes(dtypes: Iterable[torch.dtype]) -> str:
    return " or ".join(str(dtype).removeprefix("torch.") for dtype in dtypes)

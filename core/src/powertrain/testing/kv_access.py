"""Cache access by token for the conformance kits: a cache tensor seen as
``[num_blocks, block_size, *per_token_shape]`` whatever the backend's layout, and
tokens written or read there by slot."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from powertrain.interfaces import KVCacheSpec, KVTensorSpec

__all__ = ["read_tokens", "token_major", "write_tokens"]


def token_major(spec: KVCacheSpec, tensor: torch.Tensor) -> torch.Tensor:
    """A ``[num_blocks, block_size, *per_token_shape]`` view of one cache tensor.

    A view, not a copy, so writing through it writes the cache.
    """
    if spec.layout == "block-head-major":
        return tensor.movedim(2, 1)  # [blocks, heads, block_size, ...] -> [blocks, block_size, heads, ...]
    return tensor


def _tensor_spec(spec: KVCacheSpec, name: str) -> KVTensorSpec:
    for tensor in spec.tensors:
        if tensor.name == name:
            return tensor
    raise KeyError(f"KVCacheSpec has no tensor {name!r}; it declares {[t.name for t in spec.tensors]}")


def write_tokens(
    spec: KVCacheSpec, cache: Mapping[str, torch.Tensor], name: str, slots: torch.Tensor, values: torch.Tensor
) -> None:
    """Store ``values[i]`` (any shape with the per-token element count) at ``slots[i]``."""
    view = token_major(spec, cache[name])
    slots = slots.to(device=view.device, dtype=torch.long)
    per_token = _tensor_spec(spec, name).shape
    view[slots // spec.block_size, slots % spec.block_size] = values.reshape(len(slots), *per_token).to(
        device=view.device, dtype=spec.dtype
    )


def read_tokens(spec: KVCacheSpec, cache: Mapping[str, torch.Tensor], name: str, slots: torch.Tensor) -> torch.Tensor:
    """The tokens at ``slots``, ``[len(slots), *per_token_shape]``."""
    view = token_major(spec, cache[name])
    slots = slots.to(device=view.device, dtype=torch.long)
    return view[slots // spec.block_size, slots % spec.block_size]

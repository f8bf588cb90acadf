"""Conformance check for the ``batch-invariant`` capability of an attention backend: a
sequence's outputs are the same bits whether it runs alone or inside a batch of 16.

That is what lets a seeded or greedy request give the same tokens however the scheduler
batches it (``[engine] batch_invariant``). The check runs one target sequence alone, then
again at a random place among 15 random others (decodes first, as the engine orders them),
in other cache blocks, with the same context and new tokens, and compares its rows with
``torch.equal``: a split count or reduction order that depends on the batch fails it.

``AttentionBackendSuite.test_batch_invariant*`` call this for a declared backend.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from powertrain.interfaces import AttentionLayerSpec, AttentionMetadata, KVCacheSpec
from powertrain.testing.base import random_index_rows, shuffled_block_tables
from powertrain.testing.kv_access import write_tokens

__all__ = ["check_batch_invariant"]

#: Sequences in the batched run, the target among them.
BATCH = 16


def check_batch_invariant(
    backend: Any,
    layer: AttentionLayerSpec,
    spec: KVCacheSpec,
    *,
    target: tuple[int, int],
    block_size: int,
    dtype: torch.dtype,
    seed: int,
    device: torch.device | str = "cpu",
    sparse_topk: int | None = None,
    what: str = "attention",
) -> None:
    """The ``target`` sequence's ``(context_len, query_len)`` rows through ``backend``
    (``forward`` for a GQA/MHA ``layer``, ``forward_mla`` for MLA, ``forward_mla_sparse``
    over random index rows of ``sparse_topk`` columns) alone and in a batch of ``BATCH``
    must be equal bit for bit."""
    gen = torch.Generator().manual_seed(seed)
    others = sorted((_random_lengths(gen) for _ in range(BATCH - 1)), key=lambda s: s[1] > 1)  # decodes first
    decodes = sum(1 for _, q in others if q == 1)
    low, high = (0, decodes) if target[1] == 1 else (decodes, len(others))
    place = int(torch.randint(low, high + 1, (1,), generator=gen))  # among its own kind
    batch = [*others[:place], target, *others[place:]]

    target_inputs = _inputs(layer, target, gen, dtype, sparse_topk)
    run = (backend, layer, spec, block_size, dtype, device, gen, sparse_topk)
    alone = _run(*run, [target], 0, target_inputs)
    together = _run(*run, batch, place, target_inputs)
    if not torch.equal(alone, together):
        diff = (alone.float() - together.float()).abs().max().item()
        raise AssertionError(
            f"{what}: a sequence of (context_len, query_len)={target} gives other bits alone than at "
            f"position {place} of a batch of {BATCH} (largest difference {diff:.3e}; batch lengths {batch}, "
            f"seed={seed}); a backend declaring 'batch-invariant' must not let the batch change a row's arithmetic"
        )


def _random_lengths(gen: torch.Generator) -> tuple[int, int]:
    """A decode (half the time) or a short chunk after a context, like a busy step's rows."""
    context = int(torch.randint(0, 70, (1,), generator=gen))
    if bool(torch.rand((), generator=gen) < 0.5):
        return max(context, 1), 1
    return context, int(torch.randint(2, 24, (1,), generator=gen))


def _inputs(
    layer: AttentionLayerSpec, lengths: tuple[int, int], gen: torch.Generator, dtype: torch.dtype, topk: int | None
) -> dict:
    """A sequence's context tokens (per cache tensor), new-token inputs and (sparse MLA)
    index rows."""
    context, query = lengths

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(dtype)

    if layer.kind == "mla":
        rank, rope = layer.kv_lora_rank, layer.qk_rope_head_dim
        return {
            "context": {"latent": rand(context, rank), "rope": rand(context, rope)},
            "new": (rand(query, layer.num_heads, rank), rand(query, layer.num_heads, rope), rand(query, rank),
                    rand(query, rope)),
            "indices": None if topk is None else random_index_rows([context + query], [query], topk, gen),
        }  # fmt: skip
    kv = (layer.num_kv_heads, layer.head_size)
    return {
        "context": {"key": rand(context, *kv), "value": rand(context, *kv)},
        "new": (rand(query, layer.num_heads, layer.head_size), rand(query, *kv), rand(query, *kv)),
    }


def _run(
    backend: Any,
    layer: AttentionLayerSpec,
    spec: KVCacheSpec,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    gen: torch.Generator,
    topk: int | None,
    lengths: Sequence[tuple[int, int]],
    target: int,
    target_inputs: dict,
) -> torch.Tensor:
    """One step over ``lengths`` in freshly shuffled blocks (garbage elsewhere); the
    target's output rows."""
    tables, num_blocks = shuffled_block_tables([math.ceil((c + q) / block_size) for c, q in lengths], gen)
    cache = spec.allocate(num_blocks, device)
    for tensor in cache.values():
        tensor.copy_(torch.randn(tensor.shape, generator=gen).to(tensor.dtype))
    inputs = [target_inputs if i == target else _inputs(layer, s, gen, dtype, topk) for i, s in enumerate(lengths)]
    for table, (context, _), sequence in zip(tables, lengths, inputs, strict=True):
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(context)])
        for name, values in sequence["context"].items():
            write_tokens(spec, cache, name, slots, values)
    new = [torch.cat([s["new"][i] for s in inputs]).to(device) for i in range(len(inputs[0]["new"]))]
    metadata = AttentionMetadata.build(
        query_lens=[q for _, q in lengths],
        seq_lens=[c + q for c, q in lengths],
        block_tables=tables,
        block_size=block_size,
        device=device,
    )
    if topk is not None:
        indices = torch.cat([s["indices"] for s in inputs]).to(device)
        out = backend.forward_mla_sparse(layer, *new, cache, metadata, indices)
    elif layer.kind == "mla":
        out = backend.forward_mla(layer, *new, cache, metadata)
    else:
        out = backend.forward(layer, *new, cache, metadata)
    start = sum(q for _, q in lengths[:target])
    return out[start : start + lengths[target][1]].detach().cpu()

"""Drive a model through a paged KV cache the way the engine does, minus the engine.

For model tests against an oracle (HF transformers): blocks are drawn from a
shuffled pool as sequences grow, each step is one flat batch with its
``AttentionMetadata``, and a prefix-cache hit is a new sequence whose table starts
with another sequence's full blocks. The cache starts as NaN, so reading a slot
that was never written poisons the output instead of passing silently.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from powertrain.interfaces import AttentionMetadata, allocate_caches


def nan_caches(
    layers: Sequence[Any], backend: Any, dtype: torch.dtype, device: Any, block_size: int, num_blocks: int
) -> list[dict[str, torch.Tensor]]:
    """The layers' caches (``allocate_caches``: groups read from another layer are its
    tensors), filled with NaN so that a read of anything not written shows."""
    specs = [layer.backend_cache_spec(backend, block_size, dtype) for layer in layers]
    caches = allocate_caches(layers, specs, num_blocks, device)
    for cache in caches:
        for tensor in cache.values():
            tensor.fill_(float("nan"))
    return caches


class PagedRunner:
    def __init__(
        self,
        model: Any,
        backend: Any,
        *,
        dtype: torch.dtype = torch.float32,
        block_size: int = 4,
        num_blocks: int = 96,
        layers: Sequence[Any] | None = None,
    ) -> None:
        """``layers`` defaults to ``model.attention_layers``; pass others (e.g. a
        drafter's) to get caches for them."""
        self.model = model
        self.block_size = block_size
        self.free = torch.randperm(num_blocks).tolist()
        self.caches = nan_caches(
            model.attention_layers if layers is None else layers, backend, dtype, "cpu", block_size, num_blocks
        )
        self.blocks: dict[str, list[int]] = {}
        self.lengths: dict[str, int] = {}

    def share_prefix(self, seq: str, source: str, num_tokens: int) -> int:
        """Start ``seq`` on ``source``'s full blocks covering at most ``num_tokens`` tokens,
        as a prefix-cache hit does; returns how many tokens it skips."""
        full = min(num_tokens, self.lengths[source]) // self.block_size
        self.blocks[seq] = list(self.blocks[source][:full])
        self.lengths[seq] = full * self.block_size
        return self.lengths[seq]

    def metadata(self, chunks: Sequence[tuple[str, Sequence[int]]]) -> tuple[AttentionMetadata, torch.Tensor]:
        """Grow each sequence by its chunk (decodes must come first, as the engine orders
        them); returns the step's metadata and positions."""
        query_lens, seq_lens, tables, positions = [], [], [], []
        for seq, tokens in chunks:
            context = self.lengths.get(seq, 0)
            total = context + len(tokens)
            blocks = self.blocks.setdefault(seq, [])
            while len(blocks) * self.block_size < total:
                blocks.append(self.free.pop())
            query_lens.append(len(tokens))
            seq_lens.append(total)
            tables.append(list(blocks))
            positions.extend(range(context, total))
            self.lengths[seq] = total
        metadata = AttentionMetadata.build(
            query_lens=query_lens, seq_lens=seq_lens, block_tables=tables, block_size=self.block_size
        )
        return metadata, torch.tensor(positions, dtype=torch.int64)

    def step(self, chunks: Sequence[tuple[str, Sequence[int]]], **forward: Any) -> list[torch.Tensor]:
        """Run one step; float32 logits per chunk. ``forward``: keyword arguments for the model's
        forward where given (``image_rows``)."""
        metadata, positions = self.metadata(chunks)
        input_ids = torch.tensor([t for _, tokens in chunks for t in tokens], dtype=torch.int64)
        with torch.inference_mode():
            hidden = self.model(input_ids, positions, self.caches, metadata, **forward)
            logits = self.model.compute_logits(hidden)
        assert logits.dtype == torch.float32 and logits.shape[0] == len(input_ids)
        return list(logits.split(metadata.query_lens_host))

    def prefill_then_decode(self, prompts: dict[str, list[int]], decode_steps: int) -> list[torch.Tensor]:
        """Prefill every prompt in one step, then feed each ``decode_steps`` tokens of a fixed
        stream (the same for any backend, so two runs compare step by step); every step's logits."""
        outputs = self.step(list(prompts.items()))
        stream = torch.Generator().manual_seed(len(prompts))
        for _ in range(decode_steps):
            outputs += self.step([(name, torch.randint(0, 100, (1,), generator=stream).tolist()) for name in prompts])
        return outputs

    def greedy_beside_a_neighbour(
        self,
        prompt: Sequence[int],
        neighbour: Sequence[int],
        neighbour_steps: Sequence[int],
        *,
        skip: int = 0,
    ) -> tuple[torch.Tensor, list[int]]:
        """Prefill ``prompt[skip:]`` (``skip`` tokens already cached, e.g. by ``share_prefix``)
        as sequence "s" beside neighbour "n"'s prompt, then decode "s" greedily while "n"
        decodes ``neighbour_steps``, one token each, in the same steps. Returns the logits
        of every "s" token (``[len(prompt) - skip + len(neighbour_steps), vocab]``) and the
        ``len(neighbour_steps) + 1`` tokens "s" generated."""
        first, _ = self.step([("s", list(prompt[skip:])), ("n", list(neighbour))])
        rows, generated = [first], [int(first[-1].argmax())]
        for token in neighbour_steps:
            logits, _ = self.step([("s", [generated[-1]]), ("n", [token])])
            rows.append(logits)
            generated.append(int(logits[-1].argmax()))
        return torch.cat(rows), generated

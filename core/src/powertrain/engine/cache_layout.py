"""The paged cache as a whole: its cache groups across layers, what each costs per token,
and how many blocks each retention class gets from a memory budget.

This is the accounting the startup log and ``powertrain config check`` print, and the
sizing the engine allocates by, so the two cannot disagree.

Sizing: when the model keeps any full-history group, a sliding class never needs more
blocks than its running sequences can hold at once: each keeps at most
``ceil((W - 1) / B) + 1`` blocks for its window plus a block for what it computes, and
one step's new tokens take at most ``ceil(max_num_batched_tokens / B)`` more. A sliding
pool gets that many blocks (or as many as the full pool, if fewer) and the full pool
the rest of the budget. A model whose every group slides splits the budget evenly.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from powertrain.interfaces import AttentionLayerSpec, KVCacheSpec, check_cache_sharing
from powertrain.interfaces.attention import pool_blocks

Window = int | None


@attrs.frozen(kw_only=True)
class GroupCost:
    """One cache group summed over the layers that own it, and what the layers that read
    it from them (``CacheGroupSpec.read_from``) would hold if each kept its own."""

    name: str
    window: Window
    tokens_per_entry: int
    layers: int
    bytes_per_token: float
    read_by: int = 0
    saved_bytes_per_token: float = 0.0


@attrs.frozen(kw_only=True)
class CacheLayout:
    block_size: int
    groups: tuple[GroupCost, ...]
    #: Per retention class: bytes one block takes across all layers.
    bytes_per_block: Mapping[Window, int]
    #: What caching every layer's expanded keys and values for every token would take
    #: (the model's own figure where it has one, e.g. MLA's uncompressed K/V).
    dense_bytes_per_token: float

    @property
    def windows(self) -> tuple[Window, ...]:
        return tuple(self.bytes_per_block)

    @property
    def bytes_per_token(self) -> float:
        """Per token of sequence, every group counted as if it kept every token."""
        return sum(group.bytes_per_token for group in self.groups)

    @property
    def saved_bytes_per_token(self) -> float:
        """What sharing groups across layers saves: the bytes per token the reading layers'
        own copies would take."""
        return sum(group.saved_bytes_per_token for group in self.groups)

    @property
    def growing_bytes_per_token(self) -> float:
        """What each further token of a long sequence adds: the full-history groups only."""
        return sum(group.bytes_per_token for group in self.groups if group.window is None)

    @property
    def sliding_bytes_per_sequence(self) -> float:
        """What a long sequence's sliding groups hold at most, whatever its length: the
        blocks of its window plus the one being written (``_sliding_bound``'s per-sequence part)."""
        return sum(
            group.bytes_per_token * self.block_size * (-(-(group.window - 1) // self.block_size) + 1)
            for group in self.groups
            if group.window is not None
        )

    def num_blocks(
        self, budget_bytes: int, *, max_num_seqs: int, max_num_batched_tokens: int, fixed: int | None = None
    ) -> dict[Window, int]:
        """Usable blocks per retention class for ``budget_bytes`` (or ``fixed`` blocks per
        full class, as ``[cache] num_blocks`` asks). Raises ValueError when no block fits."""
        sliding = [w for w in self.windows if w is not None]
        if fixed is None:
            null_bytes = sum(self.bytes_per_block[w] for w in sliding)
            even = (budget_bytes - null_bytes) // sum(self.bytes_per_block.values())
        else:
            even = fixed
        if even < 1:
            raise ValueError(
                f"the KV cache budget of {budget_bytes} bytes holds no block of "
                f"{sum(self.bytes_per_block.values())} bytes; raise [cache] memory_gib"
            )
        if None not in self.bytes_per_block:
            return dict.fromkeys(self.windows, even)
        counts = {w: min(even, self._sliding_bound(w, max_num_seqs, max_num_batched_tokens)) for w in sliding}
        if fixed is None:
            left = budget_bytes - sum(pool_blocks(w, n) * self.bytes_per_block[w] for w, n in counts.items())
            fixed = left // self.bytes_per_block[None]
        return {None: fixed, **counts}

    def _sliding_bound(self, window: int, max_num_seqs: int, max_num_batched_tokens: int) -> int:
        per_sequence = -(-(window - 1) // self.block_size) + 2
        return max_num_seqs * per_sequence + -(-max_num_batched_tokens // self.block_size)

    def bytes_for(self, counts: Mapping[Window, int]) -> int:
        """Bytes the cache takes with ``counts`` usable blocks per class (null blocks included)."""
        return sum(pool_blocks(w, counts[w]) * self.bytes_per_block[w] for w in self.windows)

    def report(self, counts: Mapping[Window, int] | None = None) -> dict[str, Any]:
        """The accounting as plain data: per group and in total, bytes per token, and
        what a dense uncompressed cache would take; with ``counts``, the blocks too."""
        out: dict[str, Any] = {
            "block_size": self.block_size,
            "groups": [
                {
                    "name": g.name,
                    "retention": "full" if g.window is None else f"sliding {g.window}",
                    "tokens_per_entry": g.tokens_per_entry,
                    "layers": g.layers,
                    "bytes_per_token": round(g.bytes_per_token, 2),
                    **(
                        {"read_by_layers": g.read_by, "saved_bytes_per_token": round(g.saved_bytes_per_token, 2)}
                        if g.read_by
                        else {}
                    ),
                }
                for g in self.groups
            ],
            "bytes_per_token": round(self.bytes_per_token, 2),
            "dense_bytes_per_token": round(self.dense_bytes_per_token, 2),
        }
        if self.saved_bytes_per_token:
            out["unshared_bytes_per_token"] = round(self.bytes_per_token + self.saved_bytes_per_token, 2)
            out["saved_by_sharing_bytes_per_token"] = round(self.saved_bytes_per_token, 2)
        if any(group.window is not None for group in self.groups):
            out["growing_bytes_per_token"] = round(self.growing_bytes_per_token, 2)
            out["sliding_bytes_per_sequence"] = round(self.sliding_bytes_per_sequence, 2)
        if counts is not None:
            out["blocks"] = {"full" if w is None else f"sliding {w}": n for w, n in counts.items()}
            out["gib"] = round(self.bytes_for(counts) / 2**30, 3)
        return out


def cache_layout(
    layers: Sequence[AttentionLayerSpec],
    backend_specs: Sequence[KVCacheSpec],
    dense_bytes_per_token: float | None = None,
) -> CacheLayout:
    """The cache of a model whose attention layers are ``layers``, each with the backend's
    ``backend_specs`` entry (all of one block size)."""
    if not layers:
        raise ValueError("the model declares no attention layers: nothing to cache")
    check_cache_sharing(layers)
    block_size = backend_specs[0].block_size
    costs: dict[tuple[str, Window, int], list[float]] = {}
    reads: dict[tuple[str, Window, int], list[float]] = {}
    per_block: dict[Window, int] = {}
    for layer, spec in zip(layers, backend_specs, strict=True):
        for group in layer.groups(spec):
            key = (group.name, group.sliding_window, group.tokens_per_entry)
            kept = reads if group.source_layer is not None else costs
            kept.setdefault(key, []).append(group.bytes_per_token(block_size, spec.dtype))
        for window, size in layer.bytes_per_block(spec).items():
            per_block[window] = per_block.get(window, 0) + size
    groups = tuple(
        GroupCost(
            name=name,
            window=window,
            tokens_per_entry=entry,
            layers=len(sizes),
            bytes_per_token=sum(sizes),
            read_by=len(reads.get((name, window, entry), ())),
            saved_bytes_per_token=sum(reads.get((name, window, entry), ())),
        )
        for (name, window, entry), sizes in costs.items()
    )
    if dense_bytes_per_token is None:  # the backend's KV kept for every token
        dense_bytes_per_token = sum(g.bytes_per_token for g in groups if g.name == "attention")
    ordered = dict(sorted(per_block.items(), key=lambda item: -1 if item[0] is None else item[0]))
    return CacheLayout(
        block_size=block_size, groups=groups, bytes_per_block=ordered, dense_bytes_per_token=dense_bytes_per_token
    )

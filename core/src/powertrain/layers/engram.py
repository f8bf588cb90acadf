"""DeepSeek-V4.1's Engram memory: which rows of its n-gram tables a position reads.

The rows depend on token ids only, so they are known before any layer runs (and can be
gathered ahead of the layer that adds them). Each token id maps to a *compressed* id, shared
by tokens that normalise alike (" The", "the" and "THE"); a position hashes the n-grams of
2 to ``max_ngram_size`` compressed ids ending at it, once per hash head, each (n-gram size,
head) into its own prime-sized range of its layer's table. Slots before the sequence start
hold the pad token's compressed id. The definitions follow DeepSeek's ``inference/engram.py``
of the V4.1 release (its seeds, primes and multipliers must match bit for bit, or every
lookup reads another row), checked against it by the golden fixtures in
``core/tests/fixtures/deepseek_v41``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
import torch

#: Seed of a layer's hash multipliers: ``LAYER_SEED * layer_id``.
LAYER_SEED = 10007


def compressed_token_map(tokenizer: Any) -> tuple[list[int], int]:
    """Every token id's compressed id, and how many there are.

    ``tokenizer``: a ``tokenizers.Tokenizer``. A token's key is its decoded text (special
    tokens included) after NFKC, NFD, accents stripped, lower case, whitespace runs as one
    space and stripped, where a token that is only whitespace stays a single space; a token
    that decodes to a partial UTF-8 sequence is keyed by its raw form. Ids are given in
    order of first appearance, so the count (every hash multiplier's bound) is exact.
    """
    from tokenizers import Regex, normalizers

    keep_space = "\ue000"  # a private-use character: a lone space survives the strip
    normalizer = normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), keep_space),
            normalizers.Strip(),
            normalizers.Replace(keep_space, " "),
        ]
    )
    ids: dict[str, int] = {}
    mapping = []
    for token_id in range(tokenizer.get_vocab_size(with_added_tokens=True)):
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        partial = "\ufffd" in text  # a piece of a UTF-8 sequence: nothing to normalise
        key = tokenizer.id_to_token(token_id) if partial else (normalizer.normalize_str(text) or text)
        mapping.append(ids.setdefault(key, len(ids)))
    return mapping, len(ids)


def is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin (these bases decide every n below 3.3e24)."""
    if n < 2:
        return False
    bases = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)
    for p in bases:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d, r = d // 2, r + 1
    for a in bases:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


@attrs.frozen(kw_only=True)
class EngramLayout:
    """The bucket layout of the Engram tables: per Engram layer, per n-gram size (2 to
    ``max_ngram_size``), per head, a prime modulus. Primes are drawn in that order, each the
    smallest prime above ``vocab_size - 1`` (for a layer's first head of a size) or above the
    one before it, never one already drawn, so every range is disjoint."""

    layer_ids: tuple[int, ...]
    max_ngram_size: int
    n_heads: int
    head_dim: int
    #: ``[layer][ngram size - 2][head]``.
    primes: tuple[tuple[tuple[int, ...], ...], ...]

    @classmethod
    def build(
        cls, layer_ids: Sequence[int], max_ngram_size: int, n_heads: int, head_dim: int, vocab_size: int
    ) -> EngramLayout:
        drawn: set[int] = set()
        layers = []
        for _ in layer_ids:
            sizes = []
            for _ in range(max_ngram_size - 1):
                heads, candidate = [], vocab_size - 1
                for _ in range(n_heads):
                    candidate += 1
                    while candidate in drawn or not is_prime(candidate):
                        candidate += 1
                    drawn.add(candidate)
                    heads.append(candidate)
                sizes.append(tuple(heads))
            layers.append(tuple(sizes))
        return cls(
            layer_ids=tuple(layer_ids),
            max_ngram_size=max_ngram_size,
            n_heads=n_heads,
            head_dim=head_dim,
            primes=tuple(layers),
        )

    @property
    def columns(self) -> int:
        """Rows a position reads per layer: one per (n-gram size, head)."""
        return (self.max_ngram_size - 1) * self.n_heads

    @property
    def table_rows(self) -> tuple[int, ...]:
        """Each layer's table size: its buckets' ranges laid end to end."""
        return tuple(sum(p for size in layer for p in size) for layer in self.primes)

    def offsets(self) -> torch.Tensor:
        """int64 ``[layers, columns]``: where each (n-gram size, head) range starts in its table."""
        flat = torch.tensor([[p for size in layer for p in size] for layer in self.primes], dtype=torch.int64)
        return torch.cumsum(flat, dim=1) - flat

    def moduli(self) -> torch.Tensor:
        """int64 ``[layers, columns]``: each range's prime, in the same order as ``offsets``."""
        return torch.tensor([[p for size in layer for p in size] for layer in self.primes], dtype=torch.int64)


def hash_multipliers(layer_ids: Sequence[int], max_ngram_size: int, compressed_vocab_size: int) -> torch.Tensor:
    """int64 ``[layers, max_ngram_size]``: one odd multiplier per (layer, look-back), from a
    per-layer numpy generator (seed ``LAYER_SEED * layer_id``), below ``int64 max / vocab / 2``
    so that a compressed id times it cannot overflow."""
    bound = max(1, (np.iinfo(np.int64).max // compressed_vocab_size) // 2)
    rows = [
        np.random.default_rng(LAYER_SEED * layer).integers(0, bound, size=(max_ngram_size,), dtype=np.int64) * 2 + 1
        for layer in layer_ids
    ]
    return torch.from_numpy(np.stack(rows))


class NgramHasher:
    """Table rows from compressed ids: ``rows(grams)`` for n-grams ending at some positions."""

    def __init__(self, layout: EngramLayout, compressed_vocab_size: int) -> None:
        self.layout = layout
        self.multipliers = hash_multipliers(layout.layer_ids, layout.max_ngram_size, compressed_vocab_size)
        self.moduli = layout.moduli()
        self.offsets = layout.offsets()

    def rows(self, grams: torch.Tensor) -> torch.Tensor:
        """int64 ``[n, layers, columns]``: the rows each Engram layer reads for ``grams`` int64
        ``[n, max_ngram_size]``, the compressed ids at positions ``p, p - 1, ...`` (the pad's
        where a slot is before the sequence start). A running XOR of id times multiplier over
        the look-backs is the (k+1)-gram's hash after k steps; each size's hash, modulo each
        head's prime, plus the range's offset, is a row."""
        products = grams[:, None, :] * self.multipliers  # [n, layers, max_ngram_size]
        rolling, hashes = products[..., 0], []
        for back in range(1, self.layout.max_ngram_size):
            rolling = torch.bitwise_xor(rolling, products[..., back])
            hashes.append(rolling[..., None].expand(-1, -1, self.layout.n_heads))
        hashed = torch.cat(hashes, dim=-1)  # [n, layers, columns]: size-major, then head
        return hashed % self.moduli + self.offsets


def ngram_windows(ids: torch.Tensor, positions: torch.Tensor, max_ngram_size: int, pad_id: int) -> torch.Tensor:
    """int64 ``[n, max_ngram_size]``: for each of ``positions``, the compressed ids at it and
    the ``max_ngram_size - 1`` positions before it in the sequence ``ids`` (``[length]``,
    compressed), ``pad_id`` where that is before position 0."""
    back = positions[:, None] - torch.arange(max_ngram_size, device=positions.device)
    return torch.where(back >= 0, ids[back.clamp(min=0)], pad_id)

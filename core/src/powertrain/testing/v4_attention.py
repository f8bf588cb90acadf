"""Conformance checks for DeepSeek-V4 attention (``V4AttentionBackend``, capability ``v4-attention``).

One random step per check, against a float64 oracle that knows nothing of paging: each
sequence's raw keys and compressed entries are kept densely, and each query token's softmax
runs over exactly the keys the contract names (its window, its closed or listed entries)
plus its head's sink. The paged cache the backend reads is filled so that a wrong read
shows: every slot starts as random garbage, the window class's tables point the blocks
wholly before a sequence's window at a garbage block, and the window crosses block edges.

``AttentionBackendSuite.test_v4_attention*`` call these for a declared backend; a pack's
own tests may call them on any backend object.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import attrs
import pytest
import torch

from powertrain.interfaces import AttentionLayerSpec, AttentionMetadata
from powertrain.testing.base import assert_names_numbers, random_index_rows, shuffled_block_tables

__all__ = [
    "V4_LAYER_KINDS",
    "check_v4_attention",
    "check_v4_attention_refuses",
    "check_v4_attention_shared_entries",
    "v4_layer",
]

#: The three V4 layer types: the window alone, + every closed entry (HCA), + listed entries (CSA).
V4_LAYER_KINDS = ("sliding", "hca", "csa")


def v4_layer(num_heads: int, head_size: int) -> AttentionLayerSpec:
    """A V4 attention layer as the model declares it (its cache groups are the check's own)."""
    return AttentionLayerSpec(
        kind="custom", num_heads=num_heads, num_kv_heads=1, head_size=head_size, scale=head_size**-0.5
    )


@attrs.frozen
class _V4Case:
    context_lens: tuple[int, ...]
    query_lens: tuple[int, ...]
    metadata: AttentionMetadata
    cache: dict[str, torch.Tensor]
    query: torch.Tensor  # [num_tokens, heads, d], on the CPU
    sinks: torch.Tensor  # float32 [heads]
    keys: list[torch.Tensor]  # per sequence: raw keys [seq_len, d]
    entries: list[torch.Tensor]  # per sequence: compressed entries [seq_len // rate, d]
    entry_indices: torch.Tensor | None  # int32 [num_tokens, k], on the CPU
    derotate: tuple[torch.Tensor, torch.Tensor] | None  # cos, sin [num_tokens, pairs], on the CPU
    window_tables: list[list[int]]  # per sequence: its window class's block table

    @property
    def seq_lens(self) -> tuple[int, ...]:
        return tuple(c + q for c, q in zip(self.context_lens, self.query_lens, strict=True))


def _randint(gen: torch.Generator, low: int, high: int) -> int:
    return int(torch.randint(low, high + 1, (1,), generator=gen).item())


def _v4_case(
    kind: str,
    layer: AttentionLayerSpec,
    lengths: Sequence[tuple[int, int]],
    *,
    block_size: int,
    window: int,
    rate: int,
    topk: int,
    dtype: torch.dtype,
    device: torch.device | str,
    gen: torch.Generator,
    rope_pairs: int = 0,
) -> _V4Case:
    if kind not in V4_LAYER_KINDS:
        raise ValueError(f"V4 layer kind {kind!r}; one of {V4_LAYER_KINDS}")
    d = layer.head_size
    context_lens = tuple(c for c, _ in lengths)
    query_lens = tuple(q for _, q in lengths)
    seq_lens = [c + q for c, q in lengths]
    needed = [-(-s // block_size) for s in seq_lens]
    full_tables, full_blocks = shuffled_block_tables(needed, gen)
    window_tables, window_blocks = shuffled_block_tables(needed, gen)
    stale = window_blocks  # one more block, of garbage: what the engine's null block stands for
    for table, context in zip(window_tables, context_lens, strict=True):
        gone = max(0, (context - window + 1) // block_size)  # wholly before the first query's window
        table[:gone] = [stale] * gone

    def garbage(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(dtype)

    keys = [garbage(s, d) for s in seq_lens]
    entries = [garbage(s // rate, d) for s in seq_lens]
    kv = _window_cache(keys, window_tables, context_lens, window, block_size, garbage)
    per_block = block_size // rate
    compressed = garbage(full_blocks, per_block, d)
    for seq, table in enumerate(full_tables):
        for entry in range(seq_lens[seq] // rate):
            compressed[table[entry // per_block], entry % per_block] = entries[seq][entry]
    cache = {"kv": kv.to(device)}
    if kind != "sliding":
        cache["compressed"] = compressed.to(device)
    metadata = AttentionMetadata.build(
        query_lens=query_lens,
        seq_lens=seq_lens,
        block_tables={window: window_tables, None: full_tables},
        block_size=block_size,
        device=device,
    )
    num_tokens = sum(query_lens)
    angles = torch.rand(num_tokens, rope_pairs, generator=gen, dtype=torch.float64) * 2 * torch.pi
    derotate = (angles.cos().to(dtype), angles.sin().to(dtype)) if rope_pairs else None
    return _V4Case(
        context_lens=context_lens,
        query_lens=query_lens,
        metadata=metadata,
        cache=cache,
        query=garbage(num_tokens, layer.num_heads, d),
        sinks=torch.randn(layer.num_heads, generator=gen) * 2,
        keys=keys,
        entries=entries,
        entry_indices=random_index_rows([s // rate for s in seq_lens], query_lens, topk, gen)
        if kind == "csa"
        else None,
        derotate=derotate,
        window_tables=window_tables,
    )


def _window_cache(
    keys: Sequence[torch.Tensor],
    tables: Sequence[Sequence[int]],
    context_lens: Sequence[int],
    window: int,
    block_size: int,
    garbage: Any,
) -> torch.Tensor:
    """A window-class cache tensor of garbage holding each sequence's keys its queries may
    read, through its block table (one spare garbage block beyond the tables' blocks)."""
    blocks = max(max(table, default=0) for table in tables) + 1
    kv = garbage(blocks + 1, block_size, keys[0].shape[-1])
    for seq, (table, context) in enumerate(zip(tables, context_lens, strict=True)):
        for position in range(max(0, context - window + 1), keys[seq].shape[0]):
            kv[table[position // block_size], position % block_size] = keys[seq][position]
    return kv


def _reader_of(case: _V4Case, kind: str, window: int, rate: int, topk: int, gen: torch.Generator) -> _V4Case:
    """Another layer of the same step that reads ``case``'s compressed entries (the very
    tensor, as ``CacheGroupSpec.read_from`` hands a reader its source's) beside its own
    window keys, queries, sinks and picks."""
    dtype, device = case.query.dtype, case.cache["kv"].device
    block_size = case.cache["kv"].shape[1]

    def garbage(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(dtype)

    keys = [garbage(key.shape[0], key.shape[1]) for key in case.keys]
    kv = _window_cache(keys, case.window_tables, case.context_lens, window, block_size, garbage)
    return attrs.evolve(
        case,
        cache={"kv": kv.to(device), "compressed": case.cache["compressed"]},
        query=garbage(*case.query.shape),
        sinks=torch.randn(case.sinks.shape, generator=gen) * 2,
        keys=keys,
        entry_indices=random_index_rows([s // rate for s in case.seq_lens], case.query_lens, topk, gen)
        if kind == "csa"
        else None,
    )


def _oracle(kind: str, layer: AttentionLayerSpec, case: _V4Case, window: int, rate: int) -> torch.Tensor:
    """Token by token in float64: softmax over the attended keys and the sink, the sink's share dropped."""
    out = torch.zeros(case.query.shape, dtype=torch.float64)
    starts = [0, *itertools.accumulate(case.query_lens)]
    for seq, context in enumerate(case.context_lens):
        for j in range(case.query_lens[seq]):
            token, position = starts[seq] + j, context + j
            attended = [case.keys[seq][max(0, position - window + 1) : position + 1]]
            if kind == "hca":
                attended.append(case.entries[seq][: (position + 1) // rate])
            elif kind == "csa":
                listed = [e for e in case.entry_indices[token].tolist() if e >= 0]
                attended.append(case.entries[seq][listed])
            keys = torch.cat(attended).double()  # [k, d]: keys and values
            scores = layer.scale * (case.query[token].double() @ keys.T)  # [heads, k]
            sink = case.sinks.double()[:, None]
            top = torch.maximum(scores.amax(-1, keepdim=True), sink)
            weights = torch.exp(scores - top)
            out[token] = (weights @ keys) / (weights.sum(-1, keepdim=True) + torch.exp(sink - top))
    if case.derotate is not None:  # the trailing dims' adjacent pairs rotated back by each token's angle
        cos, sin = (t.double()[:, None, :] for t in case.derotate)
        pairs = 2 * cos.shape[-1]
        even, odd = out[..., -pairs::2].clone(), out[..., -pairs + 1 :: 2].clone()
        out[..., -pairs::2] = even * cos + odd * sin
        out[..., -pairs + 1 :: 2] = odd * cos - even * sin
    return out


def _call(backend: Any, kind: str, layer: AttentionLayerSpec, case: _V4Case, window: int, rate: int, indices: Any):
    device = case.cache["kv"].device
    out = backend.forward_v4(
        layer,
        case.query.to(device),
        case.cache,
        case.metadata,
        case.sinks.to(device),
        window=window,
        compress_rate=None if kind == "sliding" else rate,
        entry_indices=None if indices is None else indices.to(device),
        derotate=None if case.derotate is None else tuple(t.to(device) for t in case.derotate),
    )
    case.metadata.raise_refused()  # entries a backend refused on the device: as the runner does after a step
    return out


def check_v4_attention(
    backend: Any,
    *,
    kind: str,
    lengths: Sequence[tuple[int, int]],
    block_size: int,
    dtype: torch.dtype,
    seed: int,
    tolerance: tuple[float, float],
    device: torch.device | str = "cpu",
    num_heads: int = 20,
    head_size: int = 48,
    rate: int = 4,
    window: int | None = None,
    topk: int = 7,
    rope_pairs: int = 0,
    what: str = "V4 attention",
) -> None:
    """Run ``backend.forward_v4`` on one random step of a ``kind`` layer (``V4_LAYER_KINDS``)
    and assert it matches the float64 oracle and left the cache as it was.

    ``lengths`` are ``(context_len, query_len)`` per sequence, decodes first. ``window``
    defaults to ``block_size + 3``, so windows start and end inside blocks; ``rate`` must
    divide ``block_size``. The defaults cross a 16-head tile and a power-of-two width.
    ``rope_pairs`` > 0 asks for the output de-rotated (``derotate``) by a random angle per
    token and pair on the trailing ``2 * rope_pairs`` dims.
    """
    gen = torch.Generator().manual_seed(seed)
    window = block_size + 3 if window is None else window
    layer = v4_layer(num_heads, head_size)
    case = _v4_case(
        kind,
        layer,
        lengths,
        block_size=block_size,
        window=window,
        rate=rate,
        topk=topk,
        dtype=dtype,
        device=device,
        gen=gen,
        rope_pairs=rope_pairs,
    )
    where = (
        f"{what}, {kind} layer: context_lens={case.context_lens} query_lens={case.query_lens} window={window} "
        f"rate={rate} block_size={block_size} rope_pairs={rope_pairs} (seed={seed})"
    )
    before = {name: tensor.clone() for name, tensor in case.cache.items()}
    got = _call(backend, kind, layer, case, window, rate, case.entry_indices)
    shape = tuple(case.query.shape)
    assert isinstance(got, torch.Tensor), f"forward_v4 returned {type(got).__name__}, not a tensor: {where}"
    assert tuple(got.shape[1:]) == shape[1:] and got.shape[0] >= shape[0], (
        f"output shape {tuple(got.shape)}, expected {shape}: {where}"
    )
    assert got.dtype == dtype, f"output dtype {got.dtype}, expected the query's {dtype}: {where}"
    atol, rtol = tolerance
    torch.testing.assert_close(
        got[: shape[0]].detach().cpu().double(),
        _oracle(kind, layer, case, window, rate),
        atol=atol,
        rtol=rtol,
        msg=lambda detail: f"V4 attention differs from the float64 oracle: {where}\n{detail}",
    )
    for name, tensor in case.cache.items():
        assert torch.equal(tensor, before[name]), f"forward_v4 wrote the {name!r} cache; it only reads: {where}"


def check_v4_attention_shared_entries(
    backend: Any,
    *,
    kind: str,
    lengths: Sequence[tuple[int, int]],
    block_size: int,
    dtype: torch.dtype,
    seed: int,
    tolerance: tuple[float, float],
    device: torch.device | str = "cpu",
    num_heads: int = 20,
    head_size: int = 48,
    rate: int = 2,
    window: int | None = None,
    topk: int = 7,
) -> None:
    """The cache-sharing contract from a backend's side (DeepSeek-V4.1's readers): two layers
    of one step whose ``compressed`` cache is one tensor, each with its own window keys,
    queries, sinks and picks. Each call matches the float64 oracle, and neither writes
    anything: the shared entries stay the source's, unchanged, whatever layer reads them
    (a backend that keyed state by layer or by cache tensor would fail one of the two)."""
    if kind == "sliding":
        raise ValueError("a sliding layer reads no compressed entries: nothing is shared")
    gen = torch.Generator().manual_seed(seed)
    window = block_size + 3 if window is None else window
    layer = v4_layer(num_heads, head_size)
    source = _v4_case(
        kind, layer, lengths, block_size=block_size, window=window, rate=rate, topk=topk, dtype=dtype,
        device=device, gen=gen,
    )  # fmt: skip
    reader = _reader_of(source, kind, window, rate, topk, gen)
    assert reader.cache["compressed"] is source.cache["compressed"]
    shared = source.cache["compressed"].clone()
    atol, rtol = tolerance
    for name, case in (("source", source), ("reader", reader)):
        where = (
            f"V4 attention over shared entries, {kind} {name} layer: context_lens={case.context_lens} "
            f"query_lens={case.query_lens} window={window} rate={rate} block_size={block_size} (seed={seed})"
        )
        own = case.cache["kv"].clone()
        got = _call(backend, kind, layer, case, window, rate, case.entry_indices)
        torch.testing.assert_close(
            got[: case.query.shape[0]].detach().cpu().double(),
            _oracle(kind, layer, case, window, rate),
            atol=atol,
            rtol=rtol,
            msg=lambda detail, where=where: f"differs from the float64 oracle: {where}\n{detail}",
        )
        assert torch.equal(case.cache["kv"], own), f"forward_v4 wrote the layer's window cache: {where}"
        assert torch.equal(case.cache["compressed"], shared), f"forward_v4 wrote the shared entries: {where}"


def check_v4_attention_refuses(
    backend: Any,
    *,
    lengths: Sequence[tuple[int, int]],
    block_size: int,
    dtype: torch.dtype,
    seed: int,
    device: torch.device | str = "cpu",
    bad_row: str = "prefill",
    rate: int = 4,
) -> None:
    """Plant one entry past its sequence's ``seq_len // rate`` in a ``decode`` or ``prefill``
    row (or ``below-minus-one``) of a CSA layer and assert ``forward_v4`` raises a
    ValueError naming the row, the entry and the length (or refuses it on the device,
    raised by ``metadata.raise_refused()``). ``lengths``: a decode first, a prefill last."""
    gen = torch.Generator().manual_seed(seed)
    layer, window = v4_layer(20, 48), block_size + 3
    case = _v4_case(
        "csa",
        layer,
        lengths,
        block_size=block_size,
        window=window,
        rate=rate,
        topk=7,
        dtype=dtype,
        device=device,
        gen=gen,
    )
    assert case.query_lens[0] == 1 and case.query_lens[-1] > 1, f"need a decode first and a prefill last: {lengths}"
    starts = [0, *itertools.accumulate(case.query_lens)]
    sequence = 0 if bad_row == "decode" else len(case.query_lens) - 1
    row = starts[sequence] if bad_row == "decode" else _randint(gen, starts[sequence], starts[sequence + 1] - 1)
    seq_len = case.seq_lens[sequence]
    bad = -2 - _randint(gen, 0, 5) if bad_row == "below-minus-one" else seq_len // rate + _randint(gen, 0, 3)
    indices = case.entry_indices.clone()
    indices[row, _randint(gen, 0, indices.shape[1] - 1)] = bad
    where = f"entry {bad} in query row {row} of a sequence of {seq_len} tokens ({bad_row}) (seed={seed})"
    with pytest.raises(ValueError) as refused:
        _call(backend, "csa", layer, case, window, rate, indices)
    assert_names_numbers(str(refused.value), ((row, "row"), (bad, "entry"), (seq_len, "length")), where)

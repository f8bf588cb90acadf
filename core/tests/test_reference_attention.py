"""The reference attention backend against a float64 oracle, and against its own suite.

The oracle knows nothing about paging: it holds each sequence's whole key/value
history as one dense float64 tensor and computes causal softmax attention head by
head with explicit exp/sum. The backend under test gets the same numbers through a
paged cache whose unused slots are NaN, so reading anything outside a sequence
poisons its output.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import pairwise

import attrs
import pytest
import torch

from powertrain.builtin.bucketed_attention import BucketedAttention
from powertrain.builtin.reference_attention import TorchReferenceAttention
from powertrain.interfaces import (
    AttentionBackend,
    AttentionLayerSpec,
    AttentionMetadata,
    LayerKVCache,
    MLAAttentionBackend,
    SparseMLAAttentionBackend,
)
from powertrain.testing import AttentionBackendSuite, check_sparse_mla, check_sparse_mla_refuses, fresh_seed


class TestReferenceConformance(AttentionBackendSuite):
    """The reference must pass the kit it defines (a sanity check of the kit, too)."""

    component = "torch-reference"


@pytest.fixture
def seed() -> int:
    return fresh_seed()


# --------------------------------------------------------------------------- setup


@attrs.frozen(kw_only=True)
class Paged:
    """A batch laid out in a paged cache, plus the dense history the oracle reads."""

    metadata: AttentionMetadata
    cache: dict[str, torch.Tensor]
    #: per sequence, name -> [seq_len, ...] dense history (context then new tokens)
    history: list[dict[str, torch.Tensor]]
    #: name -> [num_tokens, ...] this step's new tokens, flat
    new: dict[str, torch.Tensor]


def page(
    backend: TorchReferenceAttention,
    layer: AttentionLayerSpec,
    lengths: Sequence[tuple[int, int]],
    per_token: dict[str, tuple[int, ...]],
    block_size: int,
    dtype: torch.dtype,
    gen: torch.Generator,
) -> Paged:
    """Random histories for ``(context_len, query_len)`` sequences, context pre-cached.

    Blocks are drawn at random from a pool twice the needed size; everything not
    written is NaN.
    """
    seq_lens = [c + q for c, q in lengths]
    needed = [math.ceil(s / block_size) for s in seq_lens]
    pool = torch.randperm(2 * sum(needed) + 1, generator=gen).tolist()
    tables, used = [], 0
    for count in needed:
        tables.append(pool[used : used + count])
        used += count
    cache = backend.kv_cache_spec(layer, block_size, dtype).allocate(len(pool), "cpu")
    for tensor in cache.values():
        tensor.fill_(float("nan"))

    history = []
    for (context, _), seq_len, blocks in zip(lengths, seq_lens, tables, strict=True):
        seq = {name: torch.randn((seq_len, *shape), generator=gen).to(dtype) for name, shape in per_token.items()}
        for pos in range(context):
            for name, values in seq.items():
                cache[name][blocks[pos // block_size], pos % block_size] = values[pos]
        history.append(seq)
    new = {name: torch.cat([seq[name][c:] for seq, (c, _) in zip(history, lengths, strict=True)]) for name in per_token}
    metadata = AttentionMetadata.build(
        query_lens=[q for _, q in lengths], seq_lens=seq_lens, block_tables=tables, block_size=block_size
    )
    return Paged(metadata=metadata, cache=cache, history=history, new=new)


def causal_softmax(scores: torch.Tensor, context: int, window: int | None, causal: bool = True) -> torch.Tensor:
    """Row-wise softmax of [q_len, seq_len] scores over the positions each query may see
    (not ``causal``: the later new tokens too)."""
    q_len, seq_len = scores.shape
    visible = torch.zeros(q_len, seq_len, dtype=torch.bool)
    for j in range(q_len):
        me = context + j
        if causal:
            first = 0 if window is None else max(0, me - window + 1)
            visible[j, first : me + 1] = True
        else:  # every new token, and the window before the first of them
            visible[j, 0 if window is None else max(0, context - window) :] = True
    exp = torch.where(visible, torch.exp(scores - scores.max(dim=-1, keepdim=True).values), 0.0)
    return exp / exp.sum(dim=-1, keepdim=True)


def gqa_oracle(layer: AttentionLayerSpec, paged: Paged, query: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(query.shape, dtype=torch.float64)
    group = layer.num_heads // layer.num_kv_heads
    starts = paged.metadata.query_start_loc_host
    for i, seq in enumerate(paged.history):
        start, end = starts[i], starts[i + 1]
        context = seq["key"].shape[0] - (end - start)
        for h in range(layer.num_heads):
            q = query[start:end, h].double()
            k = seq["key"][:, h // group].double()
            v = seq["value"][:, h // group].double()
            probs = causal_softmax(q @ k.T * layer.scale, context, layer.sliding_window, layer.causal)
            out[start:end, h] = probs @ v
    return out


def mla_oracle(layer: AttentionLayerSpec, paged: Paged, q_latent: torch.Tensor, q_rope: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(q_latent.shape, dtype=torch.float64)
    starts = paged.metadata.query_start_loc_host
    for i, seq in enumerate(paged.history):
        start, end = starts[i], starts[i + 1]
        context = seq["latent"].shape[0] - (end - start)
        latent, rope = seq["latent"].double(), seq["rope"].double()
        for h in range(layer.num_heads):
            scores = layer.scale * (q_latent[start:end, h].double() @ latent.T + q_rope[start:end, h].double() @ rope.T)
            out[start:end, h] = causal_softmax(scores, context, None) @ latent
    return out


def gqa_layer(
    num_heads: int, num_kv_heads: int, head_size: int = 16, window: int | None = None, causal: bool = True
) -> AttentionLayerSpec:
    return AttentionLayerSpec(
        kind="gqa",
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        scale=head_size**-0.5,
        sliding_window=window,
        causal=causal,
    )


# (context_len, query_len) per sequence, decodes first.
BATCHES = {
    "prefill": [(0, 9), (0, 1 + 16), (0, 3), (0, 33)],
    "decode": [(0, 1), (15, 1), (16, 1), (40, 1)],
    "mixed": [(7, 1), (31, 1), (0, 12), (0, 2)],
    "chunked": [(20, 1), (16, 16), (15, 2), (17, 15), (4, 29)],
}


# --------------------------------------------------------------------------- tests


def test_satisfies_both_protocols() -> None:
    backend = TorchReferenceAttention()
    assert isinstance(backend, AttentionBackend)
    assert isinstance(backend, MLAAttentionBackend)
    assert isinstance(backend, SparseMLAAttentionBackend)


def test_kv_cache_specs() -> None:
    backend = TorchReferenceAttention()
    gqa = backend.kv_cache_spec(gqa_layer(8, 2, head_size=32), 16, torch.bfloat16)
    assert [(t.name, t.shape) for t in gqa.tensors] == [("key", (2, 32)), ("value", (2, 32))]
    assert gqa.bytes_per_token == 2 * 2 * 32 * 2
    mla = backend.kv_cache_spec(
        AttentionLayerSpec(
            kind="mla", num_heads=16, num_kv_heads=1, head_size=576, scale=0.1, kv_lora_rank=512, qk_rope_head_dim=64
        ),
        16,
        torch.bfloat16,
    )
    assert [(t.name, t.shape) for t in mla.tensors] == [("latent", (512,)), ("rope", (64,))]
    assert mla.bytes_per_token == 576 * 2


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (8, 2)], ids=["mha", "gqa4"])
def test_gqa_matches_oracle(batch: str, num_heads: int, num_kv_heads: int, block_size: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    backend = TorchReferenceAttention()
    layer = gqa_layer(num_heads, num_kv_heads)
    shape = (num_kv_heads, layer.head_size)
    paged = page(backend, layer, BATCHES[batch], {"key": shape, "value": shape}, block_size, torch.float32, gen)
    query = torch.randn(paged.metadata.num_tokens, num_heads, layer.head_size, generator=gen)

    out = backend.forward(layer, query, paged.new["key"], paged.new["value"], paged.cache, paged.metadata)

    assert out.dtype == torch.float32 and out.shape == query.shape
    torch.testing.assert_close(
        out.double(), gqa_oracle(layer, paged, query), atol=1e-5, rtol=1e-5, msg=lambda m: f"{m}\n(seed={seed})"
    )


@pytest.mark.parametrize("window", [1, 5, 16])
def test_sliding_window_matches_oracle(window: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    backend = TorchReferenceAttention()
    layer = gqa_layer(4, 2, window=window)
    shape = (2, layer.head_size)
    paged = page(backend, layer, BATCHES["chunked"], {"key": shape, "value": shape}, 4, torch.float32, gen)
    query = torch.randn(paged.metadata.num_tokens, 4, layer.head_size, generator=gen)

    out = backend.forward(layer, query, paged.new["key"], paged.new["value"], paged.cache, paged.metadata)

    torch.testing.assert_close(
        out.double(), gqa_oracle(layer, paged, query), atol=1e-5, rtol=1e-5, msg=lambda m: f"{m}\n(seed={seed})"
    )


def test_bfloat16_inputs_are_computed_in_float32(seed: int) -> None:
    """Only the final rounding to bf16 may separate it from the exact answer."""
    gen = torch.Generator().manual_seed(seed)
    backend = TorchReferenceAttention()
    layer = gqa_layer(8, 2)
    shape = (2, layer.head_size)
    paged = page(backend, layer, BATCHES["chunked"], {"key": shape, "value": shape}, 16, torch.bfloat16, gen)
    query = torch.randn(paged.metadata.num_tokens, 8, layer.head_size, generator=gen).to(torch.bfloat16)

    out = backend.forward(layer, query, paged.new["key"], paged.new["value"], paged.cache, paged.metadata)

    assert out.dtype == torch.bfloat16
    exact = gqa_oracle(layer, paged, query)
    # One bf16 rounding of the output: half an ulp, 2**-9 relative.
    torch.testing.assert_close(out.double(), exact, atol=1e-6, rtol=2**-8, msg=lambda m: f"{m}\n(seed={seed})")


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("batch", ["mixed", "chunked"])
def test_mla_matches_oracle(batch: str, block_size: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    backend = TorchReferenceAttention()
    rank, rope = 32, 16
    layer = AttentionLayerSpec(
        kind="mla",
        num_heads=4,
        num_kv_heads=1,
        head_size=rank + rope,
        scale=0.15,
        kv_lora_rank=rank,
        qk_rope_head_dim=rope,
    )
    paged = page(backend, layer, BATCHES[batch], {"latent": (rank,), "rope": (rope,)}, block_size, torch.float32, gen)
    q_latent = torch.randn(paged.metadata.num_tokens, 4, rank, generator=gen)
    q_rope = torch.randn(paged.metadata.num_tokens, 4, rope, generator=gen)

    out = backend.forward_mla(
        layer, q_latent, q_rope, paged.new["latent"], paged.new["rope"], paged.cache, paged.metadata
    )

    assert out.shape == q_latent.shape
    torch.testing.assert_close(
        out.double(),
        mla_oracle(layer, paged, q_latent, q_rope),
        atol=1e-5,
        rtol=1e-5,
        msg=lambda m: f"{m}\n(seed={seed})",
    )


def test_padding_slots_are_not_written(seed: int) -> None:
    """A runner may pad the flat batch past num_tokens (slot -1): those rows write nothing."""
    gen = torch.Generator().manual_seed(seed)
    backend = TorchReferenceAttention()
    layer = gqa_layer(4, 2)
    shape = (2, layer.head_size)
    paged = page(backend, layer, BATCHES["prefill"], {"key": shape, "value": shape}, 4, torch.float32, gen)
    slots = torch.cat([paged.metadata.slot_mapping, torch.tensor([-1, -1])])
    metadata = attrs.evolve(paged.metadata, slot_mapping=slots)
    rows = metadata.num_tokens + 2
    query = torch.randn(rows, 4, layer.head_size, generator=gen)
    key = torch.cat([paged.new["key"], torch.randn(2, *shape, generator=gen)])
    value = torch.cat([paged.new["value"], torch.randn(2, *shape, generator=gen)])

    backend.forward(layer, query, key, value, paged.cache, metadata)

    key_rows = paged.cache["key"].view(-1, *shape)
    real = slots[:-2]
    assert torch.equal(key_rows[real], paged.new["key"]), f"new keys not at their slots (seed={seed})"
    others = torch.ones(key_rows.shape[0], dtype=torch.bool)
    others[real] = False
    assert key_rows[others].isnan().all(), f"a padding row was written somewhere (seed={seed})"


class TestBucketedConformance(AttentionBackendSuite):
    """The default portable backend against the reference, through the kit."""

    component = "torch-bucketed"


# --------------------------------------------------------------------------- sparse MLA

MLA_LAYER = AttentionLayerSpec(
    kind="mla", num_heads=4, num_kv_heads=1, head_size=48, scale=48**-0.5, kv_lora_rank=32, qk_rope_head_dim=16
)
# Decodes at block edges first, then a chunk after a cached context and a prefill spanning blocks.
SPARSE_LENGTHS = [(0, 1), (3, 1), (4, 1), (9, 1), (5, 3), (0, 11)]


class ShiftedByOne(TorchReferenceAttention):
    """Deliberately wrong: reads position p + 1 (wrapping at the sequence's end) for p."""

    def forward_mla_sparse(self, layer, q_latent, q_rope, latent, k_rope, kv_cache, metadata, indices):
        lengths = torch.repeat_interleave(metadata.seq_lens, torch.tensor(metadata.query_lens_host))[:, None]
        shifted = torch.where(indices >= 0, (indices + 1) % lengths, indices).to(torch.int32)
        return super().forward_mla_sparse(layer, q_latent, q_rope, latent, k_rope, kv_cache, metadata, shifted)


class NeighboursTable(TorchReferenceAttention):
    """Deliberately wrong: maps positions through the next sequence's block table."""

    def forward_mla_sparse(self, layer, q_latent, q_rope, latent, k_rope, kv_cache, metadata, indices):
        metadata.check_sparse_indices(indices)  # the right lengths, the wrong table
        wrong = attrs.evolve(metadata, block_tables=metadata.block_tables.roll(1, dims=0))
        return super().forward_mla_sparse(layer, q_latent, q_rope, latent, k_rope, kv_cache, wrong, indices)


class AddsCausalMask(TorchReferenceAttention):
    """Wrong by the contract: drops listed positions after the query's own."""

    def forward_mla_sparse(self, layer, q_latent, q_rope, latent, k_rope, kv_cache, metadata, indices):
        own = torch.cat(
            [torch.arange(c, s) for c, s in zip(metadata.context_lens_host, metadata.seq_lens_host, strict=True)]
        )
        causal = torch.where(indices > own[:, None], -1, indices).to(torch.int32)
        return super().forward_mla_sparse(layer, q_latent, q_rope, latent, k_rope, kv_cache, metadata, causal)


@pytest.mark.parametrize(
    "backend",
    [ShiftedByOne, NeighboursTable, AddsCausalMask],
    ids=["shifted-by-one", "neighbours-table", "adds-causal-mask"],
)
def test_the_sparse_kit_catches_a_wrong_index_mapping(backend: type, seed: int) -> None:
    """The kit's check can fail: a backend that maps indices to the wrong tokens is caught."""
    with pytest.raises(AssertionError, match="sparse MLA output differs from the float64 oracle") as failed:
        check_sparse_mla(
            backend(),
            layer=MLA_LAYER,
            lengths=SPARSE_LENGTHS,
            block_size=4,
            dtype=torch.float32,
            seed=seed,
            tolerance=(1e-4, 1e-4),
        )
    print(str(failed.value))


def test_the_reference_passes_the_sparse_check_directly(seed: int) -> None:
    check_sparse_mla(
        TorchReferenceAttention(),
        layer=MLA_LAYER,
        lengths=SPARSE_LENGTHS,
        block_size=4,
        dtype=torch.float64,
        seed=seed,
        tolerance=(1e-12, 1e-12),
    )


def test_the_refusal_check_catches_a_backend_that_does_not_check(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the index check, an index past the sequence's end reads another token (a
    zero block-table entry past the sequence's blocks) or falls off the table and
    crashes: either way the kit's check fails, since nothing refused it."""
    monkeypatch.setattr(AttentionMetadata, "check_sparse_indices", lambda self, indices: None)
    with pytest.raises((pytest.fail.Exception, IndexError), match="DID NOT RAISE|out of bounds") as failed:
        check_sparse_mla_refuses(
            TorchReferenceAttention(),
            layer=MLA_LAYER,
            lengths=SPARSE_LENGTHS,
            block_size=4,
            dtype=torch.float32,
            seed=seed,
            bad_row="prefill",
        )
    print(str(failed.value))


def test_refused_sparse_step_leaves_the_cache_untouched(seed: int) -> None:
    """The reference checks the indices before writing: a refused step changes nothing."""
    gen = torch.Generator().manual_seed(seed)
    backend = TorchReferenceAttention()
    per_token = {"latent": (32,), "rope": (16,)}
    paged = page(backend, MLA_LAYER, SPARSE_LENGTHS, per_token, 4, torch.float32, gen)
    tokens = paged.metadata.num_tokens
    indices = torch.full((tokens, 5), -1, dtype=torch.int32)
    indices[:, 0] = 0
    indices[tokens - 1, 3] = paged.metadata.seq_lens_host[-1]  # one past the prefill's last token
    before: LayerKVCache = {name: t.clone() for name, t in paged.cache.items()}
    q_latent = torch.randn(tokens, 4, 32, generator=gen)
    q_rope = torch.randn(tokens, 4, 16, generator=gen)

    with pytest.raises(ValueError, match=rf"sparse index 11 at query row {tokens - 1} .*seq_len=11"):
        backend.forward_mla_sparse(
            MLA_LAYER, q_latent, q_rope, paged.new["latent"], paged.new["rope"], paged.cache, paged.metadata, indices
        )
    for name, tensor in paged.cache.items():
        assert torch.equal(tensor.nan_to_num(7.0), before[name].nan_to_num(7.0)), f"{name} changed (seed={seed})"


def test_sparse_over_every_visible_position_equals_dense_mla(seed: int) -> None:
    """Listing each token's causal positions makes sparse MLA the dense forward_mla."""
    gen = torch.Generator().manual_seed(seed)
    backend = TorchReferenceAttention()
    per_token = {"latent": (32,), "rope": (16,)}
    paged = page(backend, MLA_LAYER, SPARSE_LENGTHS, per_token, 4, torch.float64, gen)
    metadata = paged.metadata
    topk = metadata.max_seq_len + 2
    indices = torch.full((metadata.num_tokens, topk), -1, dtype=torch.int32)
    for i, (start, end) in enumerate(pairwise(metadata.query_start_loc_host)):
        context = metadata.context_lens_host[i]
        for j in range(end - start):
            indices[start + j, torch.randperm(topk, generator=gen)[: context + j + 1]] = torch.arange(
                context + j + 1, dtype=torch.int32
            )
    tokens = metadata.num_tokens
    q_latent = torch.randn(tokens, 4, 32, generator=gen, dtype=torch.float64)
    q_rope = torch.randn(tokens, 4, 16, generator=gen, dtype=torch.float64)
    dense_cache = {name: t.clone() for name, t in paged.cache.items()}
    new = (paged.new["latent"], paged.new["rope"])

    sparse = backend.forward_mla_sparse(MLA_LAYER, q_latent, q_rope, *new, paged.cache, metadata, indices)
    dense = backend.forward_mla(MLA_LAYER, q_latent, q_rope, *new, dense_cache, metadata)

    torch.testing.assert_close(sparse, dense, atol=1e-12, rtol=1e-12, msg=lambda m: f"{m}\n(seed={seed})")


@pytest.mark.parametrize("tokens_per_entry", [1, 4])
def test_refusing_on_the_device_reads_refused_indices_as_padding_and_raises_after(
    seed: int, tokens_per_entry: int
) -> None:
    """``refuse_sparse_indices`` (a captured step's check, no sync): every out-of-range
    index reads as -1, the rest unchanged, and ``raise_refused`` raises what the host
    check would for the step's first refusal, in any window view; nothing without one."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [9, 14, 23]
    tables = {
        None: [[1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11, 12, 13]],
        8: [[0, 0, 3], [0, 0, 6, 7], [0, 0, 0, 0, 12, 13]],
    }
    metadata = AttentionMetadata.build(query_lens=[1, 1, 5], seq_lens=lengths, block_tables=tables, block_size=4)
    tokens, width = metadata.num_tokens, 6
    sequences = metadata.token_sequences.tolist()
    bounds = torch.tensor([lengths[s] // tokens_per_entry for s in sequences])[:, None]
    good = (torch.rand(tokens, width, generator=gen) * bounds).to(torch.int32)
    good[torch.rand(tokens, width, generator=gen) < 0.3] = -1
    assert metadata.refuse_sparse_indices(good, tokens_per_entry).equal(good)
    metadata.raise_refused()  # nothing refused
    metadata.check_sparse_indices(good, tokens_per_entry)

    bad = good.clone()
    row = int(torch.randint(0, tokens, (1,), generator=gen))
    column = int(torch.randint(0, width - 1, (1,), generator=gen))
    bad[row, column] = int(bounds[row]) + int(torch.randint(0, 3, (1,), generator=gen))
    bad[tokens - 1, width - 1] = -5  # a later refusal: the first one is reported
    view = metadata.for_window(8)  # a layer of another retention class refuses through its view
    cleaned = view.refuse_sparse_indices(bad, tokens_per_entry)
    expected = good.clone()
    expected[row, column] = -1
    expected[tokens - 1, width - 1] = -1
    assert cleaned.equal(expected)
    with pytest.raises(ValueError) as on_host:
        metadata.check_sparse_indices(bad, tokens_per_entry)
    with pytest.raises(ValueError) as after:
        metadata.raise_refused()
    assert str(after.value) == str(on_host.value)
    assert f"sparse index {bad[row, column]} at query row {row} (column {column})" in str(after.value)


@pytest.mark.parametrize("window", [None, 5], ids=["full", "window-5"])
@pytest.mark.parametrize("batch", ["chunked", "prefill"])
def test_non_causal_matches_oracle(batch: str, window: int | None, seed: int) -> None:
    """A block drafter's layer (``causal`` False): each new token sees all of its sequence's
    keys, the step's later ones too, or with a window the window before the first new
    token and all new ones; both builtin backends against the float64 oracle."""
    gen = torch.Generator().manual_seed(seed)
    layer = gqa_layer(8, 2, window=window, causal=False)
    shape = (2, layer.head_size)
    per_token = {"key": shape, "value": shape}
    paged = page(TorchReferenceAttention(), layer, BATCHES[batch], per_token, 4, torch.float32, gen)
    query = torch.randn(paged.metadata.num_tokens, 8, layer.head_size, generator=gen)
    want = gqa_oracle(layer, paged, query)
    causal = gqa_oracle(attrs.evolve(layer, causal=True), paged, query)
    assert (want - causal).abs().max() > 0.1, "the batch must make non-causal differ from causal"
    for backend in (TorchReferenceAttention(), BucketedAttention()):
        cache = {name: tensor.clone() for name, tensor in paged.cache.items()}
        out = backend.forward(layer, query, paged.new["key"], paged.new["value"], cache, paged.metadata)
        torch.testing.assert_close(
            out.double(), want, atol=1e-5, rtol=1e-5, msg=lambda m, b=backend: f"{b.name}: {m}\n(seed={seed})"
        )


def test_non_causal_needs_a_gqa_layer() -> None:
    with pytest.raises(ValueError, match="causal=False"):
        AttentionLayerSpec(kind="mla", num_heads=4, num_kv_heads=1, head_size=8, scale=0.3, causal=False)


class _AttendsToWrite:
    """The reference backend without ``store_kv``: a backend that must attend to write."""

    name = "attends-to-write"

    def __init__(self) -> None:
        self._inner = TorchReferenceAttention()
        self.kv_cache_spec = self._inner.kv_cache_spec
        self.forward = self._inner.forward


def test_attention_store_writes_what_forward_writes_with_or_without_kv_store(seed: int) -> None:
    """``layers.attention.Attention.store`` (a block drafter's context write): on a ``kv-store``
    backend it rotates the keys itself and attends nothing; on one without, it goes through
    ``forward``. Both leave the cache ``forward`` leaves, on fresh random rows."""
    from powertrain.interfaces import KVStoreAttentionBackend
    from powertrain.layers.attention import Attention

    gen = torch.Generator().manual_seed(seed)
    spec = AttentionLayerSpec(kind="gqa", num_heads=4, num_kv_heads=2, head_size=8, scale=8**-0.5, causal=False)
    query_lens, seq_lens, block_size = [3, 1], [7, 5], 4
    meta = AttentionMetadata.build(
        query_lens=query_lens, seq_lens=seq_lens, block_tables=[[2, 0], [1, 3]], block_size=block_size, device="cpu"
    )
    tokens = sum(query_lens)
    query = torch.randn(tokens, 4, 8, generator=gen)
    key, value = torch.randn(2, tokens, 2, 8, generator=gen)
    angles = torch.rand(tokens, 4, generator=gen) * 2 * math.pi
    rotary = (angles.cos(), angles.sin())
    backends = [TorchReferenceAttention(), _AttendsToWrite()]
    assert [isinstance(b, KVStoreAttentionBackend) for b in backends] == [True, False]
    start = {name: torch.randn(4, block_size, 2, 8, generator=gen) for name in ("key", "value")}
    caches = []
    for backend in [*backends, TorchReferenceAttention()]:
        cache = {name: t.clone() for name, t in start.items()}
        layer = Attention(spec, backend)
        if len(caches) < 2:
            layer.store(query, key, value, cache, meta, rotary=rotary)
        else:  # the oracle: forward itself
            layer(query, key, value, cache, meta, rotary=rotary)
        caches.append(cache)
    stored, attended, forward = caches
    for name in start:
        assert not torch.equal(forward[name], start[name])
        assert torch.equal(stored[name], forward[name]), name
        assert torch.equal(attended[name], forward[name]), name

"""Cache groups (``CacheGroupSpec``): a layer's model-declared tensors with their own
granularity and retention, allocated per retention class beside the backend's cache,
counted by ``engine.cache_layout``, sized per class from a budget."""

from __future__ import annotations

import math
import random

import pytest
import torch

from powertrain.builtin.reference_attention import TorchReferenceAttention
from powertrain.engine.cache_layout import cache_layout
from powertrain.interfaces import AttentionLayerSpec, AttentionMetadata, CacheGroupSpec, KVCacheSpec, KVTensorSpec


def mla_layer(groups: tuple[CacheGroupSpec, ...] = ()) -> AttentionLayerSpec:
    return AttentionLayerSpec(
        kind="mla",
        num_heads=4,
        num_kv_heads=1,
        head_size=40,
        scale=0.1,
        kv_lora_rank=32,
        qk_rope_head_dim=8,
        cache_groups=groups,
    )


def gqa_layer(window: int | None) -> AttentionLayerSpec:
    return AttentionLayerSpec(kind="gqa", num_heads=4, num_kv_heads=2, head_size=8, scale=0.3, sliding_window=window)


def spec_of(layer: AttentionLayerSpec, block_size: int, dtype: torch.dtype = torch.float32) -> KVCacheSpec:
    return TorchReferenceAttention().kv_cache_spec(layer, block_size, dtype)


def test_a_layer_without_groups_is_its_backend_cache_in_one_class() -> None:
    layer = mla_layer()
    assert layer.windows == {None}
    (group,) = layer.groups(spec_of(layer, 4))
    assert group.name == "attention" and group.sliding_window is None and group.tokens_per_entry == 1
    cache = layer.allocate_cache(spec_of(layer, 4), {None: 5}, "cpu")
    assert set(cache) == {"latent", "rope"} and cache["latent"].shape == (5, 4, 32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_token_groups_share_the_blocks_and_are_counted(dtype: torch.dtype) -> None:
    dim, extra = random.randint(3, 40), random.randint(1, 5)
    block_size, num_blocks = random.choice([2, 4, 16]), random.randint(3, 9)
    tensors = (KVTensorSpec(name="index_keys", shape=(dim,)), KVTensorSpec(name="other", shape=(2, extra)))
    layer = mla_layer((CacheGroupSpec(name="indexer", tensors=tensors),))
    backend = spec_of(layer, block_size, dtype)
    cache = layer.allocate_cache(backend, num_blocks, "cpu")
    assert set(cache) == {"latent", "rope", "index_keys", "other"}
    assert cache["index_keys"].shape == (num_blocks, block_size, dim) and cache["index_keys"].dtype == dtype
    assert cache["other"].shape == (num_blocks, block_size, 2, extra)
    assert cache["latent"].shape[:2] == cache["index_keys"].shape[:2]  # same blocks, same slots
    itemsize = torch.empty((), dtype=dtype).element_size()
    per_token = (dim + 2 * extra) * itemsize
    layout = cache_layout([layer, mla_layer(), layer], [backend] * 3)
    indexer = next(g for g in layout.groups if g.name == "indexer")
    assert indexer.layers == 2 and indexer.bytes_per_token == 2 * per_token
    assert layout.bytes_per_token == 3 * backend.bytes_per_token + 2 * per_token
    assert layout.bytes_per_block == {None: int(layout.bytes_per_token) * block_size}
    assert sum(t.nbytes for t in cache.values()) == layer.bytes_per_block(backend)[None] * num_blocks


def test_a_compressed_group_holds_one_entry_per_m_tokens_of_its_block() -> None:
    m, block_size, num_blocks = 4, 16, 3
    group = CacheGroupSpec(name="compressed", tensors=(KVTensorSpec(name="entries", shape=(6,)),), tokens_per_entry=m)
    layer = mla_layer((group,))
    backend = spec_of(layer, block_size)
    cache = layer.allocate_cache(backend, num_blocks, "cpu")
    assert cache["entries"].shape == (num_blocks, block_size // m, 6)
    assert group.bytes_per_token(block_size, torch.float32) == 6 * 4 / m
    with pytest.raises(ValueError, match=r"one entry per 4 tokens.*block_size to a multiple of 4"):
        layer.allocate_cache(spec_of(layer, 2), num_blocks, "cpu")


def test_sliding_classes_get_their_own_blocks_and_a_zeroed_null_block() -> None:
    window = random.randint(3, 40)
    ring = CacheGroupSpec(name="ring", tensors=(KVTensorSpec(name="open", shape=(5,)),), sliding_window=window)
    layer = mla_layer((ring,))
    assert layer.windows == {None, window}
    cache = layer.allocate_cache(spec_of(layer, 4), {None: 7, window: 3}, "cpu")
    assert cache["latent"].shape[0] == 7
    assert cache["open"].shape == (4, 4, 5)  # 3 usable blocks + the null block
    assert torch.equal(cache["open"][3], torch.zeros(4, 5))
    sliding = gqa_layer(window)
    kv = sliding.allocate_cache(spec_of(sliding, 4), {window: 2}, "cpu")
    assert kv["key"].shape[0] == 3 and not kv["key"][2].any() and not kv["value"][2].any()


def test_names_that_clash_are_refused() -> None:
    layer = mla_layer((CacheGroupSpec(name="bad", tensors=(KVTensorSpec(name="latent", shape=(3,)),)),))
    with pytest.raises(ValueError, match=r"cache group 'bad' tensors \['latent'\] clash"):
        layer.allocate_cache(spec_of(layer, 4), 2, "cpu")


@pytest.mark.parametrize("bad", [{"tokens_per_entry": 0}, {"sliding_window": 0}, {"tokens_per_entry": 1.5}])
def test_bad_group_declarations_are_refused(bad: dict) -> None:
    with pytest.raises(ValueError, match="cache group 'g'"):
        CacheGroupSpec(name="g", tensors=(KVTensorSpec(name="t", shape=(2,)),), **bad)


def test_sliding_pools_are_sized_by_what_running_sequences_can_hold() -> None:
    block_size, window = 16, 100
    layers = [gqa_layer(None), gqa_layer(window)]
    layout = cache_layout(layers, [spec_of(layer, block_size) for layer in layers])
    per_block = spec_of(layers[0], block_size).bytes_per_block
    assert layout.bytes_per_block == {None: per_block, window: per_block}
    budget = 10_000 * per_block
    counts = layout.num_blocks(budget, max_num_seqs=4, max_num_batched_tokens=64)
    bound = 4 * (math.ceil((window - 1) / block_size) + 2) + 64 // block_size
    assert counts[window] == bound
    assert counts[None] == 10_000 - bound - 1  # the rest, less the sliding pool's null block
    assert layout.bytes_for(counts) <= budget
    # A tight budget: the sliding pool never gets more blocks than the full one.
    small = layout.num_blocks(40 * per_block, max_num_seqs=4, max_num_batched_tokens=64)
    assert small[window] <= small[None] and layout.bytes_for(small) <= 40 * per_block
    # Only sliding layers: the budget splits evenly.
    only = cache_layout([gqa_layer(window)], [spec_of(layers[1], block_size)])
    assert only.num_blocks(11 * per_block, max_num_seqs=4, max_num_batched_tokens=64) == {window: 10}
    assert only.num_blocks(0, max_num_seqs=1, max_num_batched_tokens=1, fixed=5) == {window: 5}
    with pytest.raises(ValueError, match="holds no block"):
        only.num_blocks(per_block, max_num_seqs=1, max_num_batched_tokens=1)


def test_metadata_store_writes_group_tensors_at_the_slot_of_each_token() -> None:
    layer = mla_layer((CacheGroupSpec(name="indexer", tensors=(KVTensorSpec(name="index_keys", shape=(6,)),)),))
    cache = layer.allocate_cache(spec_of(layer, 4), 8, "cpu")
    keys = cache["index_keys"].fill_(float("nan"))
    tables = [[5, 2], [7]]
    metadata = AttentionMetadata.build(query_lens=[6, 3], seq_lens=[6, 3], block_tables=tables, block_size=4)
    new = torch.randn(9, 6)
    metadata.store(keys, new)
    assert torch.equal(keys[5], new[0:4]) and torch.equal(keys[2, :2], new[4:6]) and torch.equal(keys[7, :3], new[6:9])
    written = sum(int(torch.isfinite(keys[b]).all(dim=-1).sum()) for b in range(8))
    assert written == 9


def test_metadata_gives_each_retention_class_its_own_tables_and_slots() -> None:
    tables = {None: [[5, 2], [7]], 8: [[1, 0], [3]]}
    metadata = AttentionMetadata.build(query_lens=[2, 3], seq_lens=[6, 3], block_tables=tables, block_size=4)
    assert metadata.window is None and metadata.slot_mapping.tolist() == [2 * 4 + 0, 2 * 4 + 1, 28, 29, 30]
    sliding = metadata.for_window(8)
    assert sliding.window == 8 and sliding.block_tables.tolist() == [[1, 0], [3, 0]]
    assert sliding.slot_mapping.tolist() == [0, 1, 12, 13, 14]
    assert sliding.seq_lens_host == metadata.seq_lens_host and sliding.for_window(None).window is None
    assert metadata.for_window(8) is sliding  # built once per step
    with pytest.raises(ValueError, match="no block tables for retention class window=16"):
        metadata.for_window(16)
    # One class serves every layer whatever its window.
    single = AttentionMetadata.build(query_lens=[1], seq_lens=[1], block_tables=[[0]], block_size=4)
    assert single.for_window(8) is single

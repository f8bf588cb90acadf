"""Model-declared cache tensors (``AttentionLayerSpec.model_cache``): allocated beside the
backend's cache in the same blocks, counted in the memory accounting, merged per layer."""

from __future__ import annotations

import math
import random

import pytest
import torch

from powertrain.assemble.loading import model_cache_bytes_per_token
from powertrain.builtin.reference_attention import TorchReferenceAttention
from powertrain.interfaces import AttentionLayerSpec, AttentionMetadata, KVCacheSpec, KVTensorSpec


def mla_layer(model_cache: tuple[KVTensorSpec, ...] = ()) -> AttentionLayerSpec:
    return AttentionLayerSpec(
        kind="mla",
        num_heads=4,
        num_kv_heads=1,
        head_size=40,
        scale=0.1,
        kv_lora_rank=32,
        qk_rope_head_dim=8,
        model_cache=model_cache,
    )


def test_no_model_cache_allocates_only_the_backend_cache() -> None:
    layer = mla_layer()
    assert layer.model_cache == () and layer.model_cache_spec(4, torch.float32) is None
    backend = TorchReferenceAttention().kv_cache_spec(layer, 4, torch.float32)
    cache = layer.allocate_cache(backend, 5, "cpu")
    assert set(cache) == {"latent", "rope"}
    assert model_cache_bytes_per_token([layer, layer], 4, torch.float32) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_tensors_share_the_blocks_and_are_counted(dtype: torch.dtype) -> None:
    dim, extra = random.randint(3, 40), random.randint(1, 5)
    block_size, num_blocks = random.choice([2, 4, 16]), random.randint(3, 9)
    own = (KVTensorSpec(name="index_keys", shape=(dim,)), KVTensorSpec(name="other", shape=(2, extra)))
    layer = mla_layer(own)
    spec = layer.model_cache_spec(block_size, dtype)
    assert spec == KVCacheSpec(block_size=block_size, dtype=dtype, tensors=own, layout="block-token-major")
    backend = TorchReferenceAttention().kv_cache_spec(layer, block_size, dtype)
    cache = layer.allocate_cache(backend, num_blocks, "cpu")
    assert set(cache) == {"latent", "rope", "index_keys", "other"}
    assert cache["index_keys"].shape == (num_blocks, block_size, dim) and cache["index_keys"].dtype == dtype
    assert cache["other"].shape == (num_blocks, block_size, 2, extra)
    assert cache["latent"].shape[:2] == cache["index_keys"].shape[:2]  # same blocks, same slots
    itemsize = torch.empty((), dtype=dtype).element_size()
    per_token = (dim + 2 * extra) * itemsize
    assert spec.bytes_per_token == per_token
    assert model_cache_bytes_per_token([layer, mla_layer(), layer], block_size, dtype) == 2 * per_token
    stored = sum(cache[t.name].nbytes for t in own)
    assert stored == per_token * block_size * num_blocks == spec.bytes_per_block * num_blocks
    assert sum(t.nbytes for t in cache.values()) == (backend.bytes_per_block + spec.bytes_per_block) * num_blocks


def test_metadata_store_writes_model_tensors_at_the_slot_of_each_token() -> None:
    layer = mla_layer((KVTensorSpec(name="index_keys", shape=(6,)),))
    cache = layer.allocate_cache(TorchReferenceAttention().kv_cache_spec(layer, 4, torch.float32), 8, "cpu")
    keys = cache["index_keys"].fill_(float("nan"))
    tables = [[5, 2], [7]]
    metadata = AttentionMetadata.build(query_lens=[6, 3], seq_lens=[6, 3], block_tables=tables, block_size=4)
    new = torch.randn(9, 6)
    metadata.store(keys, new)
    assert torch.equal(keys[5], new[0:4]) and torch.equal(keys[2, :2], new[4:6]) and torch.equal(keys[7, :3], new[6:9])
    written = sum(int(torch.isfinite(keys[b]).all(dim=-1).sum()) for b in range(8))
    assert written == 9 == math.prod(new.shape[:1])


def test_a_model_tensor_named_like_the_backends_is_refused() -> None:
    layer = mla_layer((KVTensorSpec(name="latent", shape=(3,)),))
    backend = TorchReferenceAttention().kv_cache_spec(layer, 4, torch.float32)
    with pytest.raises(ValueError, match=r"\['latent'\] clash with the attention backend's"):
        layer.allocate_cache(backend, 2, "cpu")

"""Cache groups read across layers (``CacheGroupSpec.read_from``, DeepSeek-V4.1's layers
reading their KV source's compressed cache): one allocation at the source, the readers
given its tensors, counted and moved once, declarations checked with clear errors."""

from __future__ import annotations

import random

import pytest
import torch

from powertrain.engine.cache_layout import cache_layout
from powertrain.engine.kv_transfer import BlockMover
from powertrain.interfaces import (
    AttentionLayerSpec,
    CacheGroupSpec,
    KVCacheSpec,
    KVTensorSpec,
    allocate_caches,
    check_cache_sharing,
)

WINDOW = 8


def groups(width: int, rate: int) -> tuple[CacheGroupSpec, CacheGroupSpec]:
    """A V4.1-like source's groups: raw rows in a sliding window, compressed entries for the
    whole history."""
    return (
        CacheGroupSpec(name="rows", tensors=(KVTensorSpec(name="rows", shape=(width,)),), sliding_window=WINDOW),
        CacheGroupSpec(
            name="compressed", tensors=(KVTensorSpec(name="compressed", shape=(width,)),), tokens_per_entry=rate
        ),
    )


def window_group(width: int) -> CacheGroupSpec:
    return CacheGroupSpec(name="window", tensors=(KVTensorSpec(name="kv", shape=(width,)),), sliding_window=WINDOW)


def layer(*cache_groups: CacheGroupSpec) -> AttentionLayerSpec:
    return AttentionLayerSpec(
        kind="custom", num_heads=2, num_kv_heads=1, head_size=8, scale=0.3, cache_groups=cache_groups
    )


def custom_specs(layers: list[AttentionLayerSpec], block_size: int) -> list[KVCacheSpec]:
    return [KVCacheSpec(block_size=block_size, dtype=torch.float32, tensors=()) for _ in layers]


def shared_model(width: int, rate: int, readers: int) -> list[AttentionLayerSpec]:
    """Layer 0 owns its groups; ``readers`` layers after it read its compressed entries."""
    rows, compressed = groups(width, rate)
    source = layer(window_group(width), rows, compressed)
    return [source, *(layer(window_group(width), compressed.read_from(0)) for _ in range(readers))]


def test_readers_get_the_sources_tensors_and_nothing_is_allocated_twice() -> None:
    width, rate, readers = random.randint(3, 24), random.choice([1, 2, 4]), random.randint(1, 4)
    block_size, blocks = 4 * rate, random.randint(3, 9)
    layers = shared_model(width, rate, readers)
    caches = allocate_caches(layers, custom_specs(layers, block_size), blocks, "cpu")
    for cache in caches[1:]:
        assert set(cache) == {"kv", "compressed"}
        assert cache["compressed"] is caches[0]["compressed"]  # the same tensor: a write is seen by all
        assert cache["kv"].data_ptr() != caches[0]["kv"].data_ptr()  # each keeps its own window
    value = torch.randn(width)
    caches[0]["compressed"][1, 0] = value
    assert torch.equal(caches[-1]["compressed"][1, 0], value)
    # Counted once, at the source: per block, per token, and what sharing saves.
    per_block = {None: 0, WINDOW: 0}
    for spec in layers:
        for window, size in spec.bytes_per_block(custom_specs([spec], block_size)[0]).items():
            per_block[window] += size
    entry_bytes = width * 4 * (block_size // rate)
    assert per_block[None] == entry_bytes  # the source's compressed group only
    layout = cache_layout(layers, custom_specs(layers, block_size))
    assert layout.bytes_per_block[None] == entry_bytes
    report = layout.report()
    (compressed,) = [group for group in report["groups"] if group["name"] == "compressed"]
    saved = readers * width * 4 / rate
    assert compressed["layers"] == 1 and compressed["read_by_layers"] == readers
    assert compressed["saved_bytes_per_token"] == pytest.approx(saved)
    assert report["saved_by_sharing_bytes_per_token"] == pytest.approx(saved)
    assert report["unshared_bytes_per_token"] == pytest.approx(report["bytes_per_token"] + saved)


def test_a_model_without_sharing_reports_as_before() -> None:
    rows, compressed = groups(8, 2)
    layers = [layer(window_group(8), rows, compressed), layer(window_group(8), rows, compressed)]
    report = cache_layout(layers, custom_specs(layers, 4)).report()
    assert "saved_by_sharing_bytes_per_token" not in report
    assert all("read_by_layers" not in group for group in report["groups"])


def test_the_block_mover_copies_a_shared_group_once() -> None:
    """A block moved out and back in carries the source's entries once; the readers see
    them back through the same tensor."""
    layers = shared_model(6, 2, 2)
    caches = allocate_caches(layers, custom_specs(layers, 4), 5, "cpu")
    for cache in caches:
        for tensor in cache.values():
            tensor.normal_()
    mover = BlockMover(zip(layers, caches, strict=True), tiers=None, device=torch.device("cpu"))
    own = sum(t[0].numel() * t.element_size() for c in caches[:1] for n, t in c.items() if n == "compressed")
    assert mover.block_bytes[None] == own
    payload = mover._copy_out(None, 2)
    before = caches[0]["compressed"][2].clone()
    caches[0]["compressed"][2].zero_()
    mover._copy_in(None, 2, payload)
    assert torch.equal(caches[2]["compressed"][2], before)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (
            lambda c: [layer(c.read_from(1)), layer(c)],
            r"layer 0 reads cache group 'compressed' of layer 1: a layer can only read the group of an earlier layer",
        ),
        (lambda c: [layer(c), layer(c.read_from(1))], r"an earlier layer"),
        (
            lambda c: [layer(window_group(4)), layer(c.read_from(0))],
            r"of layer 0, which owns no such group \(its own: \['window'\]\)",
        ),
        (
            lambda c: [
                layer(c),
                layer(CacheGroupSpec(name="compressed", tensors=c.tensors, tokens_per_entry=4).read_from(0)),
            ],
            r"declared differently there .* than read here .*group.read_from\(source\)",
        ),
        (
            lambda c: [layer(c), layer(CacheGroupSpec(name="mine", tensors=c.tensors), c.read_from(0))],
            r"its tensors \['compressed'\] clash with the layer's other cache tensors",
        ),
    ],
    ids=["source-after-reader", "reads-itself", "source-lacks-group", "declared-differently", "name-clash"],
)
def test_bad_sharing_declarations_are_refused_with_what_to_change(build, message: str) -> None:
    _, compressed = groups(8, 2)
    layers = build(compressed)
    with pytest.raises(ValueError, match=message):
        check_cache_sharing(layers)
    with pytest.raises(ValueError, match=message):  # sizing refuses before anything is allocated
        cache_layout(layers, custom_specs(layers, 4))


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_a_source_layer_is_an_index(bad: object) -> None:
    with pytest.raises(ValueError, match="source_layer must be None or a layer index"):
        CacheGroupSpec(name="g", tensors=(KVTensorSpec(name="g", shape=(2,)),), source_layer=bad)

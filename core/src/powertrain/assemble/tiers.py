"""The tiers below the device cache, from ``[cache]`` and ``[components] kv_store``: the
stores, the copier between them and the cache, and the namespace that keeps a store
from ever mixing blocks of incompatible caches."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from powertrain import interfaces
from powertrain.assemble.planning import AssemblyError, Plan
from powertrain.engine.host_store import HostMemoryStore
from powertrain.engine.kv_tiers import KVTiers
from powertrain.engine.kv_transfer import BlockMover
from powertrain.interfaces.kv_store import KVStore, KVStoreContext

HOST_TIER = "host"
#: The component kinds whose arithmetic the cached values depend on.
COMPUTING_KINDS = ("platform", "attention", "moe", "quantized_linear")


def build_store(plan: Plan) -> tuple[str, KVStore] | None:
    """The storage tier ``[components] kv_store`` chose, by name; None without one."""
    resolution = plan.resolutions.get("kv_store")
    if resolution is None or resolution.provided is None:
        return None
    cache = plan.config.cache
    record = resolution.provided.record
    context = KVStoreContext(
        capacity_bytes=int(cache.store_gib * 2**30) if cache.store_gib is not None else None,
        path=cache.store_path,
        config=plan.sections.get(record.config_section) if record.config_section else None,
    )
    try:
        return record.name, record.factory(context)
    except (OSError, ValueError) as error:
        raise AssemblyError([f"[components] kv_store = {record.name!r}: {error}"]) from error


def build_tiers(plan: Plan) -> KVTiers | None:
    """The configured tiers, top first: host memory, then the chosen store; None if neither."""
    cache = plan.config.cache
    tiers: list[tuple[str, KVStore]] = []
    if cache.host_memory_gib > 0:
        tiers.append((HOST_TIER, HostMemoryStore(int(cache.host_memory_gib * 2**30))))
    store = build_store(plan)
    if store is not None:
        tiers.append(store)
    if not tiers:
        return None
    if not cache.prefix_caching:
        raise AssemblyError(
            ["[cache] host_memory_gib / [components] kv_store keep prefix blocks: set [cache] prefix_caching = true"]
        )
    return KVTiers(tiers)


def cache_namespace(plan: Plan, checkpoint: Any, mover: BlockMover, dtype: Any) -> bytes:
    """What two engines must share for one's cached blocks to be the other's: the weights
    (file names, sizes and modification times), the model config, dtype, quantization mode,
    batch invariance and block size, the components that compute the cache, and every
    cache tensor's shape, dtype and class."""
    config = plan.config
    identity = {
        "weights": _weight_files(Path(checkpoint.path)),
        "config": dict(checkpoint.config),
        "dtype": str(dtype),
        "quantization": config.model.quantization,
        "batch_invariant": config.engine.batch_invariant,
        "block_size": config.cache.block_size,
        "components": {kind: plan.resolutions[kind].name for kind in COMPUTING_KINDS if kind in plan.resolutions},
        "tensors": {
            str(window): [(list(t.shape[1:]), str(t.dtype)) for t in tensors]
            for window, tensors in mover.tensors.items()
        },
    }
    text = json.dumps(identity, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


def _weight_files(path: Path) -> list[tuple[str, int, int]]:
    files: Iterable[Path] = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
    return [(p.name, (stat := p.stat()).st_size, stat.st_mtime_ns) for p in files]


def block_mover(
    tiers: KVTiers,
    model: interfaces.CausalLM,
    kv_caches: list[interfaces.LayerKVCache],
    drafter_caches: list[tuple[interfaces.AttentionLayerSpec, interfaces.LayerKVCache]],
    plan: Plan,
) -> BlockMover:
    """The copier of the target's cache and a drafter's (filled through the same tables)."""
    layers = [*zip(model.attention_layers, kv_caches, strict=True), *drafter_caches]
    return BlockMover(layers, tiers, plan.device, pinned=plan.platform.pinned_host_copies)

"""Loading: the model on its device, its weights, and a KV cache sized to the budget.

Runs on the engine's device thread (``build_engine``), so every tensor is created
where the forward passes will use it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import structlog
import torch

from powertrain import interfaces
from powertrain.assemble.building import build_moe
from powertrain.assemble.planning import AssemblyError, Plan
from powertrain.components import PlatformInfo
from powertrain.config import EngineConfig
from powertrain.layers.linear import pack_for_platform
from powertrain.layers.norm import use_norm_kernel
from powertrain.parallel.expert import ExpertParallel
from powertrain.plugins import Provided

log = structlog.get_logger(__name__)

#: KV blocks of a rank that serves experts only (it runs startup profiles, no requests).
EXPERT_ONLY_BLOCKS = 64


@attrs.frozen(kw_only=True)
class LoadedModel:
    """A model with its weights and its allocated KV cache (one entry per attention layer)."""

    model: interfaces.CausalLM
    kv_caches: list[interfaces.LayerKVCache]
    num_blocks: int
    bytes_per_block: int


def resolve_dtype(requested: str, platform: PlatformInfo, checkpoint_config: Mapping[str, Any]) -> torch.dtype:
    """``auto``: the platform's own choice (float32 on CPU: exact, and fast enough there);
    otherwise (accelerators) the checkpoint's half precision, bfloat16 when it names none."""
    if requested != "auto":
        return getattr(torch, requested)
    if platform.auto_dtype is not None:
        return platform.auto_dtype
    stored = str(checkpoint_config.get("torch_dtype") or checkpoint_config.get("dtype") or "bfloat16")
    return torch.float16 if stored.endswith("float16") and "b" not in stored else torch.bfloat16


def model_length(config: EngineConfig, checkpoint_config: Mapping[str, Any]) -> int:
    """Tokens per sequence (prompt + output): the config's limit within the model's."""
    model_limit = int(checkpoint_config.get("max_position_embeddings") or 2048)
    return min(config.model.max_model_len or model_limit, model_limit)


def load_model(
    plan: Plan,
    architecture: Provided,
    checkpoint: Any,
    attention: Any,
    dtype: torch.dtype,
    needs_moe: bool,
    experts: ExpertParallel | None = None,
) -> LoadedModel:
    """Build the model, load its weights and allocate its KV cache (on the device thread)."""
    model = _build_model(plan, architecture, checkpoint, attention, dtype, needs_moe, experts)
    _prepare_for_platform(model, plan, attention, dtype)
    return _allocate_kv_cache(
        model, plan, attention, dtype, expert_only=experts is not None and not experts.placement.holds_requests
    )


def _build_model(
    plan: Plan,
    architecture: Provided,
    checkpoint: Any,
    attention: Any,
    dtype: torch.dtype,
    needs_moe: bool,
    experts: ExpertParallel | None,
) -> interfaces.CausalLM:
    moe = build_moe(plan, dtype) if needs_moe else None
    # FP8 experts stay FP8 only where the MoE backend multiplies them itself and the
    # platform keeps FP8 weights; elsewhere (a CPU) everything is dequantized at load.
    keeps_fp8 = (
        moe is not None and plan.platform.keeps_fp8_weights and "fp8-block" in plan.chosen("moe").record.capabilities
    )
    context = interfaces.ModelContext(
        config=checkpoint.config,
        dtype=dtype,
        device=plan.device,
        attention=attention,
        moe=moe,
        fp8_block=checkpoint.fp8_block if keeps_fp8 else None,
        **(experts.model_context_fields() if experts else {}),
    )
    model = architecture.record.factory(context)
    if not isinstance(model, interfaces.CausalLM):
        raise AssemblyError([f"model {architecture.record.name!r} built {type(model).__name__}, not a CausalLM"])
    model.load_weights(
        checkpoint.tensors(
            fp8_dtype=dtype, keep_fp8=getattr(model, "keep_fp8", None), wanted=getattr(model, "wants_weight", None)
        )
    )
    return model


def _prepare_for_platform(model: interfaces.CausalLM, plan: Plan, attention: Any, dtype: torch.dtype) -> None:
    """Once-at-load changes that make the forward faster here: packed CPU weights, the
    attention pack's fused RMSNorm."""
    pack_for_platform(model, plan.platform, dtype)
    if isinstance(attention, interfaces.RMSNormKernel):
        log.info("rmsnorm through the attention backend's kernel", norms=use_norm_kernel(model, attention))


def kv_budget_bytes(config: EngineConfig, platform: PlatformInfo, device: torch.device) -> int:
    """Bytes the KV cache may take: ``[cache] memory_gib``, else most of the free device
    memory, else a quarter of the host's memory up to 4 GiB."""
    if config.cache.memory_gib is not None:
        return int(config.cache.memory_gib * 2**30)
    if platform.free_memory is not None:
        return int(platform.free_memory(device) * 0.85)
    total = platform.total_memory_bytes or 16 * 2**30
    return int(min(4 * 2**30, total // 4))


def model_cache_bytes_per_token(
    layers: Sequence[interfaces.AttentionLayerSpec], block_size: int, dtype: torch.dtype
) -> int:
    """Bytes per token of every layer's model-declared cache tensors (0 for most models)."""
    specs = (layer.model_cache_spec(block_size, dtype) for layer in layers)
    return sum(spec.bytes_per_token for spec in specs if spec is not None)


def _allocate_kv_cache(
    model: interfaces.CausalLM, plan: Plan, attention: Any, dtype: torch.dtype, *, expert_only: bool
) -> LoadedModel:
    """One cache per attention layer, as the backend declares it plus the tensors the model
    declares for itself (``AttentionLayerSpec.model_cache``), as many blocks as fit."""
    config = plan.config
    block_size = config.cache.block_size
    layers = model.attention_layers
    specs = [attention.kv_cache_spec(layer, block_size, dtype) for layer in layers]
    model_bytes_per_token = model_cache_bytes_per_token(layers, block_size, dtype)
    bytes_per_block = sum(spec.bytes_per_block for spec in specs) + model_bytes_per_token * block_size
    if expert_only:  # an expert-only rank holds no requests; a few blocks serve its startup profiles
        num_blocks = EXPERT_ONLY_BLOCKS
    else:
        num_blocks = config.cache.num_blocks or kv_budget_bytes(config, plan.platform, plan.device) // bytes_per_block
    if num_blocks < 1:
        raise AssemblyError(
            [f"the KV cache budget holds no block of {bytes_per_block} bytes; raise [cache] memory_gib"]
        )
    kv_caches = [layer.allocate_cache(spec, num_blocks, plan.device) for layer, spec in zip(layers, specs, strict=True)]
    naive = getattr(model, "naive_kv_bytes_per_token", None)
    log.info(
        "kv cache",
        bytes_per_token=sum(spec.bytes_per_token for spec in specs) + model_bytes_per_token,
        **({"bytes_per_token_uncompressed": naive(dtype)} if naive else {}),
        **({"model_cache_bytes_per_token": model_bytes_per_token} if model_bytes_per_token else {}),
        blocks=num_blocks,
        block_size=block_size,
    )
    return LoadedModel(model=model, kv_caches=kv_caches, num_blocks=num_blocks, bytes_per_block=bytes_per_block)

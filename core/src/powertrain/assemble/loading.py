"""Loading: the model on its device, its weights, and a KV cache sized to the budget.

Runs on the engine's device thread (``build_engine``), so every tensor is created
where the forward passes will use it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import attrs
import structlog
import torch

from powertrain import interfaces, startup
from powertrain.assemble.building import build_moe, build_quantized_linear
from powertrain.assemble.planning import AssemblyError, Plan
from powertrain.components import PlatformInfo
from powertrain.config import EngineConfig
from powertrain.engine.cache_layout import CacheLayout, cache_layout
from powertrain.layers.linear import make_batch_invariant, pack_for_platform
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
    #: Usable blocks per retention class (None: full history; else a sliding window).
    num_blocks: dict[int | None, int]
    layout: CacheLayout
    #: Steps of at most this many tokens run torch's ops on one thread: the quantised-linear
    #: backend parallelises them on its own pool (``QuantizedLinearRecord.own_pool_max_rows``).
    serial_torch_tokens: int = 0


def resolve_dtype(requested: str, platform: PlatformInfo, checkpoint_config: Mapping[str, Any]) -> torch.dtype:
    """``auto``: the platform's own choice (float32 on CPU: exact, and fast enough there);
    otherwise (accelerators) the checkpoint's half precision, bfloat16 when it names none."""
    if requested != "auto":
        return getattr(torch, requested)
    if platform.auto_dtype is not None:
        log.info("dtype auto", dtype=str(platform.auto_dtype), platform=platform.name, why=platform.auto_dtype_note)
        return platform.auto_dtype
    stored = str(checkpoint_config.get("torch_dtype") or checkpoint_config.get("dtype") or "bfloat16")
    dtype = torch.float16 if stored.endswith("float16") and "b" not in stored else torch.bfloat16
    log.info("dtype auto", dtype=str(dtype), platform=platform.name, why=f"the checkpoint's half precision ({stored})")
    return dtype


def fit_threads(platform: PlatformInfo) -> None:
    """Keep torch's threads (and so the native kernels', which take torch's count) within
    the CPUs this process may use, where ranks compute on the host's cores: a container
    limited to 2 CPUs on a 64-core host would otherwise run 64 threads that wait at every
    parallel region for the ones the scheduler parked. An explicit ``OMP_NUM_THREADS`` is
    the user's word and stays."""
    cpus = platform.host_cpus
    threads = torch.get_num_threads()
    if not platform.shares_host_cores or cpus is None or threads <= cpus:
        return
    if "OMP_NUM_THREADS" in os.environ:
        log.warning(
            "threads exceed the usable CPUs", torch_threads=threads, cpus=cpus, reason=platform.host_cpus_reason
        )
        return
    torch.set_num_threads(cpus)
    log.info("threads fitted to the usable CPUs", torch_threads=cpus, were=threads, reason=platform.host_cpus_reason)


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
    with startup.phase("build model and load weights", status=False):
        quantized_linear = kept_quantized(plan, checkpoint, dtype)
        model = _build_model(plan, architecture, checkpoint, attention, dtype, needs_moe, experts, quantized_linear)
    with startup.phase("prepare weights for the platform"):
        _prepare_for_platform(model, plan, attention, dtype)
    with startup.phase("allocate kv cache"):
        loaded = _allocate_kv_cache(
            model, plan, attention, dtype, expert_only=experts is not None and not experts.placement.holds_requests
        )
    if quantized_linear is None:
        return loaded
    return attrs.evolve(loaded, serial_torch_tokens=plan.chosen("quantized_linear").record.own_pool_max_rows)


def describe_cache(
    plan: Plan, architecture: Provided, checkpoint: Any, attention: Any, dtype: torch.dtype, needs_moe: bool
) -> dict[str, Any]:
    """What the KV cache would be (groups, bytes per token, blocks per class), from the
    model built on the meta device: no weights are read and no memory is taken."""
    model = _build_model(
        plan, architecture, checkpoint, attention, dtype, needs_moe, None, None, device=torch.device("meta")
    )
    layout = model_cache_layout(model, attention, plan.config.cache.block_size, dtype)
    return layout.report(_block_counts(layout, plan))


def _build_model(
    plan: Plan,
    architecture: Provided,
    checkpoint: Any,
    attention: Any,
    dtype: torch.dtype,
    needs_moe: bool,
    experts: ExpertParallel | None,
    quantized_linear: interfaces.QuantizedLinearKernel | None,
    device: torch.device | None = None,
) -> interfaces.CausalLM:
    """The model with its weights, or (``device`` meta) only its structure; its kept-quantised
    weights multiplied by ``quantized_linear`` (None: every weight dense)."""
    moe = build_moe(plan, dtype) if needs_moe else None
    # FP8 experts stay FP8 only where the MoE backend multiplies them itself and the
    # platform keeps FP8 weights; elsewhere (a CPU) everything is dequantized at load.
    capabilities = plan.chosen("moe").record.capabilities if moe is not None else frozenset()
    keeps_fp8 = plan.platform.keeps_fp8_weights and "fp8-block" in capabilities
    # Packed FP4 experts likewise (same platform fact: quantised weights pay off there).
    keeps_fp4 = checkpoint.fp4_experts and plan.platform.keeps_fp8_weights and "fp4" in capabilities
    context = interfaces.ModelContext(
        config=checkpoint.config,
        dtype=dtype,
        device=device or plan.device,
        attention=attention,
        moe=moe,
        fp8_block=checkpoint.fp8_block if keeps_fp8 else None,
        fp4_experts=keeps_fp4,
        quantized_linear=quantized_linear,
        tensor_files=checkpoint.tensor_files,
        tokenizer=checkpoint.tokenizer,
        **(experts.model_context_fields() if experts else {}),
    )
    model = architecture.record.factory(context)
    if not isinstance(model, interfaces.CausalLM):
        raise AssemblyError([f"model {architecture.record.name!r} built {type(model).__name__}, not a CausalLM"])
    if device is not None and device.type == "meta":
        return model
    model.load_weights(
        checkpoint.tensors(
            fp8_dtype=dtype,
            keep_fp8=getattr(model, "keep_fp8", None),
            keep_fp4=getattr(model, "keep_fp4", None),
            wanted=getattr(model, "wants_weight", None),
            keep_quantized=getattr(model, "keep_quantized", None) if quantized_linear is not None else None,
        )
    )
    return model


def kept_quantized(plan: Plan, checkpoint: Any, dtype: torch.dtype) -> interfaces.QuantizedLinearKernel | None:
    """The kernel that multiplies the checkpoint's quantised weights as stored, or None where
    they are dequantized at load (``[model] quantization``; one info line says which and why)."""
    formats = checkpoint.quantized_formats
    mode = plan.config.model.quantization
    if not formats or mode == "dequantize":
        if formats:
            log.info("quantised weights dequantized at load", dtype=str(dtype), why="[model] quantization = dequantize")
        return None
    if mode == "auto" and plan.config.engine.batch_invariant:
        why = "[engine] batch_invariant: no quantised-linear kernel declares batch invariance"
        log.info("quantised weights dequantized at load", dtype=str(dtype), why=why)
        return None
    resolution = plan.resolutions["quantized_linear"]
    record = resolution.provided.record if resolution.provided else None
    if mode == "auto" and (record is None or record.expands_weights or not formats <= record.capabilities):
        why = (
            f"no quantised-linear backend here ({resolution.reason})"
            if record is None
            else f"{record.name} expands weights on every call"
            if record.expands_weights
            else f"{record.name} multiplies {sorted(record.capabilities)}, not all of {sorted(formats)}"
        )
        log.info("quantised weights dequantized at load", dtype=str(dtype), why=why)
        return None
    kernel = build_quantized_linear(plan, dtype)
    log.info(
        "quantised weights kept as stored",
        backend=plan.chosen("quantized_linear").record.name,
        formats=sorted(formats),
        activations=str(dtype),
    )
    return kernel


def _prepare_for_platform(model: interfaces.CausalLM, plan: Plan, attention: Any, dtype: torch.dtype) -> None:
    """Once-at-load changes that make the forward faster here: packed CPU weights, the
    attention pack's fused RMSNorm; with ``[engine] batch_invariant`` row-tiled matmuls
    instead of packed weights."""
    if plan.config.engine.batch_invariant:
        tiled = make_batch_invariant(model)
        log.info("matmuls in row tiles, weights not packed", modules=tiled, why="[engine] batch_invariant")
    else:
        pack_for_platform(model, plan.platform, dtype)
    if isinstance(attention, interfaces.RMSNormKernel):
        log.info("rmsnorm through the attention backend's kernel", norms=use_norm_kernel(model, attention))
    if isinstance(attention, interfaces.DecoderStackKernel) and hasattr(model, "decoder_layer_parts"):
        _fuse_decoder(model, attention, plan)


def _fuse_decoder(model: Any, kernel: interfaces.DecoderStackKernel, plan: Plan) -> None:
    """Hand the model's layers to the pack that runs whole decoder stacks; one info line
    says whether it took them, and why not."""
    if plan.config.engine.batch_invariant:
        log.info("decoder layers run one by one", why="[engine] batch_invariant")
        return
    parts = model.decoder_layer_parts()
    fused = kernel.fuse_decoder(parts)
    if isinstance(fused, str):
        log.info("decoder layers run one by one", why=fused)
        return
    model.use_fused_decoder(fused)
    log.info("decoder stack fused for small steps", layers=len(parts), backend=plan.chosen("attention").record.name)


def kv_budget_bytes(config: EngineConfig, platform: PlatformInfo, device: torch.device) -> int:
    """Bytes the KV cache may take: ``[cache] memory_gib``, else most of the free device
    memory, else a quarter of the host's memory up to 4 GiB."""
    if config.cache.memory_gib is not None:
        return int(config.cache.memory_gib * 2**30)
    if platform.free_memory is not None:
        return int(platform.free_memory(device) * 0.85)
    total = platform.total_memory_bytes or 16 * 2**30
    return int(min(4 * 2**30, total // 4))


def _allocate_kv_cache(
    model: interfaces.CausalLM, plan: Plan, attention: Any, dtype: torch.dtype, *, expert_only: bool
) -> LoadedModel:
    """One cache per attention layer, as the backend declares it plus the model's own
    cache groups, as many blocks per retention class as the budget holds
    (``engine.cache_layout``)."""
    config = plan.config
    layers = model.attention_layers
    layout = model_cache_layout(model, attention, config.cache.block_size, dtype)
    # An expert-only rank holds no requests; a few blocks serve its startup profiles.
    counts = dict.fromkeys(layout.windows, EXPERT_ONLY_BLOCKS) if expert_only else _block_counts(layout, plan)
    specs = [layer.backend_cache_spec(attention, config.cache.block_size, dtype) for layer in layers]
    kv_caches = interfaces.allocate_caches(layers, specs, counts, plan.device)
    log.info("kv cache", **layout.report(counts))
    return LoadedModel(model=model, kv_caches=kv_caches, num_blocks=counts, layout=layout)


def _block_counts(layout: CacheLayout, plan: Plan) -> dict[int | None, int]:
    """Usable blocks per retention class for the plan's budget and scheduler limits."""
    config = plan.config
    try:
        return layout.num_blocks(
            kv_budget_bytes(config, plan.platform, plan.device),
            max_num_seqs=config.scheduler.max_num_seqs,
            max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
            fixed=config.cache.num_blocks,
        )
    except ValueError as error:
        raise AssemblyError([str(error)]) from error


def model_cache_layout(model: interfaces.CausalLM, attention: Any, block_size: int, dtype: torch.dtype) -> CacheLayout:
    """The cache ``model`` needs with ``attention``'s cache specs (``engine.cache_layout``)."""
    layers = model.attention_layers
    specs = [layer.backend_cache_spec(attention, block_size, dtype) for layer in layers]
    naive = getattr(model, "naive_kv_bytes_per_token", None)
    try:
        return cache_layout(layers, specs, naive(dtype) if naive else None)
    except ValueError as error:
        raise AssemblyError([str(error)]) from error

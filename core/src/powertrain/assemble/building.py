"""Building: a plan's choices -> the Protocol objects the hot path calls directly.

Each ``build_*`` calls the chosen record's factory with its context and checks that
the object implements the Protocols its record claims, so a plugin that built the
wrong thing fails here, naming itself, and pluggy never runs per layer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import structlog
import torch

from powertrain import interfaces
from powertrain.assemble.planning import AssemblyError, Plan
from powertrain.engine.block_manager import BlockManager
from powertrain.engine.device_thread import DeviceThread
from powertrain.engine.speculative import StepsPerSecondProfiler
from powertrain.interfaces.scheduling import SchedulerContext, SchedulerLimits
from powertrain.interfaces.speculative import SpeculativeContext
from powertrain.models.dspark import load_block_drafter
from powertrain.parallel.expert import ExpertParallel, build_dispatcher
from powertrain.parallel.layout import RankPlacement, layout_of

log = structlog.get_logger(__name__)


def _build(plan: Plan, kind: str, context: Any, protocols: tuple[type, ...]) -> Any:
    provided = plan.chosen(kind)
    obj = provided.record.factory(context)
    lacking = [p.__name__ for p in protocols if not isinstance(obj, p)]
    if lacking:
        raise AssemblyError(
            [
                f"{kind} {provided.record.name!r} from plugin {provided.plugin.name} "
                f"({provided.plugin.distribution}) built {type(obj).__name__}, which does not "
                f"implement powertrain.interfaces.{' and '.join(lacking)}"
            ]
        )
    log.debug("component built", kind=kind, name=provided.record.name, plugin=provided.plugin.name)
    return obj


def _device(plan: Plan, local_rank: int | None) -> torch.device:
    """The device of this process: on a platform with a device per rank, its local rank's."""
    if not plan.platform.device_per_rank or local_rank is None:
        return plan.device
    return torch.device(plan.platform.device_type, local_rank)


def build_attention(
    plan: Plan, dtype: torch.dtype, block_size: int | None = None, *, local_rank: int | None = None
) -> Any:
    """The chosen attention backend; it must implement the Protocols its capabilities claim
    (``AttentionBackend`` for gqa/mha, ``MLAAttentionBackend`` for mla,
    ``SparseMLAAttentionBackend`` for sparse-mla, ...)."""
    context = interfaces.AttentionBackendContext(
        platform=plan.platform,
        device=_device(plan, local_rank),
        dtype=dtype,
        block_size=block_size or plan.config.cache.block_size,
    )
    capabilities = plan.chosen("attention").record.capabilities
    protocols = tuple(
        protocol
        for protocol, tags in (
            (interfaces.AttentionBackend, {"gqa", "mha"}),
            (interfaces.MLAAttentionBackend, {"mla"}),
            (interfaces.SparseMLAAttentionBackend, {"sparse-mla"}),
            (interfaces.V4AttentionBackend, {"v4-attention"}),
            (interfaces.LightningIndexerBackend, {"lightning-indexer"}),
            (interfaces.RotaryAttentionBackend, {"fused-rotary"}),
            (interfaces.RMSNormKernel, {"fused-rmsnorm"}),
            (interfaces.DecoderStackKernel, {"fused-decoder"}),
        )
        if capabilities & tags
    )
    return _build(plan, "attention", context, protocols or (interfaces.AttentionBackend,))


def build_moe(plan: Plan, dtype: torch.dtype, *, local_rank: int | None = None) -> interfaces.MoEBackend:
    context = interfaces.MoEBackendContext(platform=plan.platform, device=_device(plan, local_rank), dtype=dtype)
    return _build(plan, "moe", context, (interfaces.MoEBackend,))


def build_quantized_linear(plan: Plan, dtype: torch.dtype) -> interfaces.QuantizedLinearKernel:
    context = interfaces.QuantizedLinearContext(platform=plan.platform, device=plan.device, dtype=dtype)
    return _build(plan, "quantized_linear", context, (interfaces.QuantizedLinearKernel,))


def build_communicator(
    plan: Plan,
    *,
    rank: int = 0,
    world_size: int = 1,
    init_method: str = "env://",
    local_rank: int | None = None,
) -> interfaces.Communicator:
    context = interfaces.CommunicatorContext(
        platform=plan.platform,
        device=_device(plan, rank if local_rank is None else local_rank),
        rank=rank,
        world_size=world_size,
        init_method=init_method,
    )
    return _build(plan, "communication", context, (interfaces.Communicator,))


def build_scheduler(plan: Plan, block_manager: BlockManager) -> interfaces.Scheduler:
    """The chosen scheduler over the engine's block manager, within ``[scheduler]``'s limits."""
    settings = plan.config.scheduler
    limits = SchedulerLimits(
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        chunked_prefill=settings.chunked_prefill,
    )
    return plan.chosen("scheduler").record.factory(SchedulerContext(limits=limits, block_manager=block_manager))


def check_expert_parallel_fits(placement: RankPlacement | None, needs_moe: bool, checkpoint: Any, model: str) -> None:
    """Expert parallelism splits routed experts; a model without them cannot use it."""
    if placement is not None and placement.layout.expert_parallel_enabled and not needs_moe:
        raise AssemblyError(
            [
                f"expert_parallel={placement.layout.expert_parallel}: {checkpoint.path} has no routed experts "
                f"({model}); use data_parallel alone"
            ]
        )


def join_expert_parallel(plan: Plan, placement: RankPlacement | None) -> ExpertParallel | None:
    """Join the process group and build the exchange, when the layout splits experts."""
    layout = layout_of(plan.config)
    if placement is None:
        if layout.world_size > 1:
            raise AssemblyError(
                [
                    f"[parallel] data_parallel={layout.data_parallel}, expert_parallel={layout.expert_parallel} "
                    f"runs {layout.world_size} processes: use powertrain.LLM, `powertrain generate` or "
                    "`powertrain serve`, which launch them (powertrain.deploy), not build_engine"
                ]
            )
        return None
    if not layout.expert_parallel_enabled:
        return None
    communicator = build_communicator(
        plan,
        rank=placement.rank,
        world_size=layout.world_size,
        init_method=placement.init_method,
        local_rank=0,  # a worker sees only its own accelerator (deploy.worker)
    )
    dispatcher = build_dispatcher(plan.chosen("communication").record, communicator)
    log.info("expert parallel", rank=placement.rank, world_size=layout.world_size, dispatcher=type(dispatcher).__name__)
    return ExpertParallel(placement=placement, communicator=communicator, dispatcher=dispatcher)


def build_speculative(
    plan: Plan,
    model: interfaces.CausalLM,
    kv_caches: Sequence[interfaces.LayerKVCache],
    num_blocks: Mapping[int | None, int],
    attention: Any,
    dtype: torch.dtype,
    device_thread: DeviceThread,
    model_config: Mapping[str, Any],
    expert_parallel_size: int = 1,
    lockstep: Any = None,
    allocated: list[tuple[interfaces.AttentionLayerSpec, interfaces.LayerKVCache]] | None = None,
) -> Any:
    """The chosen speculative policy, built on the device thread (it profiles the
    target there), or None when speculation is off. ``lockstep``: the runner's, under
    expert parallelism (a drafter with MoE layers joins its drafter rounds).
    ``allocated`` gets each cache the drafter allocates, with its layer."""
    resolution = plan.resolutions.get("speculative")
    if resolution is None or resolution.provided is None:
        return None
    record = plan.chosen("speculative").record
    block_size = plan.config.cache.block_size
    quantized = plan.resolutions.get("quantized_linear")

    def allocate(layers: Sequence[interfaces.AttentionLayerSpec], extra_blocks: int = 0) -> list[Any]:
        # The model's own cache groups (AttentionLayerSpec.cache_groups) come with the backend's.
        counts = {window: blocks + extra_blocks for window, blocks in num_blocks.items()}
        specs = [layer.backend_cache_spec(attention, block_size, dtype) for layer in layers]
        caches = interfaces.allocate_caches(layers, specs, counts, plan.device)
        if allocated is not None:
            allocated.extend(zip(layers, caches, strict=True))
        # Beside the target's KV budget, not inside it: said at startup so it can be planned for.
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for c in caches for t in c.values()}
        size = sum(storages.values())  # a tensor several layers read is counted once
        log.info("drafter kv cache", layers=len(layers), gib=round(size / 2**30, 3), outside_kv_budget=True)
        return caches

    context = SpeculativeContext(
        config=plan.sections.get(record.config_section) if record.config_section else None,
        model=model,
        vocab_size=int(model_config["vocab_size"]),
        model_config=model_config,
        device=plan.device,
        block_size=block_size,
        measure_steps_per_second=StepsPerSecondProfiler(
            model, list(kv_caches), block_size, min(num_blocks.values()), plan.device
        ),
        allocate_kv_caches=allocate,
        load_draft_model=lambda folder: load_block_drafter(folder, model_config, attention, dtype, plan.device),
        build_quantized_linear=(lambda: build_quantized_linear(plan, dtype))
        if quantized and quantized.provided
        else None,
        expert_parallel_size=expert_parallel_size,
        join_expert_rounds=lockstep.join_draft_rounds if lockstep is not None else None,
    )
    policy = device_thread.run(record.factory, context)
    log.info("speculative decoding", policy=record.name)
    return policy


def step_observer(plan: Plan) -> Any:
    """The ``on_step`` callback for the engine: None unless a plugin observes steps, so
    no pluggy call runs per step for nobody."""
    hooks = plan.plugins.hook
    if not hooks.powertrain_step_finished.get_hookimpls():
        return None

    def on_step(engine: Any, stats: Any) -> None:
        hooks.powertrain_step_finished(engine=engine, stats=stats)

    return on_step

"""``build_engine``: config -> a ready ``LLMEngine``, as a sequence of named steps.

Order matters: the checkpoint's config says which architecture (and so which
capabilities) the model needs before components are planned; the chosen attention
backend's KVCacheSpec then sizes the cache from the memory budget.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import structlog

from powertrain import startup
from powertrain.assemble.building import (
    build_attention,
    build_scheduler,
    build_speculative,
    check_expert_parallel_fits,
    join_expert_parallel,
    step_observer,
)
from powertrain.assemble.loading import (
    LoadedModel,
    describe_cache,
    fit_threads,
    load_model,
    model_length,
    resolve_dtype,
)
from powertrain.assemble.planning import AssemblyError, Plan, find_architecture, plan
from powertrain.assemble.tiers import block_mover, build_tiers, cache_namespace
from powertrain.config import EngineConfig
from powertrain.engine.block_manager import BlockManager
from powertrain.engine.cuda_graphs import DecodeGraphs
from powertrain.engine.device_thread import DeviceThread
from powertrain.engine.engine import LLMEngine
from powertrain.engine.kv_tiers import KVTiers
from powertrain.engine.model_runner import ModelRunner
from powertrain.engine.sampler import Sampler
from powertrain.engine.speculative import tap_problems
from powertrain.engine.structured import StructuredOutputs
from powertrain.interfaces import HiddenTap
from powertrain.loader import load_checkpoint, sampling_defaults
from powertrain.parallel.expert import ExpertParallel
from powertrain.parallel.layout import RankPlacement
from powertrain.parallel.lockstep import Lockstep
from powertrain.plugins import PluginManager

log = structlog.get_logger(__name__)


def build_engine(
    config: EngineConfig | None = None, plugins: PluginManager | None = None, placement: RankPlacement | None = None
) -> LLMEngine:
    """Load the model named by ``config`` and assemble a ready ``LLMEngine``.

    ``placement`` is this process's rank when ``[parallel]`` asks for several
    (``powertrain.deploy`` launches them and passes it).
    """
    started = time.perf_counter()
    config = config or EngineConfig()
    with startup.phase("load plugins"):
        plugins = plugins or PluginManager.load(config.plugins)
    with startup.phase("open checkpoint", model=config.model.path):
        checkpoint = load_checkpoint(config.model.path)
        defaults = sampling_defaults(config.model.generation_config, checkpoint)
    with startup.phase("plan components"):
        architecture = find_architecture(plugins, checkpoint.config, str(checkpoint.path))
        requirements = model_requirements(architecture, checkpoint, config)
        needs_moe = "moe" in requirements
        chosen = plan(config, plugins, requirements=requirements)
        fit_threads(chosen.platform)  # before any kernel takes torch's thread count
        dtype = resolve_dtype(config.model.dtype, chosen.platform, checkpoint.config)
        attention = build_attention(chosen, dtype)
        check_expert_parallel_fits(placement, needs_moe, checkpoint, architecture.record.name)
        tiers = build_tiers(chosen)
    experts = join_expert_parallel(chosen, placement)
    device_thread = DeviceThread()
    drafter_caches: list[Any] = []
    with _released_on_failure(device_thread, experts, tiers):
        loaded = device_thread.run(load_model, chosen, architecture, checkpoint, attention, dtype, needs_moe, experts)
        runner = _model_runner(chosen, loaded, checkpoint, experts, dtype)
        runner.speculative = build_speculative(
            chosen,
            loaded.model,
            loaded.kv_caches,
            loaded.num_blocks,
            attention,
            dtype,
            device_thread,
            checkpoint.config,
            experts.placement.layout.expert_parallel if experts else 1,
            runner.lockstep,
            drafter_caches,
        )
        problems = tap_problems(loaded.model, runner.taps)
        if problems:
            raise AssemblyError([f"[speculative]: {problem}" for problem in problems])
        mover = None
        if tiers is not None:
            mover = block_mover(tiers, loaded.model, loaded.kv_caches, drafter_caches, chosen)
            log.info("kv tiers", tiers=tiers.names, block_bytes={str(w): n for w, n in mover.block_bytes.items()})
    block_manager = BlockManager(
        loaded.num_blocks,
        config.cache.block_size,
        config.cache.prefix_caching,
        namespace=cache_namespace(chosen, checkpoint, mover, dtype) if mover else b"",
        tiers=tiers,
        block_bytes=mover.block_bytes if mover else None,
    )
    max_model_len = model_length(config, checkpoint.config)
    with _released_on_failure(device_thread, experts, tiers), startup.phase("capture decode graphs"):
        runner.graphs = decode_graphs(
            chosen, loaded, block_manager, max_model_len, experts, device_thread, needs_moe, runner.taps
        )
    hooks = plugins.hook
    engine = LLMEngine(
        tokenizer=checkpoint.tokenizer,
        scheduler=build_scheduler(chosen, block_manager),
        block_manager=block_manager,
        runner=runner,
        max_model_len=max_model_len,
        async_scheduling=_async_scheduling(config, chosen.platform, runner),
        on_step=step_observer(chosen),
        on_shutdown=lambda e: _stopped(hooks, e, experts),
        model_name=config.model.path,
        model_config=checkpoint.config,
        sampling_defaults=defaults,
        device_thread=device_thread,
        kv_cache=loaded.layout.report(loaded.num_blocks),
        block_mover=mover,
    )
    log.info(
        "engine ready",
        model=config.model.path,
        dtype=str(dtype),
        attention=chosen.resolutions["attention"].name,
        kv_blocks=loaded.num_blocks[next(iter(loaded.num_blocks))],
        kv_gib=round(loaded.layout.bytes_for(loaded.num_blocks) / 2**30, 3),
        seconds=round(time.perf_counter() - started, 3),
        since_process_start=startup.since_process_start(),
    )
    hooks.powertrain_engine_started(engine=engine)
    return engine


def describe_kv_cache(config: EngineConfig, plugins: PluginManager | None = None) -> dict[str, Any]:
    """The KV cache ``build_engine`` would allocate for ``config`` here: each cache group's
    bytes per token, the total, what a dense uncompressed cache would take, and the blocks
    per retention class; reads the checkpoint's config but not its weights."""
    plugins = plugins or PluginManager.load(config.plugins)
    checkpoint = load_checkpoint(config.model.path)
    architecture = find_architecture(plugins, checkpoint.config, str(checkpoint.path))
    requirements = model_requirements(architecture, checkpoint, config)
    chosen = plan(config, plugins, requirements=requirements)
    dtype = resolve_dtype(config.model.dtype, chosen.platform, checkpoint.config)
    attention = build_attention(chosen, dtype)
    report = describe_cache(chosen, architecture, checkpoint, attention, dtype, "moe" in requirements)
    return {"model": config.model.path, "architecture": architecture.record.name, "dtype": str(dtype), **report}


def model_requirements(architecture: Any, checkpoint: Any, config: EngineConfig) -> dict[str, frozenset[str]]:
    """Capabilities the model needs per component kind: its architecture's, with
    ``quantization = "keep"`` a quantised-linear backend for the checkpoint's formats, and
    with ``[engine] batch_invariant`` batch invariance from its attention, MoE and
    quantised-linear backends."""
    requirements = dict(architecture.record.requirements(checkpoint.config) if architecture.record.requirements else {})
    if checkpoint.quantized_formats and config.model.quantization == "keep":
        requirements["quantized_linear"] = frozenset(checkpoint.quantized_formats)
    if config.engine.batch_invariant:
        for kind in ("attention", *(kind for kind in ("moe", "quantized_linear") if kind in requirements)):
            requirements[kind] = frozenset(requirements.get(kind, ())) | {"batch-invariant"}
    if config.engine.cuda_graphs == "on":
        for kind in ("attention", *(kind for kind in ("moe",) if kind in requirements)):
            requirements[kind] = frozenset(requirements.get(kind, ())) | {"cuda-graphs"}
    return requirements


def decode_graphs(
    chosen: Plan,
    loaded: LoadedModel,
    block_manager: BlockManager,
    max_model_len: int,
    experts: ExpertParallel | None,
    device_thread: DeviceThread,
    needs_moe: bool,
    taps: tuple[HiddenTap, ...] = (),
) -> DecodeGraphs | None:
    """``[engine] cuda_graphs``: decode steps captured for each batch size (recording the
    drafter's ``taps`` with them), or None (eager). "auto" captures where nothing stands in
    the way and logs what does; "on" refuses to start instead."""
    options = chosen.config.engine
    if options.cuda_graphs == "off":
        return None
    why = _why_not_captured(chosen, loaded, experts, needs_moe)
    if why:
        if options.cuda_graphs == "on":
            raise AssemblyError([f'[engine] cuda_graphs = "on": {why}; set it to "auto" or "off"'])
        log.info("decode steps run eager", why=why)
        return None
    graphs = DecodeGraphs(
        loaded.model,
        loaded.kv_caches,
        sizes=_graph_sizes(options.cuda_graph_batch_sizes, chosen.config.scheduler.max_num_seqs),
        block_size=chosen.config.cache.block_size,
        max_model_len=max_model_len,
        pad_blocks=block_manager.reserve_blocks(),
        device=chosen.device,
        taps=taps,
    )
    started = time.perf_counter()
    try:
        device_thread.run(graphs.capture_all)
    except Exception as exc:  # a backend that syncs or allocates from host data under capture
        why = f"capturing batch sizes {list(graphs.sizes)} failed: {type(exc).__name__}: {exc}"
        if options.cuda_graphs == "on":
            raise AssemblyError([f'[engine] cuda_graphs = "on": {why}; set it to "auto" or "off"']) from exc
        log.warning("decode steps run eager", why=why)
        return None
    log.info("decode graphs captured", batch_sizes=list(graphs.sizes), seconds=round(time.perf_counter() - started, 2))
    return graphs


def _graph_sizes(ladder: tuple[int, ...], max_num_seqs: int) -> list[int]:
    """The ladder up to the first size that holds ``max_num_seqs`` sequences (no step is bigger)."""
    sizes = [size for size in ladder if size < max_num_seqs]
    return sizes + [size for size in ladder if size >= max_num_seqs][:1]


def _why_not_captured(chosen: Plan, loaded: LoadedModel, experts: ExpertParallel | None, needs_moe: bool) -> str:
    """Why decode steps cannot be captured here, or ""."""
    platform = chosen.platform
    if not platform.cuda_graphs:
        return f"platform {platform.name} cannot capture CUDA graphs"
    if experts is not None:
        return "expert parallelism: MoE dispatch reads per-rank counts back to the host"
    if not getattr(loaded.model, "captures_decode", False):
        return f"{type(loaded.model).__name__} does not declare its decode step capturable (captures_decode)"
    for kind in ("attention", "moe") if needs_moe else ("attention",):
        resolution = chosen.resolutions.get(kind)
        if resolution is not None and resolution.provided is not None:
            record = resolution.provided.record
            if "cuda-graphs" not in record.capabilities:
                return f"{kind} backend {record.name} does not declare cuda-graphs"
    return ""


def _async_scheduling(config: Any, platform: Any, runner: ModelRunner) -> bool:
    """``[scheduler] async_scheduling``, unless speculative steps stay synchronous
    (``speculative_overlap``)."""
    scheduler = config.scheduler
    if not scheduler.async_scheduling or runner.speculative is None or scheduler.speculative_overlap == "on":
        return scheduler.async_scheduling
    if scheduler.speculative_overlap == "off" or platform.shares_host_cores:
        log.info(
            "speculative steps run synchronously",
            why=f"speculative_overlap = {scheduler.speculative_overlap!r}"
            + (f"; {platform.name} computes on the host's cores" if platform.shares_host_cores else ""),
        )
        return False
    return True


def _model_runner(
    chosen: Plan, loaded: LoadedModel, checkpoint: Any, experts: ExpertParallel | None, dtype: Any
) -> ModelRunner:
    """The runner of ``loaded``; under expert parallelism it keeps every rank's MoE
    layers in step (``parallel.lockstep``)."""
    runner = ModelRunner(
        loaded.model,
        loaded.kv_caches,
        chosen.config.cache.block_size,
        chosen.device,
        Sampler(chosen.config.model.seed),
        structured=StructuredOutputs(checkpoint.tokenizer),
        windows=tuple(loaded.num_blocks),
        serial_torch_tokens=loaded.serial_torch_tokens,
    )
    if experts is not None:
        runner.lockstep = Lockstep(
            experts.communicator,
            loaded.model.routed_expert_layers(),
            int(checkpoint.config["hidden_size"]),
            dtype,
            chosen.device,
        )
    return runner


@contextlib.contextmanager
def _released_on_failure(
    device_thread: DeviceThread, experts: ExpertParallel | None, tiers: KVTiers | None
) -> Iterator[None]:
    """A build that fails leaves no thread running, no process group joined, no store open."""
    try:
        yield
    except BaseException:
        device_thread.shutdown()
        if experts is not None:
            experts.communicator.close()
        if tiers is not None:
            tiers.close()
        raise


def _stopped(hooks: Any, engine: Any, experts: ExpertParallel | None) -> None:
    try:
        hooks.powertrain_engine_stopped(engine=engine)
    finally:
        if experts is not None:
            experts.communicator.close()

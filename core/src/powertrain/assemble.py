"""Config + plugins -> chosen components -> built objects. The only hook-heavy module.

``plan`` resolves what each component kind will be on this machine and why (what
``powertrain config check`` prints); ``build_*`` turn a plan's choices into the
Protocol objects the hot path calls directly, so pluggy never runs per layer.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import structlog
import torch

from powertrain import interfaces
from powertrain.components import Availability, PlatformInfo
from powertrain.config import EngineConfig, validate_sections
from powertrain.layers.linear import can_pack, pack_linears
from powertrain.layers.norm import use_norm_kernel
from powertrain.parallel.expert import ExpertParallel, build_dispatcher
from powertrain.parallel.layout import RankPlacement, layout_of
from powertrain.parallel.lockstep import Lockstep
from powertrain.plugins import PluginManager, Provided
from powertrain.selection import Candidate, Selection, SelectionError

log = structlog.get_logger(__name__)

#: Kinds chosen through ``[components]``, in the order they are resolved.
SELECTED_KINDS = ("attention", "moe", "communication", "scheduler", "speculative")

#: What an engine needs whatever the model; others (moe) only when a model asks.
ALWAYS_NEEDED = frozenset({"platform", "attention", "communication", "scheduler"})


class AssemblyError(RuntimeError):
    """The config cannot be assembled on this machine. One line per problem."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))


@attrs.frozen(kw_only=True)
class Resolution:
    """What one component kind resolved to, or why it did not."""

    kind: str
    requested: str
    provided: Provided | None = None
    reason: str = ""
    error: str = ""

    @property
    def name(self) -> str | None:
        return self.provided.record.name if self.provided else None


@attrs.frozen(kw_only=True)
class Plan:
    """The resolved assembly: the platform, one implementation per kind, plugin sections."""

    config: EngineConfig
    plugins: PluginManager
    platform: PlatformInfo
    sections: Mapping[str, Any]
    resolutions: Mapping[str, Resolution]

    @property
    def problems(self) -> list[str]:
        return [r.error for r in self.resolutions.values() if r.error]

    def chosen(self, kind: str) -> Provided:
        resolution = self.resolutions[kind]
        if resolution.provided is None:
            raise AssemblyError([resolution.error or f"{kind}: {resolution.reason}"])
        return resolution.provided

    @property
    def device(self) -> torch.device:
        return torch.device(self.platform.device_type)


def plan(
    config: EngineConfig,
    plugins: PluginManager | None = None,
    *,
    requirements: Mapping[str, Iterable[str]] | None = None,
    world_size: int | None = None,
    strict: bool = True,
) -> Plan:
    """Resolve every component kind for ``config`` on this machine.

    ``requirements`` maps a kind to capability tags the model needs (a MoE model
    passes ``{"moe": {...}}``, an MLA model ``{"attention": {"mla"}}``); a kind in it
    becomes needed. With ``strict`` any problem raises AssemblyError listing all of
    them; otherwise the problems stay in the returned plan for reporting.
    """
    plugins = plugins or PluginManager.load(config.plugins)
    requirements = {kind: frozenset(tags) for kind, tags in (requirements or {}).items()}
    needed = ALWAYS_NEEDED | set(requirements)
    # Attention data-parallel ranks and MoE expert-parallel ranks are the same processes;
    # only expert parallelism joins them in one process group.
    if world_size is None:
        layout = layout_of(config)
        world_size = layout.world_size if layout.expert_parallel_enabled else 1

    section_classes = {p.record.name: p.record.config_class for p in plugins.records("config-section")}
    sections = validate_sections(config, section_classes, plugins.broken())
    if plugins.configured_with is not config:  # once per config, however often it is planned
        plugins.configured_with = config
        plugins.hook.powertrain_configure.call_historic(kwargs={"config": config, "sections": sections})

    resolutions: dict[str, Resolution] = {}
    platform_resolution, platform = _resolve_platform(config, plugins)
    resolutions["platform"] = platform_resolution
    for kind in SELECTED_KINDS:
        requested = getattr(config.components, kind)
        if kind == "speculative" and requested == "none":
            resolutions[kind] = Resolution(kind=kind, requested=requested, reason="disabled (speculative = none)")
            continue
        candidates = [
            _candidate(kind, p, platform, requirements.get(kind, frozenset()), world_size)
            for p in plugins.records(kind)
        ]
        resolutions[kind] = _select(plugins, kind, requested, candidates, platform, requirements, kind in needed)

    result = Plan(config=config, plugins=plugins, platform=platform, sections=sections, resolutions=resolutions)
    if strict and result.problems:
        raise AssemblyError(result.problems)
    return result


def _resolve_platform(config: EngineConfig, plugins: PluginManager) -> tuple[Resolution, PlatformInfo]:
    detected = plugins.platforms()
    candidates = [
        Candidate(
            record=p.record,
            plugin=p.plugin.name,
            distribution=p.plugin.distribution,
            availability=detected[p.record.name].availability,
        )
        for p in plugins.records("platform")
    ]
    host = detected.get("cpu") or next(iter(detected.values()), None)
    if host is None:
        raise AssemblyError(["no platform is registered; is the builtin-platforms plugin disabled?"])
    resolution = _select(plugins, "platform", config.components.platform, candidates, host, {}, True)
    platform = detected[resolution.name] if resolution.name else host
    return resolution, platform


def _candidate(
    kind: str, provided: Provided, platform: PlatformInfo, required: frozenset[str], world_size: int
) -> Candidate:
    record = provided.record
    availability = record.availability(platform) if hasattr(record, "availability") else Availability.yes()
    missing = required - getattr(record, "capabilities", frozenset())
    max_world = getattr(record, "max_world_size", None)
    if kind == "communication" and max_world is not None and world_size > max_world:
        missing = missing | {f"world size {world_size} (at most {max_world})"}
    return Candidate(
        record=record,
        plugin=provided.plugin.name,
        distribution=provided.plugin.distribution,
        availability=availability,
        missing=frozenset(missing),
    )


def _select(
    plugins: PluginManager,
    kind: str,
    requested: str,
    candidates: list[Candidate],
    platform: PlatformInfo,
    requirements: Mapping[str, frozenset[str]],
    needed: bool,
) -> Resolution:
    try:
        selection = plugins.hook.powertrain_select_component(
            kind=kind,
            requested=requested,
            candidates=candidates,
            platform=platform,
            requirements=requirements.get(kind, frozenset()),
        )
    except SelectionError as exc:
        message = f"{kind} = {requested!r}: {exc}"
        if requested != "auto" or needed:
            return Resolution(kind=kind, requested=requested, error=message + _hint_for_missing(plugins))
        return Resolution(kind=kind, requested=requested, reason=f"not needed by this model; {exc}")
    except Exception as exc:  # a plugin's selection rule crashed: say whose, keep going
        return Resolution(
            kind=kind,
            requested=requested,
            error=f"{kind}: a selection hook (plugins: {_selection_plugins(plugins)}) raised "
            f"{type(exc).__name__}: {exc}",
        )
    if selection is None:
        return Resolution(
            kind=kind,
            requested=requested,
            error=f"{kind}: no selection rule chose anything (is builtin-selection disabled?)",
        )
    if not isinstance(selection, Selection):
        return Resolution(
            kind=kind,
            requested=requested,
            error=f"{kind}: a selection hook (plugins: {_selection_plugins(plugins)}) returned {selection!r}, "
            "not a Selection",
        )
    match = next((c for c in candidates if c.name == selection.name), None)
    if match is None or not match.usable:
        why = "which no loaded plugin provides" if match is None else f"which cannot be used here: {match.describe()}"
        return Resolution(
            kind=kind,
            requested=requested,
            error=f"{kind}: a selection hook (plugins: {_selection_plugins(plugins)}) chose {selection.name!r}, {why}",
        )
    provided = next(p for p in plugins.records(kind) if p.record.name == selection.name)
    return Resolution(kind=kind, requested=requested, provided=provided, reason=selection.reason)


def _selection_plugins(plugins: PluginManager) -> str:
    impls = plugins.hook.powertrain_select_component.get_hookimpls()
    return ", ".join(impl.plugin_name for impl in impls) or "(none)"


def _hint_for_missing(plugins: PluginManager) -> str:
    """Broken or disabled plugins may be why a requested component is missing."""
    hints = []
    broken = plugins.broken()
    if broken:
        hints.append(
            "plugins that failed to load, which may provide it: "
            + "; ".join(f"{name} ({error})" for name, error in broken.items())
        )
    disabled = plugins.disabled()
    if disabled:
        hints.append("disabled plugins: " + ", ".join(disabled))
    return "".join(f"; {hint}" for hint in hints)


# --------------------------------------------------------------------------- building


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
    """The device of this process: each local rank owns one accelerator."""
    if plan.platform.device_type == "cpu" or local_rank is None:
        return plan.device
    return torch.device(plan.platform.device_type, local_rank)


def build_attention(
    plan: Plan, dtype: torch.dtype, block_size: int | None = None, *, local_rank: int | None = None
) -> Any:
    """The chosen attention backend; it must implement the Protocols its capabilities claim
    (``AttentionBackend`` for gqa/mha, ``MLAAttentionBackend`` for mla)."""
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
            (interfaces.RotaryAttentionBackend, {"fused-rotary"}),
            (interfaces.RMSNormKernel, {"fused-rmsnorm"}),
        )
        if capabilities & tags
    )
    return _build(plan, "attention", context, protocols or (interfaces.AttentionBackend,))


def build_moe(plan: Plan, dtype: torch.dtype, *, local_rank: int | None = None) -> interfaces.MoEBackend:
    context = interfaces.MoEBackendContext(platform=plan.platform, device=_device(plan, local_rank), dtype=dtype)
    return _build(plan, "moe", context, (interfaces.MoEBackend,))


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


# --------------------------------------------------------------------------- the engine


def resolve_dtype(requested: str, platform: PlatformInfo, checkpoint_config: Mapping[str, Any]) -> torch.dtype:
    """``auto``: float32 on CPU (exact, and fast enough there); on accelerators the
    checkpoint's half precision, bfloat16 when it names none."""
    if requested != "auto":
        return getattr(torch, requested)
    if platform.device_type == "cpu":
        return torch.float32
    stored = str(checkpoint_config.get("torch_dtype") or checkpoint_config.get("dtype") or "bfloat16")
    return torch.float16 if stored.endswith("float16") and "b" not in stored else torch.bfloat16


def _kv_budget_bytes(config: EngineConfig, platform: PlatformInfo, device: torch.device) -> int:
    if config.cache.memory_gib is not None:
        return int(config.cache.memory_gib * 2**30)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.85)
    total = platform.total_memory_bytes or 16 * 2**30
    return int(min(4 * 2**30, total // 4))


def _architecture(plugins: PluginManager, checkpoint_config: Mapping[str, Any], where: str) -> Provided:
    names = list(checkpoint_config.get("architectures") or [])
    for provided in plugins.records("model"):
        if any(name in provided.record.architectures for name in names):
            return provided
    known = sorted(a for p in plugins.records("model") for a in p.record.architectures)
    raise AssemblyError(
        [
            f"{where}: architecture {names or '(none given)'} is not provided by any loaded plugin; "
            f"supported: {', '.join(known) or '(none)'}" + _hint_for_missing(plugins)
        ]
    )


def _load_model(
    config: EngineConfig,
    result: Plan,
    architecture: Provided,
    checkpoint: Any,
    attention: Any,
    dtype: torch.dtype,
    needs_moe: bool,
    experts: ExpertParallel | None = None,
) -> tuple[Any, list[Any], int, int]:
    """Build the model, load its weights and allocate its KV cache (on the device thread)."""
    moe = build_moe(result, dtype) if needs_moe else None
    # FP8 experts stay FP8 only where the MoE backend multiplies them itself; on a CPU
    # everything is dequantized at load (there is no FP8 matmul to gain from).
    keeps_fp8 = (
        moe is not None and result.device.type != "cpu" and "fp8-block" in result.chosen("moe").record.capabilities
    )
    context = interfaces.ModelContext(
        config=checkpoint.config,
        dtype=dtype,
        device=result.device,
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
    if can_pack(result.device, dtype):
        log.info("packed linear weights for oneDNN", layers=pack_linears(model))
    if isinstance(attention, interfaces.RMSNormKernel):
        log.info("rmsnorm through the attention backend's kernel", norms=use_norm_kernel(model, attention))

    block_size = config.cache.block_size
    specs = [attention.kv_cache_spec(layer, block_size, dtype) for layer in model.attention_layers]
    if experts is not None and not experts.placement.holds_requests:
        # An expert-only rank holds no requests; a few blocks serve its startup profiles.
        config = attrs.evolve(config, cache=attrs.evolve(config.cache, num_blocks=EXPERT_ONLY_BLOCKS))
    bytes_per_block = sum(spec.bytes_per_block for spec in specs)
    num_blocks = config.cache.num_blocks or _kv_budget_bytes(config, result.platform, result.device) // bytes_per_block
    if num_blocks < 1:
        raise AssemblyError(
            [f"the KV cache budget holds no block of {bytes_per_block} bytes; raise [cache] memory_gib"]
        )
    kv_caches = [spec.allocate(num_blocks, result.device) for spec in specs]
    per_token = sum(spec.bytes_per_token for spec in specs)
    naive = getattr(model, "naive_kv_bytes_per_token", None)
    log.info(
        "kv cache",
        bytes_per_token=per_token,
        **({"bytes_per_token_uncompressed": naive(dtype)} if naive else {}),
        blocks=num_blocks,
        block_size=block_size,
    )
    return model, kv_caches, num_blocks, bytes_per_block


def _build_speculative(
    result: Plan,
    model: Any,
    kv_caches: list[Any],
    num_blocks: int,
    attention: Any,
    dtype: torch.dtype,
    device_thread: Any,
    vocab_size: int,
    expert_parallel_size: int = 1,
) -> Any:
    """The chosen speculative policy, built on the device thread (it profiles the
    target there), or None when speculation is off."""
    from powertrain.engine.speculative import StepsPerSecondProfiler
    from powertrain.interfaces.speculative import SpeculativeContext

    resolution = result.resolutions.get("speculative")
    if resolution is None or resolution.provided is None:
        return None
    record = result.chosen("speculative").record
    block_size = result.config.cache.block_size

    def allocate(layers: Any, extra_blocks: int = 0) -> list[Any]:
        specs = [attention.kv_cache_spec(layer, block_size, dtype) for layer in layers]
        return [spec.allocate(num_blocks + extra_blocks, result.device) for spec in specs]

    context = SpeculativeContext(
        config=result.sections.get(record.config_section) if record.config_section else None,
        model=model,
        vocab_size=vocab_size,
        device=result.device,
        block_size=block_size,
        measure_steps_per_second=StepsPerSecondProfiler(model, kv_caches, block_size, num_blocks, result.device),
        allocate_kv_caches=allocate,
        expert_parallel_size=expert_parallel_size,
    )
    policy = device_thread.run(record.factory, context)
    log.info("speculative decoding", policy=record.name)
    return policy


def model_length(config: EngineConfig, checkpoint_config: Mapping[str, Any]) -> int:
    """Tokens per sequence (prompt + output): the config's limit within the model's."""
    model_limit = int(checkpoint_config.get("max_position_embeddings") or 2048)
    return min(config.model.max_model_len or model_limit, model_limit)


#: KV blocks of a rank that serves experts only (it runs startup profiles, no requests).
EXPERT_ONLY_BLOCKS = 64


def _expert_parallel(result: Plan, placement: RankPlacement | None) -> ExpertParallel | None:
    """Join the process group and build the exchange, when the layout splits experts."""
    layout = layout_of(result.config)
    if placement is None:
        if layout.world_size > 1:
            raise AssemblyError(
                [
                    f"[parallel] data_parallel={layout.data_parallel}, expert_parallel={layout.expert_parallel} "
                    f"runs {layout.world_size} processes: use powertrain.LLM, `powertrain generate` or "
                    "`powertrain serve`, which launch them (powertrain.parallel), not build_engine"
                ]
            )
        return None
    if not layout.expert_parallel_enabled:
        return None
    communicator = build_communicator(
        result,
        rank=placement.rank,
        world_size=layout.world_size,
        init_method=placement.init_method,
        local_rank=0,  # a worker sees only its own accelerator (parallel.worker)
    )
    dispatcher = build_dispatcher(result.chosen("communication").record, communicator)
    log.info("expert parallel", rank=placement.rank, world_size=layout.world_size, dispatcher=type(dispatcher).__name__)
    return ExpertParallel(placement=placement, communicator=communicator, dispatcher=dispatcher)


def _stopped(hooks: Any, engine: Any, experts: ExpertParallel | None) -> None:
    try:
        hooks.powertrain_engine_stopped(engine=engine)
    finally:
        if experts is not None:
            experts.communicator.close()


def build_engine(
    config: EngineConfig | None = None, plugins: PluginManager | None = None, placement: RankPlacement | None = None
) -> Any:
    """Load the model named by ``config`` and assemble a ready ``LLMEngine``.

    Order matters: the checkpoint's config says which architecture (and so which
    capabilities) are needed before components are chosen; the chosen attention
    backend's KVCacheSpec then sizes the cache from the memory budget. ``placement``
    is this process's rank when ``[parallel]`` asks for several (powertrain.parallel).
    """
    from powertrain.engine.block_manager import BlockManager
    from powertrain.engine.device_thread import DeviceThread
    from powertrain.engine.engine import LLMEngine
    from powertrain.engine.model_runner import ModelRunner
    from powertrain.engine.sampler import Sampler
    from powertrain.engine.structured import StructuredOutputs
    from powertrain.interfaces.scheduling import SchedulerContext, SchedulerLimits
    from powertrain.loader import load_checkpoint

    config = config or EngineConfig()
    plugins = plugins or PluginManager.load(config.plugins)
    checkpoint = load_checkpoint(config.model.path)
    architecture = _architecture(plugins, checkpoint.config, str(checkpoint.path))
    requirements = architecture.record.requirements(checkpoint.config) if architecture.record.requirements else {}
    result = plan(config, plugins, requirements=requirements)

    dtype = resolve_dtype(config.model.dtype, result.platform, checkpoint.config)
    attention = build_attention(result, dtype)
    if placement is not None and placement.layout.expert_parallel_enabled and "moe" not in requirements:
        raise AssemblyError(
            [
                f"expert_parallel={placement.layout.expert_parallel}: {checkpoint.path} has no routed experts "
                f"({architecture.record.name}); use data_parallel alone"
            ]
        )
    experts = _expert_parallel(result, placement)
    device_thread = DeviceThread()
    try:
        model, kv_caches, num_blocks, bytes_per_block = device_thread.run(
            _load_model, config, result, architecture, checkpoint, attention, dtype, "moe" in requirements, experts
        )
    except BaseException:
        device_thread.shutdown()
        if experts is not None:
            experts.communicator.close()
        raise
    block_size = config.cache.block_size
    block_manager = BlockManager(num_blocks, block_size, config.cache.prefix_caching)
    limits = SchedulerLimits(
        max_num_seqs=config.scheduler.max_num_seqs,
        max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
        chunked_prefill=config.scheduler.chunked_prefill,
    )
    scheduler = result.chosen("scheduler").record.factory(SchedulerContext(limits=limits, block_manager=block_manager))
    runner = ModelRunner(
        model,
        kv_caches,
        block_size,
        result.device,
        Sampler(config.model.seed),
        structured=StructuredOutputs(checkpoint.tokenizer),
    )
    if experts is not None:
        runner.lockstep = Lockstep(
            experts.communicator,
            model.routed_expert_layers(),
            int(checkpoint.config["hidden_size"]),
            dtype,
            result.device,
        )
    runner.speculative = _build_speculative(
        result,
        model,
        kv_caches,
        num_blocks,
        attention,
        dtype,
        device_thread,
        int(checkpoint.config["vocab_size"]),
        experts.placement.layout.expert_parallel if experts else 1,
    )
    max_model_len = model_length(config, checkpoint.config)

    hooks = plugins.hook
    on_step = None
    if hooks.powertrain_step_finished.get_hookimpls():  # no per-step pluggy call unless someone listens

        def on_step(engine: Any, stats: Any) -> None:
            hooks.powertrain_step_finished(engine=engine, stats=stats)

    engine = LLMEngine(
        tokenizer=checkpoint.tokenizer,
        scheduler=scheduler,
        block_manager=block_manager,
        runner=runner,
        max_model_len=max_model_len,
        async_scheduling=config.scheduler.async_scheduling,
        on_step=on_step,
        on_shutdown=lambda e: _stopped(hooks, e, experts),
        model_name=config.model.path,
        model_config=checkpoint.config,
        device_thread=device_thread,
    )
    log.info(
        "engine ready",
        model=config.model.path,
        dtype=str(dtype),
        attention=result.resolutions["attention"].name,
        kv_blocks=num_blocks,
        kv_gib=round(num_blocks * bytes_per_block / 2**30, 3),
    )
    hooks.powertrain_engine_started(engine=engine)
    return engine

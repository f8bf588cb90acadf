"""The records that component hooks return.

A record describes one implementation (its name, where it runs, what it can do, how
to build it) without building it: assembly reads records, picks one per component
kind and only then calls its ``factory``. Records are frozen and validated on
construction, so a plugin that returns a malformed one fails at registration with a
message naming the field, not deep inside a forward pass.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:  # the contracts import this module (PlatformInfo, Availability), so only for types
    import torch

    from powertrain.interfaces import (
        AttentionBackend,
        AttentionBackendContext,
        CausalLM,
        Communicator,
        CommunicatorContext,
        ExpertDispatcher,
        KVStore,
        KVStoreContext,
        MLAAttentionBackend,
        ModelContext,
        ModelTokenizer,
        MoEBackend,
        MoEBackendContext,
        ProtocolAdapter,
        QuantizedLinearContext,
        QuantizedLinearKernel,
        Scheduler,
        SchedulerContext,
        SpeculativeContext,
        SpeculativePolicy,
    )

#: Component names are what users type into engine.toml and see in CLI output.
NAME_PATTERN = re.compile(r"^[a-z0-9][a-z0-9_.\-]*$")

#: Capability tags an attention backend may declare; tests and selection key on them.
ATTENTION_CAPABILITIES = frozenset(
    {
        "gqa",
        "mha",
        "mla",
        "paged",
        "prefill",
        "decode",
        "chunked-prefill",
        "sliding-window",
        # Layers with AttentionLayerSpec.causal False: new tokens also see the step's later ones.
        "non-causal",
        "batch-invariant",
        # Decode steps through it may be captured as CUDA graphs and replayed (see
        # interfaces.attention: no host syncs, host lengths used only as bounds).
        "cuda-graphs",
        # The backend also fuses small layer ops where it is active (interfaces.attention):
        "fused-rotary",  # RotaryAttentionBackend: rotary embedding fused with the cache write
        "fused-rmsnorm",  # RMSNormKernel: RMSNorm (+ the residual add before it)
        "fused-decoder",  # DecoderStackKernel: whole Llama-shaped decoder stacks for small steps
        "kv-store",  # KVStoreAttentionBackend: a step's keys and values written without attending
        # Extra forward paths:
        "sparse-mla",  # SparseMLAAttentionBackend: MLA over indexer-picked top-k tokens (DSA)
        "v4-attention",  # V4AttentionBackend: sliding window + compressed entries + sinks (DeepSeek-V4)
        "lightning-indexer",  # LightningIndexerBackend: the indexer's scores and top-k (V3.2 DSA, V4 CSA)
    }
)

#: Capability tags a MoE backend may declare.
MOE_CAPABILITIES = frozenset(
    {
        "bf16",
        "fp16",
        "fp32",
        "fp8-block",
        "fp4",  # packed FP4 (e2m1, ue8m0 per 32 columns) experts, ExpertWeights.fp4 (DeepSeek-V4)
        "batch-invariant",
        "cuda-graphs",  # forward runs under CUDA graph capture: no host syncs (interfaces.moe)
        "fused-routing",  # the backend also picks experts with a fused gating op (interfaces.MoERouter)
        "swiglu-limit",  # clamped SwiGLU, ExpertWeights.swiglu_limit (DeepSeek-V4)
    }
)

#: Capability tags a quantised-linear backend may declare: the ``QuantizedWeight`` formats it multiplies.
QUANTIZED_LINEAR_CAPABILITIES = frozenset({"q4", "q8"})


def _valid_name(instance: Any, attribute: attrs.Attribute, value: str) -> None:
    if not isinstance(value, str) or not NAME_PATTERN.match(value):
        raise ValueError(
            f"{type(instance).__name__}.{attribute.name} must be a lowercase name "
            f"like 'triton-sm100' (letters, digits, '-', '_', '.'), got {value!r}"
        )


def _known_tags(allowed: frozenset[str]) -> Callable[[Any, attrs.Attribute, frozenset[str]], None]:
    def check(instance: Any, attribute: attrs.Attribute, value: frozenset[str]) -> None:
        unknown = set(value) - allowed
        if unknown:
            raise ValueError(
                f"{type(instance).__name__}.{attribute.name}: unknown tags {sorted(unknown)}; known: {sorted(allowed)}"
            )

    return check


def _absent_tags(allowed: frozenset[str]) -> Callable[[Any, attrs.Attribute, Mapping[str, str]], None]:
    """``absent`` names known tags the record does not declare, each with a reason."""

    def check(instance: Any, attribute: attrs.Attribute, value: Mapping[str, str]) -> None:
        _known_tags(allowed)(instance, attribute, frozenset(value))
        declared = set(value) & set(instance.capabilities)
        if declared:
            raise ValueError(f"{type(instance).__name__}: {sorted(declared)} both declared and listed as absent")
        for tag, why in value.items():
            if not isinstance(why, str) or not why.strip():
                raise ValueError(f"{type(instance).__name__}.absent[{tag!r}]: say why the capability is absent")

    return check


def _callable(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and not callable(value):
        raise TypeError(f"{type(instance).__name__}.{attribute.name} must be callable, got {value!r}")


_tags = attrs.field(converter=frozenset, factory=frozenset)


@attrs.frozen(kw_only=True)
class Availability:
    """Whether something can run here, and if not, exactly why."""

    available: bool
    reason: str = ""

    @classmethod
    def yes(cls, reason: str = "") -> Availability:
        return cls(available=True, reason=reason)

    @classmethod
    def no(cls, reason: str) -> Availability:
        if not reason:
            raise ValueError("an unavailable component must say why")
        return cls(available=False, reason=reason)

    def __str__(self) -> str:
        if self.available:
            return f"available{': ' + self.reason if self.reason else ''}"
        return f"unavailable: {self.reason}"


def _dtypes(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    """A torch.dtype, None, or a set of dtypes (torch is imported only when a value is checked)."""
    import torch

    values = value if isinstance(value, frozenset) else set() if value is None else {value}
    wrong = [v for v in values if not isinstance(v, torch.dtype)]
    if wrong:
        raise TypeError(f"{type(instance).__name__}.{attribute.name} takes torch.dtype values, got {wrong!r}")


@attrs.frozen(kw_only=True)
class PlatformInfo:
    """What detection found for one device family on this machine, and the facts core
    acts on there instead of branching on a platform's name.

    The facts below ``dist_backend`` say how the family is used (which variable pins a
    process to its device, whether its barrier needs device ids, ...); ``detect`` fills
    them whether or not it found hardware, so an unavailable platform still reads true.
    Their defaults are what is safe for a new family: no device selection, no FP8
    weights, no weight packing, a memory budget from ``total_memory_bytes``.
    """

    name: str
    device_type: str
    availability: Availability
    device_count: int = 0
    device_name: str = ""
    #: (major, minor) compute capability where the family has one (CUDA), else None.
    capability: tuple[int, int] | None = None
    total_memory_bytes: int = 0
    dist_backend: str = "gloo"

    #: The host CPU itself: always present, so platform selection is judged against it
    #: and a plan that resolves no platform reports it.
    host: bool = False
    #: What ``dtype = "auto"`` means here; None: the checkpoint's half precision
    #: (bfloat16 when it names none), right for accelerators.
    auto_dtype: torch.dtype | None = attrs.field(default=None, validator=_dtypes)
    #: Why ``auto_dtype`` is this platform's choice (logged when ``dtype = "auto"`` picks it).
    auto_dtype_note: str = ""
    #: Each local rank owns one device, ``torch.device(device_type, local_rank)``; False:
    #: all ranks share the one un-indexed device (the host).
    device_per_rank: bool = False
    #: Environment variable that limits a process to some of the devices (set before the
    #: device runtime starts), e.g. CUDA_VISIBLE_DEVICES; None: the family has none.
    visible_devices_env: str | None = None
    #: Ranks on this family compute on the host's cores, so a launcher splits torch's
    #: threads among the local ranks instead of oversubscribing them.
    shares_host_cores: bool = False
    #: Where ranks compute on the host's cores: the CPUs this process may use (its affinity
    #: mask and cgroup CPU quota, ``powertrain.cpu_budget``), which caps torch's threads
    #: and the launcher's split; and what limits them. None: not such a platform.
    host_cpus: int | None = None
    host_cpus_reason: str = ""
    #: Makes a device this process's current one (``torch.cuda.set_device``); collective
    #: backends set up groups and barriers on the current device. None: nothing to select.
    set_device: Callable[[torch.device], None] | None = attrs.field(default=None, validator=_callable)
    #: The ``dist_backend``'s barrier must be told the device (``barrier(device_ids=)``),
    #: as NCCL's must, or it guesses one.
    barrier_needs_device_ids: bool = False
    #: Free bytes on a device now, ``free_memory(torch.device) -> int``: the KV cache is
    #: sized from it. None: sized from ``total_memory_bytes`` instead.
    free_memory: Callable[[torch.device], int] | None = attrs.field(default=None, validator=_callable)
    #: Copies between this family's devices and host memory go through pinned (page-locked)
    #: host buffers and run asynchronously (the KV tiers' block copies); False: plain
    #: synchronous copies, the only kind a host device needs.
    pinned_host_copies: bool = False
    #: FP8 checkpoint weights may stay FP8 here, for MoE backends that multiply them
    #: directly; False: they are dequantized at load (no FP8 matmul to gain from).
    keeps_fp8_weights: bool = False
    #: Decode steps may be captured as CUDA graphs (``torch.cuda.CUDAGraph``) and replayed
    #: (``engine.cuda_graphs``); False: every step launches its kernels from Python.
    cuda_graphs: bool = False
    #: Dtypes whose projection weights are packed once at load for this platform's
    #: kernels (oneDNN on a CPU: ``layers.linear``); others run plain ``F.linear``.
    packed_linear_dtypes: frozenset[torch.dtype] = attrs.field(
        converter=frozenset, factory=frozenset, validator=_dtypes
    )
    #: Why ``packed_linear_dtypes`` holds what it holds, logged when a dtype is not packed;
    #: empty where packing is not a thing (accelerators).
    linear_packing_note: str = ""

    @property
    def available(self) -> bool:
        return self.availability.available


@attrs.frozen(kw_only=True)
class PlatformRecord:
    """A device family (`cpu`, `cuda`, `npu`).

    ``detect`` must never raise because hardware or an SDK is missing: it returns a
    PlatformInfo whose availability says why not. Vendor SDK imports belong inside it.
    What core does differently per family (free memory, the visible-devices variable,
    weight packing, ...) are facts of that PlatformInfo, so they reach every backend
    context with it: a new family gets what CUDA gets by filling them in.
    """

    name: str = attrs.field(validator=_valid_name)
    device_type: str
    dist_backend: str
    detect: Callable[[], PlatformInfo] = attrs.field(validator=_callable)
    #: Used by "auto": among available platforms the highest priority wins.
    priority: int = 0
    description: str = ""


@attrs.frozen(kw_only=True)
class _Implementation:
    """Fields every selectable implementation shares (each kind adds its typed ``factory``)."""

    name: str = attrs.field(validator=_valid_name)
    #: Platform names this implementation runs on, e.g. {"cuda"}.
    platforms: frozenset[str] = attrs.field(converter=frozenset)
    priority: int = 0
    #: Optional extra check beyond the platform (a library present, a capability high
    #: enough). Called with the detected PlatformInfo; never raises for absent hardware.
    check: Callable[[PlatformInfo], Availability] | None = attrs.field(default=None, validator=_callable)
    description: str = ""

    def availability(self, platform: PlatformInfo) -> Availability:
        if platform.name not in self.platforms:
            return Availability.no(f"runs on {', '.join(sorted(self.platforms))}, not on platform {platform.name!r}")
        if not platform.available:
            return Availability.no(f"platform {platform.name}: {platform.availability.reason}")
        if self.check is None:
            return Availability.yes()
        try:
            result = self.check(platform)
        except Exception as exc:  # a broken check must not take the engine down
            return Availability.no(f"availability check failed: {type(exc).__name__}: {exc}")
        if not isinstance(result, Availability):
            return Availability.no(f"availability check returned {result!r}, not an Availability")
        return result


@attrs.frozen(kw_only=True)
class AttentionBackendRecord(_Implementation):
    """An attention implementation. ``factory(AttentionBackendContext)`` builds it."""

    factory: Callable[[AttentionBackendContext], AttentionBackend | MLAAttentionBackend] = attrs.field(
        validator=_callable
    )
    capabilities: frozenset[str] = attrs.field(converter=frozenset, validator=_known_tags(ATTENTION_CAPABILITIES))
    #: Capabilities deliberately not declared, with why (an operator the vendor does not
    #: document, semantics that cannot be pinned down): ``powertrain plugins`` and a
    #: refused selection say so, instead of the backend guessing.
    absent: Mapping[str, str] = attrs.field(
        factory=dict, converter=dict, validator=_absent_tags(ATTENTION_CAPABILITIES)
    )


@attrs.frozen(kw_only=True)
class MoEBackendRecord(_Implementation):
    """A MoE grouped-GEMM implementation. ``factory(MoEBackendContext)`` builds it."""

    factory: Callable[[MoEBackendContext], MoEBackend] = attrs.field(validator=_callable)
    capabilities: frozenset[str] = attrs.field(converter=frozenset, validator=_known_tags(MOE_CAPABILITIES))
    #: As ``AttentionBackendRecord.absent``.
    absent: Mapping[str, str] = attrs.field(factory=dict, converter=dict, validator=_absent_tags(MOE_CAPABILITIES))


@attrs.frozen(kw_only=True)
class QuantizedLinearRecord(_Implementation):
    """A weight-only quantised matmul (``interfaces.QuantizedLinearKernel``).
    ``factory(QuantizedLinearContext)`` builds it; ``capabilities`` are the formats it multiplies."""

    factory: Callable[[QuantizedLinearContext], QuantizedLinearKernel] = attrs.field(validator=_callable)
    capabilities: frozenset[str] = attrs.field(
        converter=frozenset, validator=_known_tags(QUANTIZED_LINEAR_CAPABILITIES)
    )
    #: True for an implementation that expands the weight to a dense copy on every call (the
    #: reference): correct everywhere, but slower than dequantising once at load, so
    #: ``quantization = "auto"`` keeps weights quantised only with a backend that does not.
    expands_weights: bool = False
    #: Calls of at most this many rows run on the backend's own CPU thread pool (0: none do).
    #: In steps that small the engine runs torch's own ops on one thread, so that torch's
    #: OpenMP workers do not take the cores the pool needs (decode steps, where torch's ops
    #: are tiny and the quantised matmuls are most of the work).
    own_pool_max_rows: int = attrs.field(default=0, validator=attrs.validators.ge(0))


@attrs.frozen(kw_only=True)
class CommunicatorRecord(_Implementation):
    """Collectives (and expert-parallel dispatch) for a platform.

    ``factory(CommunicatorContext)`` builds it; ``max_world_size`` of 1 marks a
    single-process implementation.
    """

    factory: Callable[[CommunicatorContext], Communicator] = attrs.field(validator=_callable)
    max_world_size: int | None = None
    #: Optional expert-parallel exchange built on a communicator of this kind:
    #: ``dispatcher(communicator) -> interfaces.ExpertDispatcher``; the communicator
    #: exposes its torch.distributed ``group`` for ops that need the process group.
    dispatcher: Callable[[Communicator], ExpertDispatcher] | None = attrs.field(default=None, validator=_callable)


@attrs.frozen(kw_only=True)
class SchedulerRecord:
    """A batch-forming policy. ``factory(SchedulerContext)`` (the limits, the block
    manager) builds an ``interfaces.Scheduler``; it serves any sequence type, so the
    record does not fix one."""

    name: str = attrs.field(validator=_valid_name)
    factory: Callable[[SchedulerContext[Any]], Scheduler[Any]] = attrs.field(validator=_callable)
    description: str = ""


@attrs.frozen(kw_only=True)
class KVStoreRecord:
    """A store for cache blocks below the device cache (``interfaces.kv_store``).

    ``factory(KVStoreContext)`` builds an ``interfaces.KVStore``. ``config_section`` names
    the plugin's config section that parameterises it (a server address, say), if any.
    """

    name: str = attrs.field(validator=_valid_name)
    factory: Callable[[KVStoreContext], KVStore] = attrs.field(validator=_callable)
    config_section: str | None = None
    description: str = ""


@attrs.frozen(kw_only=True)
class SpeculativePolicyRecord:
    """A speculative-decoding method: drafter, length policy and verifier together.

    ``factory(SpeculativeContext)`` builds an ``interfaces.SpeculativePolicy``.
    ``config_section`` names the plugin's config section that parameterises it, if any.
    """

    name: str = attrs.field(validator=_valid_name)
    factory: Callable[[SpeculativeContext], SpeculativePolicy] = attrs.field(validator=_callable)
    config_section: str | None = None
    #: its config section as engine.toml has it ({} when absent) -> capability tags it needs
    #: of other component kinds, e.g. a block drafter {"attention": {"non-causal"}};
    #: assembly selects accordingly, as for a model's requirements.
    requirements: Callable[[Mapping[str, Any]], Mapping[str, Iterable[str]]] | None = attrs.field(
        default=None, validator=_callable
    )
    description: str = ""


@attrs.frozen(kw_only=True)
class ProtocolAdapterRecord:
    """Request protocols -> conversation -> prompt tokens, and outputs back.

    ``factory(tokenizer, model_config)`` builds the ``interfaces.ProtocolAdapter`` of one
    loaded model from its tokenizer and its config.json dict.
    """

    name: str = attrs.field(validator=_valid_name)
    factory: Callable[[ModelTokenizer, Mapping[str, Any]], ProtocolAdapter] = attrs.field(validator=_callable)
    #: e.g. {"openai.chat", "openai.responses", "anthropic.messages"}
    protocols: frozenset[str] = attrs.field(converter=frozenset)
    priority: int = 0
    description: str = ""


@attrs.frozen(kw_only=True)
class ModelArchitectureRecord:
    """Checkpoint architecture names (config.json ``architectures``) -> model factory.

    ``factory(ModelContext)`` builds the ``interfaces.CausalLM``.
    """

    name: str = attrs.field(validator=_valid_name)
    architectures: frozenset[str] = attrs.field(converter=frozenset)
    factory: Callable[[ModelContext], CausalLM] = attrs.field(validator=_callable)
    #: checkpoint config -> capability tags the model needs per component kind, e.g.
    #: {"attention": {"gqa", "sliding-window"}}; assembly selects accordingly.
    requirements: Callable[[Mapping[str, Any]], Mapping[str, Iterable[str]]] | None = attrs.field(
        default=None, validator=_callable
    )
    description: str = ""


@attrs.frozen(kw_only=True)
class ConfigSectionRecord:
    """A plugin's own engine.toml table, validated by the plugin's attrs class."""

    name: str = attrs.field(validator=_valid_name)
    config_class: type = attrs.field()
    description: str = ""

    @config_class.validator
    def _check_attrs_class(self, attribute: attrs.Attribute, value: type) -> None:
        if not (isinstance(value, type) and attrs.has(value)):
            raise TypeError(f"ConfigSectionRecord {self.name!r}: config_class must be an attrs class, got {value!r}")


#: Component kind -> (hook name, record type, config key in [components] or None).
#: The single table that assembly, the CLI and the conformance kit iterate over.
COMPONENT_KINDS: dict[str, tuple[str, type, str | None]] = {
    "platform": ("powertrain_platforms", PlatformRecord, "platform"),
    "attention": ("powertrain_attention_backends", AttentionBackendRecord, "attention"),
    "moe": ("powertrain_moe_backends", MoEBackendRecord, "moe"),
    "quantized_linear": ("powertrain_quantized_linear_backends", QuantizedLinearRecord, "quantized_linear"),
    "communication": ("powertrain_communicators", CommunicatorRecord, "communication"),
    "scheduler": ("powertrain_schedulers", SchedulerRecord, "scheduler"),
    "speculative": ("powertrain_speculative_policies", SpeculativePolicyRecord, "speculative"),
    "kv_store": ("powertrain_kv_stores", KVStoreRecord, "kv_store"),
    "protocol": ("powertrain_protocol_adapters", ProtocolAdapterRecord, None),
    "model": ("powertrain_model_architectures", ModelArchitectureRecord, None),
    "config-section": ("powertrain_config_sections", ConfigSectionRecord, None),
}

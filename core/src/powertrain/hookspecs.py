"""Every hook of powertrain, in one place.

Hooks are the control plane (DESIGN §2). Component hooks are called by the plugin
manager once per plugin, when it registers the plugin (in every process that loads
plugins); their records are validated there and kept for assembly and the CLI.
Observers run at most once per engine step. Nothing here is called per layer or per
token.

A plugin is a module with ``POWERTRAIN_HOOK_API = <version>`` and functions decorated
with ``powertrain.hookimpl`` whose names (and argument names) match the specs below.
Component hooks take no arguments and return a list of records (an empty list is
fine); every plugin's results are collected, none wins over another.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from powertrain.components import (
        AttentionBackendRecord,
        CommunicatorRecord,
        ConfigSectionRecord,
        KVStoreRecord,
        ModelArchitectureRecord,
        MoEBackendRecord,
        PlatformInfo,
        PlatformRecord,
        ProtocolAdapterRecord,
        QuantizedLinearRecord,
        SchedulerRecord,
        SpeculativePolicyRecord,
    )
    from powertrain.config import EngineConfig
    from powertrain.selection import Candidate, Selection

PROJECT = "powertrain"

#: The hook API this core implements. A plugin declares the version it was written
#: for as ``POWERTRAIN_HOOK_API``; it loads if that version is in SUPPORTED_HOOK_APIS.
HOOK_API_VERSION = 1
SUPPORTED_HOOK_APIS: tuple[int, ...] = (1,)

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


# --------------------------------------------------------------------------- components


@hookspec
def powertrain_platforms() -> list[PlatformRecord]:
    """Device families this plugin can detect (``cpu``, ``cuda``, ``npu``, ...).

    Called by the plugin manager once per plugin at registration. Returns a list of
    PlatformRecord; all plugins' lists are collected (no first-result). Detection itself happens in
    the record's ``detect`` (lazily, never at import time).
    """


@hookspec
def powertrain_attention_backends() -> list[AttentionBackendRecord]:
    """Attention implementations: name, platforms, capabilities, priority, factory.

    Called by the plugin manager once per plugin at registration. All plugins'
    records are collected (no first-result); the selection hook picks one per
    engine. The factory receives an AttentionBackendContext and returns an object
    satisfying ``interfaces.AttentionBackend`` (if it declares gqa/mha) and
    ``MLAAttentionBackend`` (if it declares mla).
    """


@hookspec
def powertrain_moe_backends() -> list[MoEBackendRecord]:
    """MoE grouped-GEMM implementations (bf16, fp8 block-scaled, ...).

    Called by the plugin manager once per plugin at registration; all results are
    collected (no first-result). The factory
    receives a MoEBackendContext and returns an ``interfaces.MoEBackend``.
    """


@hookspec
def powertrain_quantized_linear_backends() -> list[QuantizedLinearRecord]:
    """Weight-only quantised matmuls for weights kept quantised (GGUF's Q4/Q8/k-quants).

    Called by the plugin manager once per plugin at registration; all results are
    collected (no first-result). The factory receives a QuantizedLinearContext and
    returns an ``interfaces.QuantizedLinearKernel``.
    """


@hookspec
def powertrain_communicators() -> list[CommunicatorRecord]:
    """Collectives and expert-parallel dispatch/combine for a platform.

    Called by the plugin manager once per plugin at registration (in every worker
    process); all results are collected (no first-result). The factory receives a CommunicatorContext and returns an
    ``interfaces.Communicator``.
    """


@hookspec
def powertrain_schedulers() -> list[SchedulerRecord]:
    """Batch-forming policies, chosen by name (``[components] scheduler``).

    Called by the plugin manager once per plugin at registration; all results are
    collected (no first-result).
    """


@hookspec
def powertrain_speculative_policies() -> list[SpeculativePolicyRecord]:
    """Speculative-decoding methods (drafter, length policy, verifier).

    Called by the plugin manager once per plugin at registration; all results are
    collected (no first-result). Assembly picks one unless ``[components]
    speculative`` is ``"none"``.
    """


@hookspec
def powertrain_kv_stores() -> list[KVStoreRecord]:
    """Stores that keep cache blocks below the device cache (``interfaces.kv_store``),
    chosen by name (``[components] kv_store``; "none": no storage tier).

    Called by the plugin manager once per plugin at registration; all results are
    collected (no first-result).
    """


@hookspec
def powertrain_protocol_adapters() -> list[ProtocolAdapterRecord]:
    """Request protocol adapters (OpenAI chat/responses, Anthropic messages, ...).

    Called by the plugin manager once per plugin at registration; all results are
    collected (no first-result) and the server uses the highest priority adapter
    serving a protocol.
    """


@hookspec
def powertrain_model_architectures() -> list[ModelArchitectureRecord]:
    """Model classes by checkpoint architecture name (config.json ``architectures``).

    Called by the plugin manager once per plugin at registration; all results are
    collected (no first-result) and an architecture name provided twice is an error
    naming both plugins. The loader looks the checkpoint's architecture up here.
    """


@hookspec
def powertrain_config_sections() -> list[ConfigSectionRecord]:
    """A plugin's own engine.toml tables and the attrs classes that validate them.

    Called by the plugin manager once per plugin at registration; all results are
    collected (no first-result). Assembly validates each table with its class; a
    table in engine.toml that no plugin declares is an error.
    """


# --------------------------------------------------------------------------- selection


@hookspec(firstresult=True)
def powertrain_select_component(
    kind: str,
    requested: str,
    candidates: list[Candidate],
    platform: PlatformInfo,
    requirements: frozenset[str],
) -> Selection | None:
    """Choose the implementation of one component kind.

    Called by assembly once per component kind per engine build (and by
    ``powertrain config check``). ``requested`` is the config value (a name or
    ``"auto"``); ``candidates`` are every registered record of that kind with its
    availability on ``platform`` and the plugin that provided it; ``requirements`` are
    capability tags the model needs (e.g. {"mla"}).

    First non-None result wins. The builtin rule is ``trylast``: explicit names are
    honoured (or refused with the list of available ones), "auto" picks the highest
    priority available candidate meeting the requirements. A plugin may return a
    Selection to override the choice, or None to defer.
    """


# --------------------------------------------------------------------------- lifecycle


@hookspec(historic=True)
def powertrain_configure(config: EngineConfig, sections: dict[str, Any]) -> None:
    """The engine's validated config, and each plugin section's validated object.

    Called by assembly once per config (per process), after validating it.
    Historic: a plugin registered later still receives the call on registration.
    Return values are ignored.
    """


@hookspec
def powertrain_engine_started(engine: Any) -> None:
    """The engine is assembled, weights are loaded and the loop is about to run.

    Called once per engine, in every worker process. Return values are ignored.
    """


@hookspec
def powertrain_engine_stopped(engine: Any) -> None:
    """The engine has stopped (normally or after an error) and released its cache.

    Called once per engine, in every worker process. Return values are ignored.
    """


@hookspec
def powertrain_step_finished(engine: Any, stats: Any) -> None:
    """One engine step is done; ``stats`` says what it scheduled and produced.

    Called at most once per engine step, outside the per-layer path; keep it cheap.
    Return values are ignored.
    """

"""Every hook of powertrain, in one place.

Hooks are the control plane (DESIGN §2): assembly calls the component hooks once
per engine build to collect records; observers run at most once per engine step.
Nothing here is called per layer or per token.

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
        ModelArchitectureRecord,
        MoEBackendRecord,
        PlatformInfo,
        PlatformRecord,
        ProtocolAdapterRecord,
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

    Called by assembly and ``powertrain plugins`` once per process. Returns a list
    of PlatformRecord; all plugins' lists are collected. Detection itself happens in
    the record's ``detect`` (lazily, never at import time).
    """


@hookspec
def powertrain_attention_backends() -> list[AttentionBackendRecord]:
    """Attention implementations: name, platforms, capabilities, priority, factory.

    Called by assembly once per engine build. All plugins' records are collected;
    the selection hook picks one. The factory receives an AttentionBackendContext and
    returns an object satisfying ``interfaces.AttentionBackend`` (and
    ``MLAAttentionBackend`` if the record declares ``mla``).
    """


@hookspec
def powertrain_moe_backends() -> list[MoEBackendRecord]:
    """MoE grouped-GEMM implementations (bf16, fp8 block-scaled, ...).

    Called by assembly once per engine build; all results are collected. The factory
    receives a MoEBackendContext and returns an ``interfaces.MoEBackend``.
    """


@hookspec
def powertrain_communicators() -> list[CommunicatorRecord]:
    """Collectives and expert-parallel dispatch/combine for a platform.

    Called by assembly once per engine build (in every worker process); all results
    are collected. The factory receives a CommunicatorContext and returns an
    ``interfaces.Communicator``.
    """


@hookspec
def powertrain_schedulers() -> list[SchedulerRecord]:
    """Batch-forming policies, chosen by name (``[components] scheduler``).

    Called by assembly once per engine build; all results are collected.
    """


@hookspec
def powertrain_speculative_policies() -> list[SpeculativePolicyRecord]:
    """Speculative-decoding methods (drafter, length policy, verifier).

    Called by assembly once per engine build when ``[components] speculative`` is
    not ``"none"``; all results are collected.
    """


@hookspec
def powertrain_protocol_adapters() -> list[ProtocolAdapterRecord]:
    """Request protocol adapters (OpenAI chat/responses, Anthropic messages, ...).

    Called by the server at start-up; all results are collected and the highest
    priority adapter serving a protocol handles it.
    """


@hookspec
def powertrain_model_architectures() -> list[ModelArchitectureRecord]:
    """Model classes by checkpoint architecture name (config.json ``architectures``).

    Called by the loader once per model load; all results are collected and an
    architecture name provided twice is an error naming both plugins.
    """


@hookspec
def powertrain_config_sections() -> list[ConfigSectionRecord]:
    """A plugin's own engine.toml tables and the attrs classes that validate them.

    Called once when a config is loaded; all results are collected. A table in
    engine.toml that no plugin declares is an error.
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

    Called once per process after config loading. Historic: a plugin registered
    later still receives the call on registration. Return values are ignored.
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

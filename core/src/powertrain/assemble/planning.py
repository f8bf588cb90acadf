"""Planning: which implementation each component kind gets on this machine, and why.

``plan`` resolves every kind (platform, attention, moe, quantized_linear, communication,
scheduler, speculative, kv_store) from the config, the loaded plugins and the capabilities the model needs;
it builds nothing, so ``powertrain config check`` prints exactly what it decided.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch

from powertrain.components import Availability, PlatformInfo
from powertrain.config import EngineConfig, validate_sections
from powertrain.parallel.layout import layout_of
from powertrain.plugins import PluginManager, Provided
from powertrain.selection import Candidate, Selection, SelectionError

#: Kinds chosen through ``[components]``, in the order they are resolved.
SELECTED_KINDS = ("attention", "moe", "quantized_linear", "communication", "scheduler", "speculative", "kv_store")

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
    becomes needed. The speculative policy the config names adds its own
    (``SpeculativePolicyRecord.requirements``). With ``strict`` any problem raises AssemblyError listing all of
    them; otherwise the problems stay in the returned plan for reporting.
    """
    plugins = plugins or PluginManager.load(config.plugins)
    requirements = {kind: frozenset(tags) for kind, tags in (requirements or {}).items()}
    for kind, tags in _speculative_requirements(config, plugins).items():
        requirements[kind] = requirements.get(kind, frozenset()) | tags
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
        if kind in ("speculative", "kv_store") and requested == "none":
            resolutions[kind] = Resolution(kind=kind, requested=requested, reason=f"disabled ({kind} = none)")
            continue
        if kind == "kv_store" and requested == "auto":  # a store holds data: never chosen for the user
            resolutions[kind] = Resolution(kind=kind, requested=requested, reason="none unless one is named")
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


def _speculative_requirements(config: EngineConfig, plugins: PluginManager) -> dict[str, frozenset[str]]:
    """What the speculative policy named in the config needs of other kinds, for its
    section's settings (a block drafter needs non-causal attention)."""
    for provided in plugins.records("speculative"):
        record = provided.record
        if record.name == config.components.speculative and record.requirements is not None:
            section = config.sections.get(record.config_section, {}) if record.config_section else {}
            return {kind: frozenset(tags) for kind, tags in record.requirements(section).items()}
    return {}


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
    host = next((info for info in detected.values() if info.host), None) or next(iter(detected.values()), None)
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


def find_architecture(plugins: PluginManager, checkpoint_config: Mapping[str, Any], where: str) -> Provided:
    """The model plugin serving the checkpoint's ``architectures``; it says which
    capabilities the model needs, so it is found before anything is planned."""
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

"""Finding, vetting and registering plugins; collecting their records.

Builtin plugins and entry-point plugins go through the same ``register`` path:
import the module (a failure is recorded as *broken*, with distribution, entry point
and exception), check the hook API it declares (an incompatible one is *refused*),
register its hookimpls with pluggy (every hookimpl must match a spec), then collect
its component records once (malformed records make it *broken*). Duplicate
component names across plugins are a conflict naming both distributions.

Environment:
  POWERTRAIN_DISABLE_PLUGIN_AUTOLOAD=1  load no entry-point plugin unless POWERTRAIN_PLUGINS names it
  POWERTRAIN_PLUGINS=a,b                load only these entry-point plugins
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
import os
import traceback
from collections.abc import Mapping
from types import ModuleType
from typing import Any, Literal

import attrs
import pluggy
import structlog

from powertrain import hookspecs
from powertrain.components import COMPONENT_KINDS, Availability, PlatformInfo, PlatformRecord
from powertrain.config import PluginsConfig

log = structlog.get_logger(__name__)

ENTRY_POINT_GROUP = "powertrain.plugins"
ENV_ALLOWLIST = "POWERTRAIN_PLUGINS"
ENV_NO_AUTOLOAD = "POWERTRAIN_DISABLE_PLUGIN_AUTOLOAD"

#: Builtin plugins: name -> module. Loaded through the same path as entry points.
BUILTIN_PLUGINS: dict[str, str] = {
    "builtin-platforms": "powertrain.builtin.platforms",
    "builtin-selection": "powertrain.builtin.selection",
    "builtin-communicators": "powertrain.builtin.communicators",
    "builtin-attention": "powertrain.builtin.attention",
    "builtin-moe": "powertrain.builtin.moe",
    "builtin-quantized-linear": "powertrain.builtin.quantized_linear",
    "builtin-scheduler": "powertrain.builtin.scheduler",
    "builtin-kv-stores": "powertrain.builtin.kv_stores",
    "builtin-models": "powertrain.builtin.models",
}

Status = Literal["loaded", "disabled", "broken", "refused"]


class PluginError(RuntimeError):
    """A plugin problem that stops assembly (conflicts, a needed plugin broken)."""


@attrs.define(kw_only=True)
class PluginInfo:
    """What is known about one plugin, whatever became of it."""

    name: str
    module: str
    distribution: str
    version: str
    source: Literal["builtin", "entry-point", "explicit"]
    status: Status = "loaded"
    error: str = ""
    hook_api: int | None = None
    #: Component kind -> names this plugin provides (filled once loaded).
    provides: dict[str, list[str]] = attrs.field(factory=dict)
    traceback: str = attrs.field(default="", repr=False)

    def as_dict(self) -> dict[str, Any]:
        return attrs.asdict(self, filter=lambda a, _: a.name != "traceback")


@attrs.frozen(kw_only=True)
class Provided:
    """A record together with the plugin that provided it."""

    record: Any
    plugin: PluginInfo


def _distribution_of(module_name: str) -> tuple[str, str]:
    top = module_name.split(".")[0]
    dists = importlib.metadata.packages_distributions().get(top, [])
    if not dists:
        return "(not installed)", ""
    dist = dists[0]
    try:
        return dist, importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return dist, ""


def _core_version() -> str:
    try:
        return importlib.metadata.version("powertrain")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _split_env_list(value: str | None) -> set[str] | None:
    if value is None or not value.strip():
        return None
    return {part.strip() for part in value.split(",") if part.strip()}


class PluginManager:
    """pluggy's manager plus the bookkeeping powertrain promises about plugins."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.plugins: dict[str, PluginInfo] = {}
        self._records: dict[str, dict[str, list[Provided]]] = {kind: {} for kind in COMPONENT_KINDS}
        self._platform_info: dict[str, PlatformInfo] = {}
        self._name_clashes: list[str] = []
        #: Names given in config or environment that match no plugin (likely typos).
        self.warnings: list[str] = []
        #: The config ``powertrain_configure`` was last called with (called once per config).
        self.configured_with: Any = None

    @property
    def hook(self) -> Any:
        return self.pm.hook

    # ----------------------------------------------------------------------- loading

    @classmethod
    def load(
        cls,
        config: PluginsConfig | None = None,
        environ: Mapping[str, str] | None = None,
        *,
        strict: bool = True,
    ) -> PluginManager:
        """Builtins, then entry-point plugins, filtered by config and environment.

        With ``strict`` a component-name conflict raises PluginError; without it the
        conflict is kept in ``conflicts()`` for reporting (``powertrain plugins``).
        """
        config = config or PluginsConfig()
        environ = os.environ if environ is None else environ
        manager = cls()
        disabled = set(config.disable)
        for name, module in BUILTIN_PLUGINS.items():
            manager._load_one(name, module, "powertrain", _core_version(), "builtin", disabled, None)

        env_allow = _split_env_list(environ.get(ENV_ALLOWLIST))
        no_autoload = environ.get(ENV_NO_AUTOLOAD, "").strip().lower() in ("1", "true", "yes")
        seen: set[tuple[str, str]] = set()
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            if (ep.name, ep.value) in seen:
                continue  # the same distribution found twice on sys.path
            seen.add((ep.name, ep.value))
            dist = ep.dist.name if ep.dist else "(unknown distribution)"
            version = ep.dist.version if ep.dist else ""
            reason = None
            if env_allow is not None and ep.name not in env_allow:
                reason = f"not in {ENV_ALLOWLIST}"
            elif env_allow is None and no_autoload:
                reason = f"{ENV_NO_AUTOLOAD} is set"
            elif config.allow is not None and ep.name not in config.allow:
                reason = "not in [plugins] allow"
            manager._load_one(ep.name, ep.value, dist, version, "entry-point", disabled, reason, ep)
        manager._warn_unknown_names("[plugins] disable", disabled)
        manager._warn_unknown_names("[plugins] allow", set(config.allow or ()))
        manager._warn_unknown_names(ENV_ALLOWLIST, env_allow or set())
        if strict:
            manager.raise_on_conflicts()
        log.debug("plugins loaded", plugins={n: p.status for n, p in manager.plugins.items()})
        return manager

    def _warn_unknown_names(self, where: str, names: set[str]) -> None:
        known = [info.name for info in self.plugins.values()]
        for name in sorted(names - set(known)):
            close = difflib.get_close_matches(name, known, n=1)
            hint = f" (did you mean {close[0]}?)" if close else f"; installed: {', '.join(sorted(known))}"
            message = f"{where} names {name!r}, which is not an installed plugin{hint}"
            self.warnings.append(message)
            log.warning("unknown plugin name", where=where, name=name, message=message)

    def _remember(self, info: PluginInfo) -> bool:
        """Record a plugin under its name; a second plugin with a taken name is a clash."""
        existing = self.plugins.get(info.name)
        if existing is None or existing is info:
            self.plugins[info.name] = info
            return True
        message = (
            f"two plugins are named {info.name!r}: {existing.module} ({existing.distribution}) and "
            f"{info.module} ({info.distribution}); rename one entry point or uninstall one"
        )
        self._name_clashes.append(message)
        info.status, info.error = "broken", message
        self.plugins[f"{info.name} [{info.distribution}]"] = info
        return False

    def _load_one(
        self,
        name: str,
        module_name: str,
        distribution: str,
        version: str,
        source: Literal["builtin", "entry-point", "explicit"],
        disabled: set[str],
        skip_reason: str | None,
        entry_point: importlib.metadata.EntryPoint | None = None,
    ) -> PluginInfo:
        info = PluginInfo(name=name, module=module_name, distribution=distribution, version=version, source=source)
        if name in disabled:
            skip_reason = "disabled by [plugins] disable"
        if not self._remember(info):
            return info
        if skip_reason:
            info.status, info.error = "disabled", skip_reason
            return info
        try:
            module = entry_point.load() if entry_point is not None else importlib.import_module(module_name)
        except Exception as exc:  # any import failure is reported, never fatal here
            info.status = "broken"
            info.error = f"import of {module_name} (entry point {name!r}) failed: {type(exc).__name__}: {exc}"
            info.traceback = traceback.format_exc()
            log.warning("plugin failed to import", plugin=name, distribution=distribution, error=info.error)
            return info
        return self.register(module, info)

    def register(self, module: ModuleType | Any, info: PluginInfo | None = None) -> PluginInfo:
        """Vet and register one plugin object. Registering the same one again is a no-op."""
        if info is None:
            module_name = getattr(module, "__name__", type(module).__name__)
            dist, version = _distribution_of(module_name)
            info = PluginInfo(
                name=module_name, module=module_name, distribution=dist, version=version, source="explicit"
            )
        existing = self.plugins.get(info.name)
        if existing is not None and existing.status == "loaded" and self.pm.get_plugin(info.name) is module:
            return existing  # registering the same plugin again changes nothing
        if not self._remember(info):
            return info
        refusal = self._check_hook_api(module, info)
        if refusal:
            info.status, info.error = "refused", refusal
            log.warning("plugin refused", plugin=info.name, reason=refusal)
            return info
        try:
            self._check_hook_names(module)
            self.pm.register(module, name=info.name)
        except (pluggy.PluginValidationError, PluginError, ValueError) as exc:
            info.status, info.error = "broken", " ".join(str(exc).split())
            return info
        orphans = sorted(c.name for c in self.pm.get_hookcallers(module) or [] if c.spec is None)
        if orphans:  # e.g. @hookimpl(specname=...) naming a hook that does not exist
            self.pm.unregister(module)
            info.status, info.error = "broken", f"hookimpls {orphans} match no hook spec"
            return info
        try:
            collected = self._collect(module, info)
        except PluginError as exc:
            self.pm.unregister(name=info.name)
            info.status, info.error = "broken", str(exc)
            return info
        for kind, provided in collected.items():
            for item in provided:
                self._records[kind].setdefault(item.record.name, []).append(item)
            info.provides[kind] = [item.record.name for item in provided]
        info.status = "loaded"
        return info

    @staticmethod
    def _check_hook_api(module: Any, info: PluginInfo) -> str:
        declared = getattr(module, "POWERTRAIN_HOOK_API", None)
        supported = ", ".join(str(v) for v in hookspecs.SUPPORTED_HOOK_APIS)
        if declared is None:
            return (
                f"declares no hook API version; add POWERTRAIN_HOOK_API = {hookspecs.HOOK_API_VERSION} "
                f"to {info.module} (this powertrain supports: {supported})"
            )
        valid = isinstance(declared, int) and not isinstance(declared, bool)
        info.hook_api = declared if valid else None
        if not valid or declared not in hookspecs.SUPPORTED_HOOK_APIS:
            return (
                f"written for hook API {declared!r}, but powertrain {_core_version()} supports hook API "
                f"{supported}; use a {info.distribution} release written for hook API {supported}, "
                f"or a powertrain that supports hook API {declared!r}"
            )
        return ""

    def _check_hook_names(self, module: Any) -> None:
        """Every ``powertrain_*`` function must be a hookimpl of an existing spec."""
        spec_names = [n for n in dir(self.pm.hook) if n.startswith("powertrain_")]
        for attr in dir(module):
            if not attr.startswith("powertrain_"):
                continue
            function = getattr(module, attr)
            if not callable(function):
                continue
            if attr not in spec_names:
                close = difflib.get_close_matches(attr, spec_names, n=1)
                hint = f" (did you mean {close[0]}?)" if close else ""
                raise PluginError(f"hookimpl {attr} matches no hook spec{hint}")
            if self.pm.parse_hookimpl_opts(module, attr) is None:
                raise PluginError(f"{attr} is not decorated with @powertrain.hookimpl, so it would never be called")

    def _collect(self, module: Any, info: PluginInfo) -> dict[str, list[Provided]]:
        """Call this plugin's component hookimpls (through pluggy's registry, so specname
        works) once, and validate what they return."""
        collected: dict[str, list[Provided]] = {}
        for kind, (hook_name, record_type, _) in COMPONENT_KINDS.items():
            impls = [i for i in getattr(self.pm.hook, hook_name).get_hookimpls() if i.plugin is module]
            if not impls:
                continue
            records: list[Any] = []
            for impl in impls:
                try:
                    result = impl.function()
                except Exception as exc:
                    raise PluginError(f"{hook_name} raised {type(exc).__name__}: {exc}") from exc
                if not isinstance(result, list | tuple) or not all(isinstance(r, record_type) for r in result):
                    raise PluginError(f"{hook_name} must return a list of {record_type.__name__}, got {result!r}")
                records.extend(result)
            names = [r.name for r in records]
            dupes = {n for n in names if names.count(n) > 1}
            if dupes:
                raise PluginError(f"{hook_name} returns {kind} {sorted(dupes)} more than once")
            collected[kind] = [Provided(record=r, plugin=info) for r in records]
        return collected

    # ----------------------------------------------------------------------- queries

    def conflicts(self) -> list[str]:
        """One sentence per component name that two or more plugins provide."""
        messages = list(self._name_clashes)
        for kind, by_name in self._records.items():
            for name, provided in sorted(by_name.items()):
                if len(provided) > 1:
                    who = " and ".join(
                        f"plugin {p.plugin.name} ({p.plugin.distribution} {p.plugin.version})".replace(" )", ")")
                        for p in provided
                    )
                    messages.append(f"{kind} {name!r} is provided by both {who}; disable one with [plugins] disable")
        for record_kind in ("model",):
            owners: dict[str, list[Provided]] = {}
            for provided in self._records[record_kind].values():
                for item in provided:
                    for arch in item.record.architectures:
                        owners.setdefault(arch, []).append(item)
            for arch, items in sorted(owners.items()):
                if len(items) > 1:
                    who = " and ".join(f"plugin {p.plugin.name} ({p.plugin.distribution})" for p in items)
                    messages.append(f"model architecture {arch!r} is provided by both {who}")
        return messages

    def raise_on_conflicts(self) -> None:
        messages = self.conflicts()
        if messages:
            raise PluginError("\n".join(messages))

    def records(self, kind: str) -> list[Provided]:
        """Every record of ``kind`` (first provider wins if there is a conflict)."""
        return [provided[0] for _, provided in sorted(self._records[kind].items())]

    def broken(self) -> dict[str, str]:
        """Plugins that failed to import or register: name -> error."""
        return {
            name: f"{info.distribution}: {info.error}"
            for name, info in self.plugins.items()
            if info.status in ("broken", "refused")
        }

    def disabled(self) -> list[str]:
        return [name for name, info in self.plugins.items() if info.status == "disabled"]

    def platforms(self) -> dict[str, PlatformInfo]:
        """Detect every registered platform once per manager; detection never raises."""
        if not self._platform_info:
            for provided in self.records("platform"):
                self._platform_info[provided.record.name] = _detect(provided.record)
        return self._platform_info

    def best_platform(self, record: Any) -> tuple[PlatformInfo | None, list[str]]:
        """The best detected platform ``record`` can run on (cuda before cpu), or None
        and one reason per platform it names."""
        priority = {p.record.name: p.record.priority for p in self.records("platform")}
        reasons = []
        for info in sorted(self.platforms().values(), key=lambda i: -priority.get(i.name, 0)):
            availability = record.availability(info)
            if availability.available:
                return info, []
            if info.name in record.platforms:
                reasons.append(availability.reason)
        if not reasons:
            reasons.append(f"needs platform {', '.join(sorted(record.platforms))}, which no plugin here provides")
        return None, reasons


def _detect(record: PlatformRecord) -> PlatformInfo:
    try:
        info = record.detect()
        problem = "" if isinstance(info, PlatformInfo) else f"detect() returned {info!r}, not a PlatformInfo"
    except Exception as exc:
        problem = f"detection failed: {type(exc).__name__}: {exc}"
    if not problem:
        return info
    return PlatformInfo(
        name=record.name,
        device_type=record.device_type,
        dist_backend=record.dist_backend,
        availability=Availability.no(problem),
    )

"""Contract checks every plugin must pass, whatever it provides.

Subclass ``PluginContract`` and set ``plugin`` to the plugin's name (its entry-point
name, or a builtin's name). Checks that must see a pristine interpreter (what an
import pulls in, behaviour without vendor SDKs) run in a subprocess.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import subprocess
import sys
import textwrap
from typing import Any, ClassVar

import attrs
import pytest

from powertrain import hookspecs
from powertrain.components import COMPONENT_KINDS, NAME_PATTERN
from powertrain.plugins import ENTRY_POINT_GROUP, PluginInfo, PluginManager

#: SDKs a plugin module must not import at import time (DESIGN §2).
DEFAULT_VENDOR_MODULES = ("triton", "torch_npu", "cupy", "tensorrt", "deep_ep", "flash_attn")

# Run in a fresh interpreter: optionally block vendor modules (simulating a machine
# without them), import the plugin, then report what got imported and how every
# record's availability reads on every detected platform.
_PROBE = textwrap.dedent(
    """
    import importlib, importlib.abc, json, sys
    blocked, module_name, plugin_name = sys.argv[1].split(",") if sys.argv[1] else [], sys.argv[2], sys.argv[3]

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in blocked:
                raise ModuleNotFoundError(f"No module named {name!r} (blocked by the conformance kit)")
            return None

    sys.meta_path.insert(0, Block())
    import torch, powertrain, powertrain.components  # the baseline every plugin may assume
    before = set(sys.modules)
    importlib.import_module(module_name)
    imported = sorted({m.split(".")[0] for m in set(sys.modules) - before})
    from powertrain.plugins import PluginManager
    manager = PluginManager.load()
    info = manager.plugins[plugin_name]
    report = {"imported": imported, "status": info.status, "error": info.error, "availability": []}
    platforms = manager.platforms()
    for kind in info.provides:
        for provided in manager.records(kind):
            if provided.plugin is not info:
                continue
            record = provided.record
            if kind == "platform":
                a = platforms[record.name].availability
                report["availability"].append([kind, record.name, record.name, a.available, a.reason])
            elif hasattr(record, "availability"):
                for platform in platforms.values():
                    a = record.availability(platform)
                    report["availability"].append([kind, record.name, platform.name, a.available, a.reason])
    print("@@" + json.dumps(report))
    """
)


def _probe(module: str, plugin: str, blocked: tuple[str, ...]) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, ",".join(blocked), module, plugin],
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("@@")]
    if proc.returncode != 0 or not lines:
        pytest.fail(
            f"probing plugin {plugin} ({module}) with {list(blocked) or 'nothing'} blocked failed "
            f"(exit {proc.returncode}):\n{proc.stderr[-4000:]}"
        )
    return json.loads(lines[-1][2:])


class PluginContract:
    """The checks of DESIGN §2 and §5 for one plugin."""

    plugin: ClassVar[str]
    vendor_modules: ClassVar[tuple[str, ...]] = DEFAULT_VENDOR_MODULES

    @pytest.fixture
    def info(self, powertrain_plugins: PluginManager) -> PluginInfo:
        info = powertrain_plugins.plugins.get(self.plugin)
        if info is None:
            pytest.fail(
                f"plugin {self.plugin!r} is not known; known: {', '.join(powertrain_plugins.plugins)}. "
                f"Is it installed, with an entry point in the {ENTRY_POINT_GROUP!r} group?"
            )
        return info

    def test_loads(self, info: PluginInfo) -> None:
        assert info.status == "loaded", f"plugin {self.plugin} is {info.status}: {info.error}"

    def test_entry_point_or_builtin(self, info: PluginInfo) -> None:
        if info.source == "builtin":
            return
        names = {ep.name: ep.value for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}
        assert names.get(self.plugin) == info.module, (
            f"{self.plugin} should be declared as an entry point in group {ENTRY_POINT_GROUP!r}"
        )

    def test_declares_supported_hook_api(self, info: PluginInfo) -> None:
        module = importlib.import_module(info.module)
        declared = getattr(module, "POWERTRAIN_HOOK_API", None)
        assert declared in hookspecs.SUPPORTED_HOOK_APIS, (
            f"{info.module} declares POWERTRAIN_HOOK_API = {declared!r}; supported: {hookspecs.SUPPORTED_HOOK_APIS}"
        )

    def test_every_hookimpl_matches_a_spec(self, info: PluginInfo, powertrain_plugins: PluginManager) -> None:
        module = powertrain_plugins.pm.get_plugin(self.plugin)
        callers = powertrain_plugins.pm.get_hookcallers(module) or []
        assert callers, f"{self.plugin} implements no hook"
        for caller in callers:
            assert caller.spec is not None, f"{self.plugin}: hookimpl {caller.name} matches no hook spec"

    def test_registering_twice_is_harmless(self, info: PluginInfo) -> None:
        manager = PluginManager.load()
        module = manager.pm.get_plugin(self.plugin)
        before = {kind: [p.record for p in manager.records(kind)] for kind in COMPONENT_KINDS}
        impls_before = sum(len(c.get_hookimpls()) for c in manager.pm.get_hookcallers(module))
        again = manager.register(module, manager.plugins[self.plugin])
        assert again.status == "loaded"
        after = {kind: [p.record for p in manager.records(kind)] for kind in COMPONENT_KINDS}
        assert after == before, "registering the plugin again changed the registered records"
        impls_after = sum(len(c.get_hookimpls()) for c in manager.pm.get_hookcallers(module))
        assert impls_after == impls_before
        assert manager.conflicts() == [], manager.conflicts()
        # And a second, independent load (as in every worker process) sees the same.
        other = PluginManager.load()
        assert other.plugins[self.plugin].provides == manager.plugins[self.plugin].provides

    def test_records_are_valid(self, info: PluginInfo, powertrain_plugins: PluginManager) -> None:
        for kind in info.provides:
            for provided in powertrain_plugins.records(kind):
                if provided.plugin is not info:
                    continue
                record = provided.record
                attrs.validate(record)
                # A platform no installed plugin provides only makes the record unavailable,
                # but the names must be well formed and present.
                for platform in getattr(record, "platforms", ()):
                    assert NAME_PATTERN.match(platform), f"{kind} {record.name}: bad platform name {platform!r}"
                if hasattr(record, "platforms"):
                    assert record.platforms, f"{kind} {record.name} declares no platform"

    def test_imports_no_vendor_sdk(self, info: PluginInfo) -> None:
        report = _probe(info.module, self.plugin, ())
        leaked = sorted(set(report["imported"]) & set(self.vendor_modules))
        assert not leaked, f"importing {info.module} imported {leaked}; import vendor SDKs inside detect() or factories"

    def test_unavailable_hardware_is_reported_not_crashed(self, info: PluginInfo) -> None:
        """With every vendor SDK missing the plugin loads and says why things can't run."""
        report = _probe(info.module, self.plugin, self.vendor_modules)
        assert report["status"] == "loaded", f"without vendor SDKs the plugin is {report['status']}: {report['error']}"
        for kind, name, platform, available, reason in report["availability"]:
            if not available:
                assert reason.strip(), f"{kind} {name} is unavailable on {platform} without saying why"

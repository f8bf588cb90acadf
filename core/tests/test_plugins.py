"""The plugin manager on real (tiny) distributions discovered through entry points."""

from __future__ import annotations

import pytest

from powertrain.config import PluginsConfig
from powertrain.plugins import BUILTIN_PLUGINS, PluginError, PluginManager

GOOD = """
from powertrain import hookimpl
from powertrain.components import SchedulerRecord

POWERTRAIN_HOOK_API = 1

def _factory(context):
    return object()

@hookimpl
def powertrain_schedulers():
    return [SchedulerRecord(name="{name}", factory=_factory)]
"""


def test_builtins_load_through_the_plugin_path() -> None:
    manager = PluginManager.load(environ={})
    for name in BUILTIN_PLUGINS:
        info = manager.plugins[name]
        assert info.status == "loaded", info.error
        assert info.source == "builtin"
        assert info.distribution == "powertrain"
    assert {p.record.name for p in manager.records("platform")} >= {"cpu", "cuda"}


def test_entry_point_plugin_is_discovered(make_distribution) -> None:
    make_distribution("acme-sched", {"acme": "acme_sched"}, {"acme_sched": GOOD.format(name="acme-fifo")}, "2.3")
    manager = PluginManager.load(environ={})
    info = manager.plugins["acme"]
    assert (info.status, info.distribution, info.version, info.source) == ("loaded", "acme-sched", "2.3", "entry-point")
    assert info.provides == {"scheduler": ["acme-fifo"]}
    assert [p.plugin.name for p in manager.records("scheduler") if p.record.name == "acme-fifo"] == ["acme"]


def test_duplicate_component_names_name_both_distributions(make_distribution) -> None:
    make_distribution("dist-one", {"one": "plug_one"}, {"plug_one": GOOD.format(name="same")})
    make_distribution("dist-two", {"two": "plug_two"}, {"plug_two": GOOD.format(name="same")})
    with pytest.raises(PluginError) as excinfo:
        PluginManager.load(environ={})
    message = str(excinfo.value)
    assert "scheduler 'same'" in message and "dist-one" in message and "dist-two" in message
    # Non-strict loading keeps the conflict for reporting; disabling one resolves it.
    assert PluginManager.load(environ={}, strict=False).conflicts()
    assert PluginManager.load(PluginsConfig(disable=("two",)), environ={}).conflicts() == []


def test_import_failure_is_recorded_not_raised(make_distribution) -> None:
    make_distribution(
        "broken-dist", {"broken": "broken_plugin"}, {"broken_plugin": "import vendor_sdk_that_is_absent\n"}
    )
    manager = PluginManager.load(environ={})
    info = manager.plugins["broken"]
    assert info.status == "broken"
    assert "broken_plugin" in info.error and "entry point 'broken'" in info.error
    assert "ModuleNotFoundError" in info.error and "vendor_sdk_that_is_absent" in info.error
    assert "broken" in manager.broken() and "broken-dist" in manager.broken()["broken"]
    assert manager.plugins["builtin-platforms"].status == "loaded"


@pytest.mark.parametrize(
    ("declaration", "expected"),
    [
        ("", "declares no hook API version; add POWERTRAIN_HOOK_API = 1"),
        ("POWERTRAIN_HOOK_API = 7\n", "written for hook API 7, but powertrain"),
    ],
)
def test_incompatible_hook_api_is_refused_with_working_versions(make_distribution, declaration, expected) -> None:
    source = GOOD.format(name="x").replace("POWERTRAIN_HOOK_API = 1\n", declaration)
    make_distribution("old-dist", {"old": "old_plugin"}, {"old_plugin": source})
    info = PluginManager.load(environ={}).plugins["old"]
    assert info.status == "refused"
    assert expected in info.error
    assert "supports" in info.error and "1" in info.error


def test_hookimpl_without_spec_is_rejected(make_distribution) -> None:
    source = GOOD.format(name="x").replace("def powertrain_schedulers", "def powertrain_schedulrs")
    make_distribution("typo-dist", {"typo": "typo_plugin"}, {"typo_plugin": source})
    manager = PluginManager.load(environ={})
    info = manager.plugins["typo"]
    assert info.status == "broken"
    assert "powertrain_schedulrs matches no hook spec (did you mean powertrain_schedulers?)" in info.error
    assert manager.pm.get_plugin("typo") is None


def test_undecorated_hook_function_is_rejected(make_distribution) -> None:
    source = GOOD.format(name="x").replace("@hookimpl\n", "")
    make_distribution("plain-dist", {"plain": "plain_plugin"}, {"plain_plugin": source})
    info = PluginManager.load(environ={}).plugins["plain"]
    assert info.status == "broken" and "not decorated with @powertrain.hookimpl" in info.error


def test_hookimpl_with_unknown_argument_is_rejected(make_distribution) -> None:
    source = GOOD.format(name="x").replace("def powertrain_schedulers():", "def powertrain_schedulers(engine):")
    make_distribution("args-dist", {"args": "args_plugin"}, {"args_plugin": source})
    info = PluginManager.load(environ={}).plugins["args"]
    assert info.status == "broken" and "engine" in info.error


def test_malformed_records_make_the_plugin_broken(make_distribution) -> None:
    source = GOOD.format(name="x").replace('return [SchedulerRecord(name="x", factory=_factory)]', 'return ["x"]')
    make_distribution("bad-dist", {"bad": "bad_plugin"}, {"bad_plugin": source})
    manager = PluginManager.load(environ={})
    assert manager.plugins["bad"].status == "broken"
    assert "must return a list of SchedulerRecord" in manager.plugins["bad"].error
    assert manager.pm.get_plugin("bad") is None


def test_allowlist_and_autoload_switches(make_distribution) -> None:
    make_distribution("a-dist", {"alpha": "alpha_plugin"}, {"alpha_plugin": GOOD.format(name="a")})
    make_distribution("b-dist", {"beta": "beta_plugin"}, {"beta_plugin": GOOD.format(name="b")})

    def statuses(**kwargs) -> dict[str, str]:
        manager = PluginManager.load(**kwargs)
        return {name: manager.plugins[name].status for name in ("alpha", "beta", "builtin-platforms")}

    assert statuses(environ={}) == {"alpha": "loaded", "beta": "loaded", "builtin-platforms": "loaded"}
    assert statuses(environ={"POWERTRAIN_PLUGINS": "beta"}) == {
        "alpha": "disabled",
        "beta": "loaded",
        "builtin-platforms": "loaded",
    }
    assert statuses(environ={"POWERTRAIN_DISABLE_PLUGIN_AUTOLOAD": "1"}) == {
        "alpha": "disabled",
        "beta": "disabled",
        "builtin-platforms": "loaded",
    }
    # Autoload off, but explicitly named plugins still load (as pytest's -p does).
    assert (
        statuses(environ={"POWERTRAIN_DISABLE_PLUGIN_AUTOLOAD": "1", "POWERTRAIN_PLUGINS": "alpha"})["alpha"]
        == "loaded"
    )
    assert statuses(config=PluginsConfig(allow=("alpha",)), environ={})["beta"] == "disabled"
    assert statuses(config=PluginsConfig(disable=("alpha",)), environ={})["alpha"] == "disabled"
    manager = PluginManager.load(PluginsConfig(disable=("alpha",)), environ={})
    assert manager.plugins["alpha"].error == "disabled by [plugins] disable"
    assert manager.pm.get_plugin("alpha") is None


def test_builtins_can_be_disabled_by_config() -> None:
    manager = PluginManager.load(PluginsConfig(disable=("builtin-communicators",)), environ={})
    assert manager.plugins["builtin-communicators"].status == "disabled"
    assert manager.records("communication") == [] or all(
        p.plugin.name != "builtin-communicators" for p in manager.records("communication")
    )


def test_register_twice_is_a_no_op(make_distribution) -> None:
    make_distribution("c-dist", {"gamma": "gamma_plugin"}, {"gamma_plugin": GOOD.format(name="g")})
    manager = PluginManager.load(environ={})
    module = manager.pm.get_plugin("gamma")
    again = manager.register(module, manager.plugins["gamma"])
    assert again is manager.plugins["gamma"]
    assert [p.record.name for p in manager.records("scheduler")].count("g") == 1
    assert manager.conflicts() == []


def test_platform_detection_never_raises(make_distribution) -> None:
    make_distribution(
        "npu-dist",
        {"fake-npu": "fake_npu"},
        {
            "fake_npu": """
            from powertrain import hookimpl
            from powertrain.components import PlatformRecord
            POWERTRAIN_HOOK_API = 1
            def _detect():
                raise OSError("libascendcl.so: cannot open shared object file")
            @hookimpl
            def powertrain_platforms():
                return [PlatformRecord(name="fake-npu", device_type="npu", dist_backend="hccl", detect=_detect)]
            """
        },
    )
    info = PluginManager.load(environ={}).platforms()["fake-npu"]
    assert not info.available
    assert info.availability.reason == "detection failed: OSError: libascendcl.so: cannot open shared object file"


def test_specname_is_collected_and_unknown_specname_rejected(make_distribution) -> None:
    aliased = GOOD.format(name="aliased").replace(
        "@hookimpl\ndef powertrain_schedulers():", '@hookimpl(specname="powertrain_schedulers")\ndef my_schedulers():'
    )
    make_distribution("alias-dist", {"alias": "alias_plugin"}, {"alias_plugin": aliased})
    orphan = GOOD.format(name="orphan").replace(
        "@hookimpl\ndef powertrain_schedulers():", '@hookimpl(specname="powertrain_schedulerz")\ndef my_schedulers():'
    )
    make_distribution("orphan-dist", {"orphan": "orphan_plugin"}, {"orphan_plugin": orphan})
    manager = PluginManager.load(environ={})
    assert manager.plugins["alias"].provides == {"scheduler": ["aliased"]}
    assert manager.plugins["orphan"].status == "broken"
    assert "powertrain_schedulerz" in manager.plugins["orphan"].error


def test_plugin_name_clash_is_a_reported_conflict(make_distribution) -> None:
    make_distribution("aaa-one", {"same": "same_one"}, {"same_one": "import missing_sdk_one\n"})
    make_distribution("zzz-two", {"same": "same_two"}, {"same_two": GOOD.format(name="two")})
    make_distribution("imposter", {"builtin-platforms": "imposter_plugin"}, {"imposter_plugin": GOOD.format(name="i")})
    manager = PluginManager.load(environ={}, strict=False)
    clashes = [c for c in manager.conflicts() if c.startswith("two plugins are named")]
    assert len(clashes) == 2
    assert any("'same'" in c and "aaa-one" in c and "zzz-two" in c for c in clashes)
    assert any("'builtin-platforms'" in c and "imposter" in c for c in clashes)
    assert manager.plugins["builtin-platforms"].distribution == "powertrain"  # the first keeps its name
    same = {info.distribution: info for key, info in manager.plugins.items() if info.name == "same"}
    assert set(same) == {"aaa-one", "zzz-two"}  # neither vanished
    assert all(info.status == "broken" or info.distribution == "zzz-two" for info in same.values())
    with pytest.raises(PluginError, match="two plugins are named"):
        PluginManager.load(environ={})


def test_boolean_hook_api_is_refused(make_distribution) -> None:
    source = GOOD.format(name="b").replace("POWERTRAIN_HOOK_API = 1", "POWERTRAIN_HOOK_API = True")
    make_distribution("bool-dist", {"boolish": "bool_plugin"}, {"bool_plugin": source})
    assert PluginManager.load(environ={}).plugins["boolish"].status == "refused"


def test_unknown_plugin_names_in_config_and_environment_are_warned_about() -> None:
    manager = PluginManager.load(
        PluginsConfig(disable=("sdpa-exmaple",), allow=("builtin-platforms",)),
        environ={"POWERTRAIN_PLUGINS": "nothing-like-this"},
    )
    assert any(
        "[plugins] disable names 'sdpa-exmaple'" in w and "did you mean sdpa-example?" in w for w in manager.warnings
    )
    assert any("POWERTRAIN_PLUGINS names 'nothing-like-this'" in w for w in manager.warnings)
    assert not any("allow" in w for w in manager.warnings)

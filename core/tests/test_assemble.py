"""Config + plugins -> a plan -> built components, through the real hooks."""

from __future__ import annotations

import attrs
import pytest
import torch

from powertrain import hookimpl
from powertrain.assemble import AssemblyError, build_attention, build_communicator, plan
from powertrain.components import AttentionBackendRecord
from powertrain.config import ComponentsConfig, ConfigError, EngineConfig, ParallelConfig, PluginsConfig, parse_config
from powertrain.interfaces import AttentionBackend, Communicator, SparseMLAAttentionBackend
from powertrain.plugins import PluginManager
from powertrain.selection import Selection


def config(**components: str) -> EngineConfig:
    return EngineConfig(components=ComponentsConfig(**components))


def test_auto_resolves_on_this_machine_and_says_why() -> None:
    result = plan(config(), strict=False)
    assert result.platform.name == "cpu"  # this machine has no GPU; cuda reports why
    assert "highest priority" in result.resolutions["platform"].reason
    assert "cuda (" in result.resolutions["platform"].reason
    assert result.resolutions["attention"].name == "cpu-paged"  # the CPU kernel pack, installed in this workspace
    assert result.resolutions["communication"].name == "single-process"
    assert result.resolutions["speculative"].reason == "disabled (speculative = none)"
    assert result.resolutions["moe"].error == ""  # not needed without a MoE model


def test_named_component_that_does_not_exist_lists_available_ones() -> None:
    result = plan(config(attention="flash-nonexistent"), strict=False)
    [problem] = [p for p in result.problems if p.startswith("attention")]
    assert "attention = 'flash-nonexistent'" in problem
    assert "is not provided by any loaded plugin" in problem
    assert "available here: cpu-paged, torch-bucketed, torch-reference, sdpa" in problem
    with pytest.raises(AssemblyError):
        plan(config(attention="flash-nonexistent"))


def test_explicit_name_selects_a_lower_priority_plugin() -> None:
    result = plan(config(attention="sdpa"), strict=False)
    assert result.resolutions["attention"].name == "sdpa"
    assert result.resolutions["attention"].provided.plugin.name == "sdpa-example"


def test_world_size_decides_the_communicator() -> None:
    one = plan(config(), strict=False)
    two = plan(EngineConfig(parallel=ParallelConfig(data_parallel=2, expert_parallel=2)), strict=False)
    assert one.resolutions["communication"].name == "single-process"
    assert two.resolutions["communication"].name == "torch-distributed"
    assert "single-process (lacks world size 2 (at most 1))" in two.resolutions["communication"].reason
    forced = plan(
        EngineConfig(
            components=ComponentsConfig(communication="single-process"), parallel=ParallelConfig(expert_parallel=2)
        ),
        strict=False,
    )
    assert "cannot be used here" in forced.resolutions["communication"].error
    # Data parallelism alone runs independent engines: no process group joins them.
    data_only = plan(EngineConfig(parallel=ParallelConfig(data_parallel=2)), strict=False)
    assert data_only.resolutions["communication"].name == "single-process"


def test_requirements_filter_candidates_and_make_kinds_needed() -> None:
    result = plan(config(), requirements={"attention": {"mla"}, "moe": set()}, strict=False)
    assert result.resolutions["attention"].name == "torch-reference"
    assert result.resolutions["moe"].name == "torch-grouped"
    moe = plan(config(), requirements={"moe": {"fp8-block", "fused-routing"}}, strict=False).resolutions["moe"]
    assert moe.error.startswith("moe = 'auto': no moe implementation is usable here")
    sdpa_only = plan(config(attention="sdpa"), requirements={"attention": {"mla"}}, strict=False)
    assert "lacks mla" in sdpa_only.resolutions["attention"].error


def test_unavailable_platform_component_is_refused_with_reason() -> None:
    manager = PluginManager.load(environ={})

    class GpuOnly:
        POWERTRAIN_HOOK_API = 1

        @hookimpl
        def powertrain_attention_backends(self):
            return [
                AttentionBackendRecord(
                    name="gpu-only", platforms={"cuda"}, capabilities={"gqa"}, priority=50, factory=lambda c: None
                )
            ]

    manager.register(GpuOnly())
    assert plan(config(), manager, strict=False).resolutions["attention"].name == "cpu-paged"
    error = plan(config(attention="gpu-only"), manager, strict=False).resolutions["attention"].error
    assert "gpu-only (runs on cuda, not on platform 'cpu')" in error


def test_a_plugin_can_override_selection_and_builtin_rule_runs_last() -> None:
    manager = PluginManager.load(environ={})

    class PreferSdpa:
        POWERTRAIN_HOOK_API = 1

        @hookimpl(tryfirst=True)
        def powertrain_select_component(self, kind, candidates):
            if kind == "attention":
                return Selection(name="sdpa", reason="site policy prefers sdpa")
            return None

    manager.register(PreferSdpa())
    resolution = plan(config(), manager, strict=False).resolutions["attention"]
    assert (resolution.name, resolution.reason) == ("sdpa", "site policy prefers sdpa")


def test_broken_plugin_is_fatal_only_when_config_needs_what_it_may_provide(make_distribution) -> None:
    make_distribution("acme-kernels", {"acme": "acme_kernels"}, {"acme_kernels": "import acme_sdk\n"})
    fine = plan(config(), strict=False)
    assert fine.problems == []
    needs = plan(config(attention="acme-flash"), strict=False).resolutions["attention"].error
    assert "plugins that failed to load, which may provide it: acme (acme-kernels:" in needs
    assert "No module named 'acme_sdk'" in needs


def test_disabled_plugin_is_named_when_its_component_is_requested() -> None:
    cfg = EngineConfig(components=ComponentsConfig(attention="sdpa"), plugins=PluginsConfig(disable=("sdpa-example",)))
    error = plan(cfg, strict=False).resolutions["attention"].error
    assert "disabled plugins: sdpa-example" in error


def test_plugin_section_is_validated_through_plan(make_distribution) -> None:
    make_distribution(
        "spec-dist",
        {"specdec": "specdec_plugin"},
        {
            "specdec_plugin": """
            import attrs
            from powertrain import hookimpl
            from powertrain.components import ConfigSectionRecord
            POWERTRAIN_HOOK_API = 1
            seen = []
            @attrs.frozen
            class SpecConfig:
                max_draft_tokens: int = 5
            @hookimpl
            def powertrain_config_sections():
                return [ConfigSectionRecord(name="specdec", config_class=SpecConfig)]
            @hookimpl
            def powertrain_configure(config, sections):
                seen.append(sections["specdec"])
            """
        },
    )
    ok = plan(parse_config({"specdec": {"max_draft_tokens": 2}}, "engine.toml"), strict=False)
    assert ok.sections["specdec"].max_draft_tokens == 2
    import specdec_plugin

    assert specdec_plugin.seen[-1].max_draft_tokens == 2
    with pytest.raises(ConfigError) as excinfo:
        plan(parse_config({"specdec": {"max_draft_tokens": 2.5}}, "engine.toml"))
    assert excinfo.value.lines() == ["engine.toml: specdec.max_draft_tokens: expected int, got float 2.5"]


def _late_configure_listener(manager: PluginManager) -> list[EngineConfig]:
    """Register, after planning, a plugin that records every configure call it gets."""
    calls: list[EngineConfig] = []

    class Late:
        POWERTRAIN_HOOK_API = 1

        @hookimpl
        def powertrain_configure(self, config):
            calls.append(config)

    manager.register(Late())
    return calls


def test_configure_is_historic() -> None:
    manager = PluginManager.load(environ={})
    plan(config(), manager, strict=False)
    calls = _late_configure_listener(manager)
    assert len(calls) == 1 and isinstance(calls[0], EngineConfig)


def test_build_returns_protocol_objects_and_rejects_impostors() -> None:
    result = plan(config(), strict=False)
    assert isinstance(build_attention(result, torch.float32), AttentionBackend)
    communicator = build_communicator(result)
    assert isinstance(communicator, Communicator) and communicator.world_size == 1

    manager = PluginManager.load(environ={})

    class Impostor:
        POWERTRAIN_HOOK_API = 1

        @hookimpl
        def powertrain_attention_backends(self):
            return [
                AttentionBackendRecord(
                    name="impostor", platforms={"cpu"}, capabilities={"gqa"}, factory=lambda c: object()
                )
            ]

    manager.register(Impostor())
    with pytest.raises(AssemblyError, match="does not implement powertrain.interfaces.AttentionBackend"):
        build_attention(plan(config(attention="impostor"), manager, strict=False), torch.float32)


def test_a_backend_declaring_sparse_mla_must_implement_it() -> None:
    """Declaring sparse-mla is a promise build_attention checks: a dense-only MLA backend
    that declares it is refused, naming the missing Protocol."""
    from powertrain.builtin.reference_attention import TorchReferenceAttention

    class DenseOnly:
        name = "dense-only"
        kv_cache_spec = TorchReferenceAttention.kv_cache_spec
        forward_mla = TorchReferenceAttention.forward_mla

    class Overclaims:
        POWERTRAIN_HOOK_API = 1

        @hookimpl
        def powertrain_attention_backends(self):
            return [
                AttentionBackendRecord(
                    name="overclaims",
                    platforms={"cpu"},
                    capabilities={"mla", "sparse-mla"},
                    factory=lambda c: DenseOnly(),
                )
            ]

    manager = _with_selector(Overclaims())
    with pytest.raises(AssemblyError, match="does not implement powertrain.interfaces.SparseMLAAttentionBackend"):
        build_attention(plan(config(attention="overclaims"), manager, strict=False), torch.float32)
    reference = build_attention(plan(config(attention="torch-reference"), strict=False), torch.float32)
    assert isinstance(reference, SparseMLAAttentionBackend)


def _with_selector(selector) -> PluginManager:
    manager = PluginManager.load(environ={})
    manager.register(selector)
    return manager


def test_selection_of_an_unusable_component_is_refused() -> None:
    class PickCuda:
        POWERTRAIN_HOOK_API = 1

        @hookimpl(tryfirst=True)
        def powertrain_select_component(self, kind):
            return Selection(name="cuda", reason="always cuda") if kind == "platform" else None

    result = plan(config(), _with_selector(PickCuda()), strict=False)
    error = result.resolutions["platform"].error
    assert "chose 'cuda', which cannot be used here" in error and "PickCuda" in error


def test_a_crashing_selection_hook_is_an_error_naming_plugins() -> None:
    class Crash:
        POWERTRAIN_HOOK_API = 1

        @hookimpl(tryfirst=True)
        def powertrain_select_component(self, kind):
            if kind == "attention":
                raise RuntimeError("policy file missing")

    error = plan(config(), _with_selector(Crash()), strict=False).resolutions["attention"].error
    assert "raised RuntimeError: policy file missing" in error and "Crash" in error


def test_without_the_builtin_rule_nothing_is_chosen_and_it_says_so() -> None:
    manager = PluginManager.load(PluginsConfig(disable=("builtin-selection",)), environ={})
    error = plan(config(), manager, strict=False).resolutions["attention"].error
    assert "is builtin-selection disabled?" in error


def test_configure_is_called_once_per_config() -> None:
    manager = PluginManager.load(environ={})
    cfg = config()
    for _ in range(3):
        plan(cfg, manager, strict=False)
    assert _late_configure_listener(manager) == [cfg]


def test_mla_only_backend_builds_through_the_mla_protocol() -> None:
    from powertrain.builtin.reference_attention import TorchReferenceAttention
    from powertrain.interfaces import MLAAttentionBackend

    class MlaOnly:
        name = "mla-only"
        kv_cache_spec = TorchReferenceAttention.kv_cache_spec
        forward_mla = TorchReferenceAttention.forward_mla

    class Provider:
        POWERTRAIN_HOOK_API = 1

        @hookimpl
        def powertrain_attention_backends(self):
            return [
                AttentionBackendRecord(
                    name="mla-only", platforms={"cpu"}, capabilities={"mla", "decode"}, factory=lambda c: MlaOnly()
                )
            ]

    manager = PluginManager.load(environ={})
    manager.register(Provider())
    backend = build_attention(plan(config(attention="mla-only"), manager, strict=False), torch.float32)
    assert isinstance(backend, MLAAttentionBackend) and not isinstance(backend, AttentionBackend)


def test_absent_capabilities_are_known_tags_not_declared_ones_each_with_a_reason() -> None:
    def record(**absent: str) -> AttentionBackendRecord:
        return AttentionBackendRecord(
            name="partial", platforms={"cpu"}, capabilities={"gqa"}, factory=lambda c: None, absent=absent
        )

    assert record(**{"v4-attention": "no operator for it"}).absent == {"v4-attention": "no operator for it"}
    with pytest.raises(ValueError, match="unknown tags"):
        record(**{"v5-attention": "no such tag"})
    with pytest.raises(ValueError, match="both declared and listed as absent"):
        record(gqa="declared after all")
    with pytest.raises(ValueError, match="say why"):
        record(**{"v4-attention": " "})


def test_batch_invariant_switch_requires_the_capability_of_attention_and_moe() -> None:
    from types import SimpleNamespace

    from powertrain.assemble.engine import model_requirements
    from powertrain.builtin.models import deepseek_requirements
    from powertrain.config import EngineOptionsConfig

    deepseek = SimpleNamespace(record=SimpleNamespace(requirements=deepseek_requirements))
    checkpoint = SimpleNamespace(config={"kv_lora_rank": 32, "n_routed_experts": 8}, quantized_formats=())
    switched = EngineConfig(engine=EngineOptionsConfig(batch_invariant=True))
    needs = model_requirements(deepseek, checkpoint, switched)
    assert {"mla", "batch-invariant"} <= needs["attention"] and "batch-invariant" in needs["moe"]
    assert "batch-invariant" not in model_requirements(deepseek, checkpoint, EngineConfig())["attention"]
    # auto finds the backends that declare it; a named one that does not is refused by name.
    chosen = plan(switched, requirements=needs, strict=False).resolutions
    assert (chosen["attention"].name, chosen["moe"].name) == ("torch-reference", "torch-grouped-invariant")
    named = attrs.evolve(switched, components=ComponentsConfig(moe="torch-grouped", attention="sdpa"))
    refused = plan(named, requirements=needs, strict=False).resolutions
    assert "torch-grouped" in refused["moe"].error and "lacks batch-invariant" in refused["moe"].error
    assert "sdpa" in refused["attention"].error and "batch-invariant" in refused["attention"].error
    assert parse_config({"engine": {"batch_invariant": True}}).engine.batch_invariant

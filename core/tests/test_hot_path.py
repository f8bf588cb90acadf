"""Hooks are the control plane: nothing on the per-layer path goes through pluggy."""

from __future__ import annotations

import ast
from pathlib import Path

import torch

import powertrain
from powertrain.assemble import build_attention, plan
from powertrain.config import EngineConfig
from powertrain.interfaces import AttentionLayerSpec, AttentionMetadata

PACKAGE = Path(powertrain.__file__).parent
#: Packages and modules that run per step, per layer or per token.
HOT_PATH = ["engine", "layers", "models", "interfaces"]
CONTROL_PLANE = {"pluggy", "powertrain.plugins", "powertrain.hookspecs", "powertrain.assemble", "powertrain.builtin"}


def test_hot_path_modules_never_import_the_control_plane() -> None:
    offenders = []
    sources = [
        source
        for entry in HOT_PATH
        for source in ([PACKAGE / entry] if entry.endswith(".py") else sorted((PACKAGE / entry).rglob("*.py")))
    ]
    assert PACKAGE / "interfaces" / "attention.py" in sources and all(s.is_file() for s in sources)
    for source in sources:
        for node in ast.walk(ast.parse(source.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                if any(name == bad or name.startswith(bad + ".") for bad in CONTROL_PLANE):
                    offenders.append(f"{source.relative_to(PACKAGE)} imports {name}")
    assert not offenders, offenders


def test_layer_loop_makes_no_hook_calls() -> None:
    result = plan(EngineConfig(), strict=False)
    backend = build_attention(result, torch.float32, block_size=4)
    calls: list[str] = []
    undo = result.plugins.pm.add_hookcall_monitoring(
        before=lambda name, impls, kwargs: calls.append(name), after=lambda *a: None
    )
    try:
        layer = AttentionLayerSpec(kind="gqa", num_heads=4, num_kv_heads=2, head_size=8, scale=8**-0.5)
        spec = backend.kv_cache_spec(layer, 4, torch.float32)
        caches = [spec.allocate(8, "cpu") for _ in range(6)]
        for cache in caches:  # the first sequence has two cached tokens; make them real
            for tensor in cache.values():
                tensor.copy_(torch.randn(tensor.shape))
        metadata = AttentionMetadata.build(query_lens=[1, 5], seq_lens=[3, 5], block_tables=[[2], [0, 5]], block_size=4)
        hidden = torch.randn(6, 4, 8)
        for cache in caches:  # six "layers"
            hidden = backend.forward(layer, hidden, hidden[:, :2], hidden[:, 2:], cache, metadata)
        assert torch.isfinite(hidden).all()
    finally:
        undo()
    assert calls == [], f"hooks called on the layer path: {calls}"
    # The monitor does see hook calls on the control plane, so the check above can fail.
    undo = result.plugins.pm.add_hookcall_monitoring(
        before=lambda name, impls, kwargs: calls.append(name), after=lambda *a: None
    )
    plan(EngineConfig(), result.plugins, strict=False)
    undo()
    assert "powertrain_select_component" in calls


def test_generation_through_the_engine_makes_no_hook_calls() -> None:
    """Steps of a real engine (scheduler, runner, model, attention, sampler) stay off pluggy."""
    from powertrain.assemble import build_engine
    from powertrain.config import CacheConfig, ModelConfig
    from powertrain.interfaces.sampling import SamplingParams
    from powertrain.plugins import PluginManager

    manager = PluginManager.load()
    engine = build_engine(EngineConfig(model=ModelConfig(dtype="float32"), cache=CacheConfig(num_blocks=64)), manager)
    calls: list[str] = []
    undo = manager.pm.add_hookcall_monitoring(
        before=lambda name, impls, kwargs: calls.append(name), after=lambda *a: None
    )
    try:
        engine.add_request("Name three rivers:", SamplingParams(temperature=0, max_tokens=6))
        steps = 0
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
    finally:
        undo()
        engine.shutdown()
    assert steps >= 6
    assert calls == [], f"hooks called while generating: {calls}"

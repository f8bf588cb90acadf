"""``[engine] cuda_graphs``: when decode steps are captured, and why not.

The capture itself needs a GPU (``plugins/cuda_sm100/gpu_tests``); the padded steps
a graph replays are checked through triton-sm100 under the interpreter
(``plugins/cuda_sm100/tests/test_cuda_graphs.py``). Here: the switch, the reasons it
gives, the ladder, and the blocks reserved for padding rows.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import structlog
import torch

from powertrain.assemble import AssemblyError, plan
from powertrain.assemble.engine import _graph_sizes, _why_not_captured, decode_graphs, model_requirements
from powertrain.config import ConfigError, EngineConfig, EngineOptionsConfig, parse_config
from powertrain.engine.block_manager import BlockManager
from powertrain.engine.cuda_graphs import DecodeGraphs
from powertrain.interfaces import AttentionMetadata


def test_config_takes_the_switch_and_increasing_sizes() -> None:
    parsed = parse_config({"engine": {"cuda_graphs": "on", "cuda_graph_batch_sizes": [1, 8, 32]}})
    assert (parsed.engine.cuda_graphs, parsed.engine.cuda_graph_batch_sizes) == ("on", (1, 8, 32))
    assert EngineConfig().engine.cuda_graphs == "auto"
    for bad, words in (
        ({"cuda_graphs": "yes"}, "must be one of auto, on, off"),
        ({"cuda_graphs": True}, "cuda_graphs"),
        ({"cuda_graph_batch_sizes": [8, 4]}, "must be increasing batch sizes"),
        ({"cuda_graph_batch_sizes": [0, 4]}, "must be increasing batch sizes"),
        ({"cuda_graph_batch_sizes": []}, "must be increasing batch sizes"),
        ({"cuda_graph_batch_sizes": 8}, "expected a list of integers"),
    ):
        with pytest.raises(ConfigError, match=words):
            parse_config({"engine": bad})


def test_the_ladder_stops_at_the_first_size_that_holds_every_sequence() -> None:
    ladder = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)
    assert _graph_sizes(ladder, 64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert _graph_sizes(ladder, 20) == [1, 2, 4, 8, 16, 24]
    assert _graph_sizes(ladder, 500) == list(ladder)  # bigger decode steps run eager


def test_on_asks_the_attention_and_moe_backends_for_the_capability() -> None:
    from powertrain.builtin.models import deepseek_requirements

    deepseek = SimpleNamespace(record=SimpleNamespace(requirements=deepseek_requirements))
    checkpoint = SimpleNamespace(config={"kv_lora_rank": 32, "n_routed_experts": 8}, quantized_formats=())
    on = EngineConfig(engine=EngineOptionsConfig(cuda_graphs="on"))
    needs = model_requirements(deepseek, checkpoint, on)
    assert "cuda-graphs" in needs["attention"] and "cuda-graphs" in needs["moe"]
    assert "cuda-graphs" not in model_requirements(deepseek, checkpoint, EngineConfig())["attention"]
    # No CPU backend declares it: "on" is refused by name, with what each one lacks.
    refused = plan(on, requirements=needs, strict=False).resolutions["attention"].error
    assert "lacks cuda-graphs" in refused and "torch-reference" in refused


def _chosen(*, graphs: bool = True, attention: frozenset = frozenset({"cuda-graphs"}), mode: str = "auto"):  # noqa: ANN202
    def resolution(name: str, capabilities: frozenset) -> SimpleNamespace:
        record = SimpleNamespace(name=name, capabilities=capabilities)
        return SimpleNamespace(provided=SimpleNamespace(record=record))

    return SimpleNamespace(
        platform=SimpleNamespace(name="cuda", cuda_graphs=graphs),
        resolutions={
            "attention": resolution("attn-x", attention),
            "moe": resolution("moe-y", frozenset({"bf16"})),
        },
        config=EngineConfig(engine=EngineOptionsConfig(cuda_graphs=mode)),
    )


class _Capturable:
    captures_decode = True


def test_each_reason_for_eager_decode_is_named() -> None:
    loaded = SimpleNamespace(model=_Capturable())
    assert _why_not_captured(_chosen(), loaded, None, needs_moe=False) == ""
    assert _why_not_captured(_chosen(graphs=False), loaded, None, False) == "platform cuda cannot capture CUDA graphs"
    assert "expert parallelism" in _why_not_captured(_chosen(), loaded, object(), False)
    model = SimpleNamespace(model=object())  # says nothing: not captured
    assert "object does not declare its decode step capturable" in _why_not_captured(_chosen(), model, None, False)
    lacking = _why_not_captured(_chosen(attention=frozenset()), loaded, None, False)
    assert lacking == "attention backend attn-x does not declare cuda-graphs"
    assert (
        _why_not_captured(_chosen(), loaded, None, needs_moe=True) == "moe backend moe-y does not declare cuda-graphs"
    )


def test_auto_logs_why_decode_runs_eager_and_on_refuses_to_start(monkeypatch: pytest.MonkeyPatch) -> None:
    import powertrain.assemble.engine as assembly

    loaded = SimpleNamespace(model=_Capturable())
    blocks = BlockManager(8, 4)
    # The module's logger itself (a logger cached on first use bypasses capture_logs).
    recorder = structlog.testing.CapturingLogger()
    monkeypatch.setattr(assembly, "log", recorder)
    assert decode_graphs(_chosen(graphs=False), loaded, blocks, 64, None, None, False) is None
    (call,) = recorder.calls
    assert call.args == ("decode steps run eager",)
    assert call.kwargs == {"why": "platform cuda cannot capture CUDA graphs"}
    with pytest.raises(AssemblyError, match='cuda_graphs = "on": platform cuda cannot capture CUDA graphs'):
        decode_graphs(_chosen(graphs=False, mode="on"), loaded, blocks, 64, None, None, False)
    assert decode_graphs(_chosen(mode="off"), loaded, blocks, 64, None, None, False) is None
    assert blocks.num_free_blocks == 8  # nothing was reserved


def test_a_capture_that_fails_falls_back_to_eager_under_auto_and_refuses_under_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Here the capture fails for real: there is no CUDA device to capture on."""
    import powertrain.assemble.engine as assembly
    from powertrain.engine.device_thread import DeviceThread

    loaded = SimpleNamespace(model=_Capturable(), kv_caches=[])
    recorder = structlog.testing.CapturingLogger()
    monkeypatch.setattr(assembly, "log", recorder)
    thread = DeviceThread()
    try:
        chosen = _chosen()
        chosen.device = torch.device("cpu")
        assert decode_graphs(chosen, loaded, BlockManager(8, 4), 64, None, thread, False) is None
        (call,) = recorder.calls
        assert call.method_name == "warning" and call.args == ("decode steps run eager",)
        assert call.kwargs["why"].startswith("capturing batch sizes [1, 2, 4, 8, 16, 24, 32, 48, 64] failed: ")
        on = _chosen(mode="on")
        on.device = torch.device("cpu")
        with pytest.raises(AssemblyError, match=r'cuda_graphs = "on": capturing batch sizes .* failed'):
            decode_graphs(on, loaded, BlockManager(8, 4), 64, None, thread, False)
    finally:
        thread.shutdown()


def test_reserved_blocks_are_never_handed_to_a_sequence() -> None:
    manager = BlockManager({None: 6, 8: 4}, 4)
    reserved = manager.reserve_blocks()
    assert set(reserved) == {None, 8}
    assert manager.num_free_blocks == 5 and manager.max_sequence_tokens == 5 * 4
    handed = {manager.pools[None].take_free() for _ in range(5)}
    assert reserved[None] not in handed and len(handed) == 5
    with pytest.raises(KeyError):  # none left: the reserved one is not among the free
        manager.pools[None].take_free()


def test_decode_graphs_refuse_bad_sizes_and_serve_only_decode_steps() -> None:
    model = SimpleNamespace(forward=lambda *args: None)
    with pytest.raises(ValueError, match="increasing and at least 1"):
        DecodeGraphs(model, [], sizes=[4, 2], block_size=4, max_model_len=32, pad_blocks={None: 0}, device="cpu")
    graphs = DecodeGraphs(
        model, [], sizes=[1, 4], block_size=4, max_model_len=32, pad_blocks={None: 0}, device="cpu", capture=False
    )
    graphs.capture_all()

    def step(query_lens: list[int], seq_lens: list[int], blocks: int = 2) -> AttentionMetadata:
        tables = [list(range(1, blocks + 1))] * len(query_lens)
        return AttentionMetadata.build(query_lens=query_lens, seq_lens=seq_lens, block_tables=tables, block_size=4)

    assert [graphs.size_for(step([1] * n, [5] * n)) for n in (1, 2, 3, 4)] == [1, 4, 4, 4]
    assert graphs.size_for(step([1] * 5, [5] * 5)) is None  # past the biggest size
    assert graphs.size_for(step([1, 3], [5, 7])) is None  # a chunk: eager
    assert graphs.size_for(step([1], [5], blocks=9)) is None  # wider than a 32-token sequence's table
    captured = graphs.captured[4].metadata
    assert captured.seq_lens_host == (32,) * 4 and captured.max_seq_len == 32 and captured.num_decodes == 4
    assert torch.equal(captured.slot_mapping, torch.zeros(4, dtype=torch.int64))  # padding: the reserved block 0


def test_cpu_engine_decodes_eager_by_default(tiny_v3_path) -> None:  # noqa: ANN001
    from powertrain import LLM, SamplingParams

    with LLM(str(tiny_v3_path)) as llm:
        assert llm.engine.runner.graphs is None
        assert llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0))[0].outputs[0].token_ids


@pytest.fixture(scope="module")
def tiny_v3_path(tmp_path_factory):  # noqa: ANN001, ANN201
    from powertrain.testing.checkpoints import write_tiny_deepseek

    return write_tiny_deepseek(tmp_path_factory.mktemp("tiny-v3"), num_nextn_predict_layers=0)

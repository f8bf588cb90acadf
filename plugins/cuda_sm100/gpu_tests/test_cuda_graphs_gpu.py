"""CUDA graphs on a GPU: captured decode steps replay what eager steps compute.

Only a machine with an NVIDIA GPU runs these (they skip elsewhere), and in their own
pytest process: ``tests/conftest.py`` puts every Triton kernel of its process in the
interpreter, these need the compiled ones::

    uv run pytest plugins/cuda_sm100/gpu_tests
"""

from __future__ import annotations

import json

import pytest
import torch

from powertrain import LLM, SamplingParams
from powertrain.components import PlatformInfo
from powertrain.interfaces import AttentionBackendContext, ModelContext
from powertrain.testing.base import fresh_seed
from powertrain.testing.graphs import check_decode_graphs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA graphs)")


@pytest.fixture
def seed() -> int:
    value = fresh_seed()
    torch.manual_seed(value)
    print(f"seed={value}")
    return value


def _llama_config(vocab: int, positions: int) -> object:
    """A 3-layer Llama, 8 query heads over 2 kv heads of 32: wide enough for real tiles."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        num_hidden_layers=3,
        max_position_embeddings=positions,
        initializer_range=0.05,
    )


@pytest.mark.parametrize("num_splits", [None, 8], ids=["triton-sm100", "triton-sm100-invariant"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_llama_decode_graphs_replay_eager_steps(seed: int, num_splits: int | None, dtype: torch.dtype) -> None:
    from transformers import LlamaForCausalLM as HFLlama

    from powertrain.builtin.platforms import detect_cuda
    from powertrain.models.llama import LlamaForCausalLM
    from powertrain.testing.checkpoints import random_hf_model
    from powertrain_cuda_sm100.attention import TritonAttention

    platform: PlatformInfo = detect_cuda()
    device = torch.device("cuda")
    hf = random_hf_model(HFLlama, _llama_config(vocab=100, positions=256))
    backend = TritonAttention(
        AttentionBackendContext(platform=platform, device=device, dtype=dtype, block_size=16), num_splits=num_splits
    )
    model = LlamaForCausalLM(
        ModelContext(config=json.loads(hf.config.to_json_string()), dtype=dtype, device=device, attention=backend)
    )
    model.load_weights(hf.state_dict().items())
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    graphs = check_decode_graphs(
        model,
        backend,
        dtype=dtype,
        device=device,
        capture=True,
        sizes=(1, 2, 4, 8, 16),
        batches=(1, 3, 16, 9),
        block_size=16,
        max_model_len=256,
        atol=tolerance,
        rtol=tolerance,
    )
    assert graphs.replays == 4 * 3


def _generate(path: str, mode: str, prompts: list[list[int]], **settings: object) -> tuple[list[list[int]], int]:
    """Greedy tokens of ``prompts`` with ``cuda_graphs = mode``, and the steps replayed."""
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    with LLM(path, cuda_graphs=mode, prefix_caching=False, **settings) as llm:
        tokens = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
        graphs = llm.engine.runner.graphs
        assert (graphs is None) == (mode == "off"), f"cuda_graphs={mode}: graphs {graphs}"
        return tokens, 0 if graphs is None else graphs.replays


def _prompts(count: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(count)
    return [torch.randint(3, 100, (int(n),), generator=g).tolist() for n in torch.randint(1, 40, (count,), generator=g)]


@pytest.mark.parametrize("attention", ["triton-sm100", "triton-sm100-invariant"])
def test_llama_engine_with_graphs_gives_the_eager_tokens(tmp_path, seed: int, attention: str) -> None:  # noqa: ANN001
    from transformers import LlamaForCausalLM as HFLlama

    from powertrain.testing.checkpoints import random_hf_model, save_with_tiny_tokenizer

    config = _llama_config(vocab=512, positions=512)
    path = str(save_with_tiny_tokenizer(random_hf_model(HFLlama, config), tmp_path / "llama"))
    prompts = _prompts(12)
    eager, _ = _generate(path, "off", prompts, dtype="float32", attention=attention)
    graphs, replays = _generate(path, "on", prompts, dtype="float32", attention=attention)
    assert replays > 0
    assert graphs == eager


def test_tiny_deepseek_v3_engine_with_graphs(tmp_path) -> None:  # noqa: ANN001
    """bfloat16 through the Triton MoE (float32 would pick a torch MoE, which does not
    capture): the padded batch rounds differently, so only the first tokens must agree;
    how many whole outputs agree is printed."""
    from powertrain.testing.checkpoints import write_tiny_deepseek

    path = str(write_tiny_deepseek(tmp_path / "v3", num_nextn_predict_layers=0, dtype=torch.bfloat16))
    prompts = _prompts(12)
    eager, _ = _generate(path, "off", prompts, dtype="bfloat16")
    graphs, replays = _generate(path, "on", prompts, dtype="bfloat16")
    assert replays > 0
    print(f"whole outputs equal: {sum(a == b for a, b in zip(graphs, eager, strict=True))}/{len(prompts)}")
    assert [t[0] for t in graphs] == [t[0] for t in eager]


@pytest.mark.parametrize("version", ["v3.2", "v4"])
def test_tiny_sparse_deepseek_engine_with_graphs(tmp_path, version: str) -> None:  # noqa: ANN001
    """V3.2's and V4's decode steps captured (the indexer's picks refused on the device,
    V4's closed windows found on the device): bfloat16 as for V3; the first tokens agree
    (a refused index would have failed the run)."""
    from powertrain.testing.checkpoints import write_tiny_deepseek_v4, write_tiny_deepseek_v32

    if version == "v3.2":
        path = str(write_tiny_deepseek_v32(tmp_path / "v32", num_nextn_predict_layers=0, dtype=torch.bfloat16))
    else:
        path = str(write_tiny_deepseek_v4(tmp_path / "v4", dtype=torch.bfloat16))
    prompts = _prompts(12)
    eager, _ = _generate(path, "off", prompts, dtype="bfloat16")
    graphs, replays = _generate(path, "on", prompts, dtype="bfloat16")
    assert replays > 0
    print(f"whole outputs equal: {sum(a == b for a, b in zip(graphs, eager, strict=True))}/{len(prompts)}")
    assert [t[0] for t in graphs] == [t[0] for t in eager]


@pytest.mark.parametrize("target", ["decode", "chunk"])
@pytest.mark.parametrize("kind", ["gqa", "mla"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_invariant_variant_is_batch_invariant_on_the_gpu(seed: int, kind: str, target: str, dtype: torch.dtype) -> None:
    """The kit's invariance check (``powertrain.testing.invariance``) for
    ``triton-sm100-invariant`` with compiled kernels: a sequence's rows alone and in a
    batch of 16, bit for bit."""
    from powertrain.builtin.platforms import detect_cuda
    from powertrain.interfaces import AttentionLayerSpec
    from powertrain.testing.invariance import check_batch_invariant
    from powertrain_cuda_sm100.attention import TritonAttention
    from powertrain_cuda_sm100.plugin import INVARIANT_SPLITS

    block_size = 16
    device = torch.device("cuda")
    backend = TritonAttention(
        AttentionBackendContext(platform=detect_cuda(), device=device, dtype=dtype, block_size=block_size),
        num_splits=INVARIANT_SPLITS,
    )
    if kind == "gqa":
        layer = AttentionLayerSpec(kind="gqa", num_heads=8, num_kv_heads=2, head_size=128, scale=128**-0.5)
    else:
        layer = AttentionLayerSpec(
            kind="mla", num_heads=16, num_kv_heads=1, head_size=576, scale=576**-0.5,
            kv_lora_rank=512, qk_rope_head_dim=64,
        )  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    context = int(torch.randint(1, 3 * block_size + 2, (1,), generator=gen))
    lengths = (context, 1) if target == "decode" else (context, int(torch.randint(2, 12, (1,), generator=gen)))
    check_batch_invariant(
        backend,
        layer,
        backend.kv_cache_spec(layer, block_size, dtype),
        target=lengths,
        block_size=block_size,
        dtype=dtype,
        seed=seed,
        device=device,
        what=f"{kind} {target} on the GPU",
    )

"""Captured decode steps through ``triton-sm100``, minus the capture (no GPU here).

``DecodeGraphs(capture=False)`` runs the padded step a graph would replay (padding rows
over the reserved block, host lengths at the model's length) eagerly, under the Triton
interpreter; the replay itself is checked on a GPU (``gpu_tests/test_cuda_graphs_gpu.py``).
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig
from transformers import LlamaForCausalLM as HFLlama

from powertrain.interfaces import AttentionBackendContext, HiddenTap, ModelContext
from powertrain.models.llama import LlamaForCausalLM
from powertrain.testing.base import fresh_seed
from powertrain.testing.checkpoints import random_hf_model
from powertrain.testing.graphs import check_decode_graphs


@pytest.mark.parametrize("num_splits", [None, 8], ids=["triton-sm100", "triton-sm100-invariant"])
def test_padded_decode_steps_equal_eager_ones(num_splits: int | None, interpreter_platform) -> None:  # noqa: ANN001
    from powertrain_cuda_sm100.attention import TritonAttention

    seed = fresh_seed()
    torch.manual_seed(seed)
    print(f"seed={seed}")
    config = LlamaConfig(
        vocab_size=100,
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_hidden_layers=2,
        max_position_embeddings=64,
        initializer_range=0.1,
    )
    hf = random_hf_model(HFLlama, config)
    backend = TritonAttention(
        AttentionBackendContext(
            platform=interpreter_platform, device=torch.device("cpu"), dtype=torch.float32, block_size=4
        ),
        num_splits=num_splits,
    )
    model = LlamaForCausalLM(
        ModelContext(
            config=json.loads(hf.config.to_json_string()),
            dtype=torch.float32,
            device=torch.device("cpu"),
            attention=backend,
        )
    )
    model.load_weights(hf.state_dict().items())
    graphs = check_decode_graphs(
        model,
        backend,
        dtype=torch.float32,
        device=torch.device("cpu"),
        capture=False,
        batches=(1, 5, 3),
        max_model_len=32,  # 8 blocks a sequence: every one of the 8 splits has one; the interpreter's time is per token
        taps=(HiddenTap(1, "layer_output"),),  # a drafter's tap rides along with the step
    )
    assert graphs.replays == 3 * 3


@pytest.mark.parametrize("version", ["v3.2", "v4"])
def test_padded_sparse_decode_steps_equal_eager_ones(version: str, tmp_path, interpreter_platform) -> None:  # noqa: ANN001
    """DeepSeek-V3.2 and V4 capture their decode steps (``captures_decode``): the indexer
    scores every key up to the model's length (host lengths are bounds in a captured
    step), V4's compressors find the windows a step closes from the lengths on the
    device, the padding rows pick their one token, and out-of-range picks are refused on
    the device; so a padded step equals the eager one and refuses nothing."""
    from powertrain.builtin.grouped_moe import TorchGroupedMoE
    from powertrain.loader import load_checkpoint
    from powertrain.models.deepseek_v4 import DeepseekV4ForCausalLM
    from powertrain.models.deepseek_v32 import DeepseekV32ForCausalLM
    from powertrain.testing.checkpoints import write_tiny_deepseek_v4, write_tiny_deepseek_v32
    from powertrain_cuda_sm100.attention import TritonAttention

    seed = fresh_seed()
    torch.manual_seed(seed)
    print(f"seed={seed}")
    write, model_class, block_size = {
        "v3.2": (write_tiny_deepseek_v32, DeepseekV32ForCausalLM, 4),
        "v4": (write_tiny_deepseek_v4, DeepseekV4ForCausalLM, 8),  # a multiple of its compression rates
    }[version]
    checkpoint = load_checkpoint(str(write(tmp_path, seed=seed)))
    cpu = torch.device("cpu")
    backend = TritonAttention(
        AttentionBackendContext(platform=interpreter_platform, device=cpu, dtype=torch.float32, block_size=block_size)
    )
    context = ModelContext(
        config=checkpoint.config, dtype=torch.float32, device=cpu, attention=backend, moe=TorchGroupedMoE(torch.float32)
    )
    model = model_class(context)
    model.load_weights(checkpoint.tensors())
    assert model_class.captures_decode
    graphs = check_decode_graphs(
        model,
        backend,
        dtype=torch.float32,
        device=cpu,
        capture=False,
        batches=(3,),
        decode_steps=2 if version == "v3.2" else 4,  # V4: four lengths in a row close a CSA window (rate 4)
        block_size=block_size,
        atol=1e-4,
        rtol=1e-4,
    )
    assert graphs.replays == (2 if version == "v3.2" else 4)
    record = graphs.captured[4].metadata.refused.record  # the size a batch of 3 ran at
    assert record is not None and record[0] == 0, "the sparse layers refuse on the device, and refused nothing"

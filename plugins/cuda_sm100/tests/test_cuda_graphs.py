"""Captured decode steps through ``triton-sm100``, minus the capture (no GPU here).

``DecodeGraphs(capture=False)`` runs the padded step a graph would replay (padding rows
over the reserved block, host lengths at the model's length) eagerly, under the Triton
interpreter; the replay itself is checked on a GPU (``gpu_tests/test_cuda_graphs_gpu.py``).
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from transformers import LlamaConfig
from transformers import LlamaForCausalLM as HFLlama

from powertrain.interfaces import AttentionBackendContext, ModelContext
from powertrain.models.llama import LlamaForCausalLM
from powertrain.testing.checkpoints import random_hf_model
from powertrain.testing.graphs import check_decode_graphs


@pytest.mark.parametrize("num_splits", [None, 8], ids=["triton-sm100", "triton-sm100-invariant"])
def test_padded_decode_steps_equal_eager_ones(num_splits: int | None, interpreter_platform) -> None:  # noqa: ANN001
    from powertrain_cuda_sm100.attention import TritonAttention

    seed = random.SystemRandom().randrange(2**31)
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
        model, backend, dtype=torch.float32, device=torch.device("cpu"), capture=False, batches=(1, 5, 3)
    )
    assert graphs.replays == 3 * 3

"""A whole Llama model with ``triton-sm100`` as its attention backend, against HF.

The model is built as assembly builds it — the backend's fused rotary + cache write
serves every attention layer and its RMSNorm kernel every norm — and driven through
a paged cache (ragged prefills, then decode steps). The kernels run under the
Triton interpreter (no GPU here); HF transformers' eager Llama is the oracle.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from transformers import LlamaConfig
from transformers import LlamaForCausalLM as HFLlama

from powertrain.interfaces import AttentionBackendContext, ModelContext
from powertrain.layers.norm import RMSNorm, use_norm_kernel
from powertrain.models.llama import LlamaForCausalLM
from powertrain.testing.base import fresh_seed
from powertrain.testing.checkpoints import random_hf_model
from powertrain.testing.paged import PagedRunner

VOCAB = 128


@pytest.fixture
def seed() -> int:
    value = fresh_seed()
    torch.manual_seed(value)
    random.seed(value)
    print(f"seed={value}")
    return value


def test_llama_through_the_triton_backend_matches_hf(seed: int, interpreter_platform) -> None:  # noqa: ANN001
    from powertrain_cuda_sm100.attention import TritonAttention

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_hidden_layers=2,
        max_position_embeddings=128,
        initializer_range=0.1,
        rms_norm_eps=1e-5,
    )
    hf = random_hf_model(HFLlama, config)

    backend = TritonAttention(
        AttentionBackendContext(
            platform=interpreter_platform, device=torch.device("cpu"), dtype=torch.float32, block_size=4
        )
    )
    norm_calls = 0
    real_rms_norm = backend.rms_norm

    def counting_rms_norm(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - a spy on the real kernel
        nonlocal norm_calls
        norm_calls += 1
        return real_rms_norm(*args, **kwargs)

    backend.rms_norm = counting_rms_norm
    context = ModelContext(
        config=json.loads(hf.config.to_json_string()),
        dtype=torch.float32,
        device=torch.device("cpu"),
        attention=backend,
    )
    model = LlamaForCausalLM(context)
    model.load_weights(hf.state_dict().items())
    norms = use_norm_kernel(model, backend)
    assert norms == 2 * 2 + 1 == sum(isinstance(m, RMSNorm) for m in model.modules())
    assert all(layer.self_attn.attn.fused_rotary for layer in model.model.layers)

    def hf_logits(tokens: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return hf(input_ids=torch.tensor([tokens])).logits[0].float()

    runner = PagedRunner(model, backend)
    sequences = {f"s{i}": torch.randint(0, VOCAB, (n,)).tolist() for i, n in enumerate([1, 9, 14])}
    outputs = runner.step(list(sequences.items()))
    for (name, tokens), ours in zip(sequences.items(), outputs, strict=True):
        torch.testing.assert_close(ours, hf_logits(tokens), atol=1e-4, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
    for step in range(2):
        chunks = [(name, torch.randint(0, VOCAB, (1,)).tolist()) for name in sequences]
        for (name, new), ours in zip(chunks, runner.step(chunks), strict=True):
            sequences[name] += new
            want = hf_logits(sequences[name])[-1:]
            torch.testing.assert_close(
                ours, want, atol=1e-4, rtol=1e-4, msg=lambda m, n=name, s=step: f"{n} step {s}: {m}"
            )
    assert norm_calls > 0

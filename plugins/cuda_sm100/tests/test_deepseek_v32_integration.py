"""Tiny DeepSeek-V3.2 with ``triton-sm100`` attention against the builtin torch backend.

The model runs as assembly builds it, its MLA layers through the backend's
``forward_mla_sparse`` over the top-k positions the backend's ``index_topk`` picks
(decode and prefill rows in one launch each), over a paged cache with the indexer's keys as a second cache group.
The kernels run under the Triton interpreter (no GPU here); the oracle is the same
model over ``TorchReferenceAttention``, same weights, same batches, float32.
"""

from __future__ import annotations

import torch

from powertrain.builtin.grouped_moe import TorchGroupedMoE
from powertrain.builtin.reference_attention import TorchReferenceAttention
from powertrain.components import PlatformInfo
from powertrain.interfaces import AttentionBackendContext, ModelContext
from powertrain.loader import load_checkpoint
from powertrain.models.deepseek_v32 import DeepseekV32ForCausalLM
from powertrain.testing.base import fresh_seed
from powertrain.testing.checkpoints import write_tiny_deepseek_v32
from powertrain.testing.paged import PagedRunner

BLOCK_SIZE = 4
#: Largest logit difference, relative to the largest logit: float32 through 3 layers.
RELATIVE_TOLERANCE = 1e-4


def _run(model: object, backend: object, prompts: dict[str, list[int]], decode_steps: int) -> list[torch.Tensor]:
    runner = PagedRunner(model, backend, dtype=torch.float32, block_size=BLOCK_SIZE, num_blocks=48)
    return runner.prefill_then_decode(prompts, decode_steps)


def test_tiny_deepseek_v32_through_the_triton_backend(tmp_path, interpreter_platform: PlatformInfo) -> None:  # noqa: ANN001
    from powertrain_cuda_sm100.attention import TritonAttention

    seed = fresh_seed()
    print(f"seed={seed}")
    checkpoint = load_checkpoint(str(write_tiny_deepseek_v32(tmp_path, seed=seed)))
    topk = checkpoint.config["index_topk"]
    triton_backend = TritonAttention(
        AttentionBackendContext(
            platform=interpreter_platform, device=torch.device("cpu"), dtype=torch.float32, block_size=BLOCK_SIZE
        )
    )
    sparse_calls = 0
    real_sparse = triton_backend.forward_mla_sparse

    def counting_sparse(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - a spy on the real kernel path
        nonlocal sparse_calls
        sparse_calls += 1
        return real_sparse(*args, **kwargs)

    triton_backend.forward_mla_sparse = counting_sparse
    index_calls = 0
    real_index = triton_backend.index_topk

    def counting_index(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - a spy on the real kernel path
        nonlocal index_calls
        index_calls += 1
        return real_index(*args, **kwargs)

    triton_backend.index_topk = counting_index

    def build(attention: object) -> DeepseekV32ForCausalLM:
        context = ModelContext(
            config=checkpoint.config,
            dtype=torch.float32,
            device=torch.device("cpu"),
            attention=attention,
            moe=TorchGroupedMoE(torch.float32),
        )
        model = DeepseekV32ForCausalLM(context)
        model.load_weights(checkpoint.tensors())
        return model

    vocab = checkpoint.config["vocab_size"]
    gen = torch.Generator().manual_seed(seed)
    # A single token, a prompt shorter than the indexer's top-k and a longer one (the
    # indexer then picks a subset, across several cache blocks).
    lengths = (("one", 1), ("short", topk - 3), ("long", 3 * topk + 1))
    prompts = {name: torch.randint(0, vocab, (n,), generator=gen).tolist() for name, n in lengths}
    steps = 2
    ours = _run(build(triton_backend), triton_backend, prompts, steps)
    reference_backend = TorchReferenceAttention()
    reference = _run(build(reference_backend), reference_backend, prompts, steps)
    assert sparse_calls == index_calls == checkpoint.config["num_hidden_layers"] * (1 + steps)
    for i, (got, want) in enumerate(zip(ours, reference, strict=True)):
        error = ((got - want).abs().max() / want.abs().max()).item()
        assert error <= RELATIVE_TOLERANCE, f"output {i}: logits off by {error:.2e} of the largest (seed={seed})"

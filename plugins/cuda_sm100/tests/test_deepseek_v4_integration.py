"""Tiny DeepSeek-V4 with ``triton-sm100`` attention against the builtin torch backend.

The model runs as assembly builds it: every attention layer (sliding, CSA, HCA) through
the backend's ``forward_v4`` over its own cache groups (the window's raw keys in a
sliding class, compressed entries in the full-history one), CSA's entries picked by the
backend's ``index_topk``; decode and prefill rows in one launch. The kernels run under
the Triton interpreter (no GPU here); the oracle is the same model over
``TorchReferenceAttention``, same weights, same batches, float32.
"""

from __future__ import annotations

import torch

from powertrain.builtin.grouped_moe import TorchGroupedMoE
from powertrain.builtin.reference_attention import TorchReferenceAttention
from powertrain.components import PlatformInfo
from powertrain.interfaces import AttentionBackendContext, ModelContext
from powertrain.loader import load_checkpoint
from powertrain.models.deepseek_v4 import DeepseekV4ForCausalLM
from powertrain.testing.base import fresh_seed
from powertrain.testing.checkpoints import write_tiny_deepseek_v4
from powertrain.testing.paged import PagedRunner

#: The tiny config's largest compression rate (HCA): a block holds whole entries.
BLOCK_SIZE = 8
#: Largest logit difference, relative to the largest logit: float32 through 4 layers.
RELATIVE_TOLERANCE = 1e-4


def test_tiny_deepseek_v4_through_the_triton_backend(tmp_path, interpreter_platform: PlatformInfo) -> None:  # noqa: ANN001
    from powertrain_cuda_sm100.attention import TritonAttention

    seed = fresh_seed()
    print(f"seed={seed}")
    checkpoint = load_checkpoint(str(write_tiny_deepseek_v4(tmp_path, seed=seed)))
    config = checkpoint.config
    triton_backend = TritonAttention(
        AttentionBackendContext(
            platform=interpreter_platform, device=torch.device("cpu"), dtype=torch.float32, block_size=BLOCK_SIZE
        )
    )
    calls: list[str] = []
    real_v4 = triton_backend.forward_v4

    def counting_v4(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - a spy on the real kernel path
        kind = "sliding" if kwargs["compress_rate"] is None else "hca" if kwargs["entry_indices"] is None else "csa"
        calls.append(kind)
        return real_v4(*args, **kwargs)

    triton_backend.forward_v4 = counting_v4
    real_index = triton_backend.index_topk

    def counting_index(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - a spy on the real kernel path
        calls.append("index")
        return real_index(*args, **kwargs)

    triton_backend.index_topk = counting_index

    def build(attention: object) -> DeepseekV4ForCausalLM:
        context = ModelContext(
            config=config, dtype=torch.float32, device=torch.device("cpu"), attention=attention, moe=TorchGroupedMoE()
        )
        model = DeepseekV4ForCausalLM(context)
        model.load_weights(checkpoint.tensors())
        return model

    gen = torch.Generator().manual_seed(seed)
    # One token; a prompt inside the first window; one past several windows, CSA entries
    # (more than index_topk) and HCA entries, ending inside an open window.
    window, topk = config["sliding_window"], config["index_topk"]
    lengths = (("one", 1), ("short", window - 3), ("long", 5 * window + 3))
    rates = config["compress_rates"]
    assert (5 * window + 3) // rates["compressed_sparse_attention"] > topk  # the indexer drops entries
    assert (5 * window + 3) // rates["heavily_compressed_attention"] >= 2
    prompts = {name: torch.randint(0, config["vocab_size"], (n,), generator=gen).tolist() for name, n in lengths}
    steps = 3
    ours = _run(build(triton_backend), triton_backend, prompts, steps, torch.float32)
    reference_backend = TorchReferenceAttention()
    reference = _run(build(reference_backend), reference_backend, prompts, steps, torch.float32)
    layers = config["num_hidden_layers"]
    assert calls.count("index") == calls.count("csa") > 0, calls  # CSA layers pick through the indexer kernel
    assert len(calls) - calls.count("index") == layers * (1 + steps), calls
    assert set(calls) == {"sliding", "csa", "hca", "index"}, calls
    for i, (got, want) in enumerate(zip(ours, reference, strict=True)):
        error = ((got - want).abs().max() / want.abs().max()).item()
        assert error <= RELATIVE_TOLERANCE, f"output {i}: logits off by {error:.2e} of the largest (seed={seed})"


def test_tiny_deepseek_v4_fp4_experts_through_the_triton_moe(tmp_path, interpreter_platform: PlatformInfo) -> None:  # noqa: ANN001
    """The release's FP4 experts kept packed for ``triton-sm100``'s MoE (``fp4``: dequantised
    tile by tile inside its GEMMs) give the logits of the same model whose experts were
    dequantised to bfloat16 at load, both through the Triton attention and MoE.

    Against a float32 torch oracle instead, bfloat16 rounding alone flips a near-tied
    routing or indexer choice now and then (measured: 0.2 relative error on one decode
    step, whichever Triton backend replaced its torch peer); here both runs round alike,
    and e2m1 values times their scales are exact in bfloat16, so the two agree to the bit
    under the interpreter. The MoE kit checks the FP4 path against float64."""
    from powertrain.interfaces import MoEBackendContext
    from powertrain_cuda_sm100.attention import TritonAttention
    from powertrain_cuda_sm100.moe import TritonMoE

    seed = fresh_seed()
    print(f"seed={seed}")
    checkpoint = load_checkpoint(str(write_tiny_deepseek_v4(tmp_path, seed=seed, fp4_experts=True)))
    config, dtype, cpu = checkpoint.config, torch.bfloat16, torch.device("cpu")
    attention = TritonAttention(
        AttentionBackendContext(platform=interpreter_platform, device=cpu, dtype=dtype, block_size=BLOCK_SIZE)
    )
    moe = TritonMoE(MoEBackendContext(platform=interpreter_platform, device=cpu, dtype=dtype))

    def build(packed: bool) -> DeepseekV4ForCausalLM:
        context = ModelContext(config=config, dtype=dtype, device=cpu, attention=attention, moe=moe, fp4_experts=packed)
        model = DeepseekV4ForCausalLM(context)
        model.load_weights(checkpoint.tensors(keep_fp4=model.keep_fp4))
        assert all(layer.prepared.fp4 == packed for layer in model.routed_expert_layers())
        return model

    gen = torch.Generator().manual_seed(seed)
    prompts = {"a": torch.randint(0, config["vocab_size"], (2 * config["sliding_window"] + 5,), generator=gen).tolist()}
    packed = _run(build(packed=True), attention, prompts, 2, dtype)
    dequantised = _run(build(packed=False), attention, prompts, 2, dtype)
    for i, (got, want) in enumerate(zip(packed, dequantised, strict=True)):
        error = ((got.float() - want.float()).norm() / want.float().norm()).item()
        print(f"output {i}: packed FP4 off by {error:.2e} (relative RMS) from the dequantised experts")
        # On a GPU the two GEMMs sum their K tiles in another order: float32 rounding only.
        assert error <= 1e-3, f"output {i}: packed FP4 logits off by {error:.2e} (seed={seed})"


def _run(
    model: object, backend: object, prompts: dict[str, list[int]], decode_steps: int, dtype: torch.dtype
) -> list[torch.Tensor]:
    runner = PagedRunner(model, backend, dtype=dtype, block_size=BLOCK_SIZE, num_blocks=48)
    return runner.prefill_then_decode(prompts, decode_steps)

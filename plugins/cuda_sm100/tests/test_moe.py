"""triton-sm100's MoE backend: the conformance kit, plus its alignment and fused gate/up GEMM alone.

No NVIDIA GPU exists where these run. What is mocked is the GPU only: the suite is
handed the conftest's interpreter platform (a "cuda" platform of capability 10.0
whose tensors live on the CPU), and the real Triton kernels, with the configs the
launchers pick for SM100, run under the Triton interpreter.
"""

from __future__ import annotations

import pytest
import torch

from powertrain.components import PlatformInfo
from powertrain.interfaces import ExpertWeights, MoEBackendContext
from powertrain.loader.fp8 import quantize_blocks
from powertrain.testing.base import fresh_seed, generator
from powertrain.testing.moe import MoEBackendSuite

# Widths that end inside blocks on both GEMMs: hidden 160 = 64 + 64 + 32 (gate/up K)
# = 128 + 32 (down N); intermediate 224 = 128 + 96 (gate/up N) = 3 * 64 + 32 (down K).
HIDDEN, INTERMEDIATE = 160, 224


class TestTritonMoE(MoEBackendSuite):
    component = "triton-sm100"
    dtypes = (torch.bfloat16, torch.float16)
    hidden_size = HIDDEN
    intermediate_size = INTERMEDIATE
    # FP8 with partial 128-blocks: K groups 128 + 128 + 64, and the up rows of w13
    # start mid-block (at 192), so each column must find its own weight scale.
    fp8_hidden_size = 320
    fp8_intermediate_size = 192

    @pytest.fixture
    def platform_info(self, interpreter_platform: PlatformInfo) -> PlatformInfo:
        # The GPU is what is mocked; the kernels themselves run, interpreted.
        return interpreter_platform


# --------------------------------------------------------------------------- alignment


def _alignment_oracle(topk_ids: torch.Tensor, first: int, local: int, block_m: int):
    """Per local expert, its flat pairs in token order; and the padded total."""
    groups: dict[int, list[int]] = {e: [] for e in range(local)}
    for pair, expert in enumerate(topk_ids.reshape(-1).tolist()):
        if first <= expert < first + local:
            groups[expert - first].append(pair)
    padded = sum(-(-len(g) // block_m) * block_m for g in groups.values())
    return groups, padded


@pytest.mark.parametrize("block_m", [4, 64])
@pytest.mark.parametrize("tokens", [1, 37])
def test_alignment_matches_oracle(block_m: int, tokens: int) -> None:
    from powertrain_cuda_sm100.kernels.moe_align import align_by_expert

    seed = fresh_seed()
    gen = generator(seed)
    global_experts, local, top_k = 24, 8, 4
    first = int(torch.randint(0, global_experts - local + 1, (1,), generator=gen))
    topk_ids = torch.randint(0, global_experts, (tokens, top_k), generator=gen, dtype=torch.int32)
    topk_ids[0, 0] = first + local - 1  # at least one local pair, and the last expert's
    align = align_by_expert(topk_ids, first, local, block_m)
    groups, padded = _alignment_oracle(topk_ids, first, local, block_m)
    where = f"tokens={tokens}, block_m={block_m}, experts {first}..{first + local - 1} (seed={seed})"

    num_pairs = tokens * top_k
    assert align.num_pairs == num_pairs
    assert int(align.num_padded) == padded, where
    assert align.capacity >= padded and align.capacity % block_m == 0, where
    sorted_pairs = align.sorted_pairs.tolist()
    start = 0
    for expert, pairs in groups.items():
        end = start + -(-len(pairs) // block_m) * block_m
        # The expert's pairs in token order, then padding up to its block boundary.
        assert sorted_pairs[start:end] == pairs + [num_pairs] * (end - start - len(pairs)), f"expert {expert}: {where}"
        assert set(align.block_experts[start // block_m : end // block_m].tolist()) <= {expert}, where
        start = end
    live = [p for p in sorted_pairs[:padded] if p != num_pairs]
    assert sorted(live) == sorted(p for g in groups.values() for p in g), f"each local pair once: {where}"


# --------------------------------------------------------------------------- fused gate/up GEMM


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_gate_up_silu_alone(fp8: bool) -> None:
    """silu(x Wg^T) * (x Wu^T) per sorted row against float64, padding rows left zero."""
    from powertrain_cuda_sm100.kernels import moe_gemm
    from powertrain_cuda_sm100.kernels.fp8_quant import FP8_DTYPE, quantize_per_token_group
    from powertrain_cuda_sm100.kernels.moe_align import align_by_expert

    seed = fresh_seed()
    gen = generator(seed)
    experts, tokens, top_k = 5, 11, 2
    hidden, intermediate = (320, 192) if fp8 else (HIDDEN, INTERMEDIATE)
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
    w13 = torch.randn(experts, 2 * intermediate, hidden, generator=gen) / hidden**0.5
    topk_ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]).to(torch.int32)
    config = moe_gemm.pick_configs((10, 0), fp8, 1.0).gate_up
    align = align_by_expert(topk_ids, 0, experts, config.block_m)
    if fp8:
        q13, s13 = quantize_blocks(w13, (128, 128))
        real13 = (
            q13.double()
            * s13.double().repeat_interleave(128, 1)[:, : 2 * intermediate].repeat_interleave(128, 2)[:, :, :hidden]
        )
        xq, xs = quantize_per_token_group(x)
        act, scale = moe_gemm.gate_up_silu(xq, xs, q13, s13, align, top_k, config, FP8_DTYPE)
        got = act.double() * scale.double().repeat_interleave(128, 1)[:, :intermediate]
        limit = 0.1  # e4m3 activations in and out: a few percent per row
    else:
        w13 = w13.to(torch.bfloat16)
        real13 = w13.double()
        act, _ = moe_gemm.gate_up_silu(x, None, w13, None, align, top_k, config, torch.bfloat16)
        got = act.double()
        limit = 1e-2  # one bf16 rounding of the output

    pairs = align.sorted_pairs[: int(align.num_padded)]
    for row, pair in enumerate(pairs.tolist()):
        if pair == align.num_pairs:
            assert torch.all(got[row] == 0), f"padding row {row} was written with non-zeros (seed={seed})"
            continue
        token, expert = divmod(pair, top_k)[0], int(topk_ids.reshape(-1)[pair])
        gate, up = (real13[expert] @ x[token].double()).chunk(2)
        want = torch.nn.functional.silu(gate) * up
        error = float((got[row] - want).norm() / want.norm())
        assert error < limit, f"row {row} (token {token}, expert {expert}) off by {error:.3g} (seed={seed})"


# --------------------------------------------------------------------------- refusals


def _backend(platform: PlatformInfo, dtype: torch.dtype):
    from powertrain_cuda_sm100.moe import TritonMoE

    return TritonMoE(MoEBackendContext(platform=platform, device=torch.device("cpu"), dtype=dtype))


def test_refuses_other_fp8_blocks(interpreter_platform: PlatformInfo) -> None:
    backend = _backend(interpreter_platform, torch.bfloat16)
    w13, w2 = torch.randn(2, 256, 128), torch.randn(2, 128, 128)
    (q13, s13), (q2, s2) = quantize_blocks(w13, (64, 64)), quantize_blocks(w2, (64, 64))
    weights = ExpertWeights(w13=q13, w2=q2, num_experts=2, w13_scale=s13, w2_scale=s2, block_shape=(64, 64))
    with pytest.raises(ValueError, match="128x128 block scales"):
        backend.prepare(weights)


def test_refuses_float32(interpreter_platform: PlatformInfo) -> None:
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        _backend(interpreter_platform, torch.float32)


# --------------------------------------------------------------------------- prefill-sized tiles


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_prefill_sized_batch(interpreter_platform: PlatformInfo, fp8: bool) -> None:
    """Enough rows per expert for the 128-row, 8-warp tiles (the kit's batches take the 64-row ones)."""
    from powertrain.loader.fp8 import dequantize_blocks
    from powertrain.testing.moe import reference_moe, row_errors
    from powertrain_cuda_sm100.kernels import moe_gemm

    seed = fresh_seed()
    gen = generator(seed)
    experts, tokens, top_k = 3, 100, 3
    assert moe_gemm.pick_configs((10, 0), fp8, tokens * top_k / experts).block_m == 128
    hidden, intermediate = (320, 192) if fp8 else (HIDDEN, INTERMEDIATE)
    backend = _backend(interpreter_platform, torch.bfloat16)
    w13 = torch.randn(experts, 2 * intermediate, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(experts, hidden, intermediate, generator=gen) / intermediate**0.5
    if fp8:
        (q13, s13), (q2, s2) = quantize_blocks(w13, (128, 128)), quantize_blocks(w2, (128, 128))
        weights = ExpertWeights(w13=q13, w2=q2, num_experts=experts, w13_scale=s13, w2_scale=s2, block_shape=(128, 128))
        w13, w2 = dequantize_blocks(q13, s13, (128, 128)), dequantize_blocks(q2, s2, (128, 128))
        limit = 0.1
    else:
        w13, w2 = w13.to(torch.bfloat16), w2.to(torch.bfloat16)
        weights = ExpertWeights(w13=w13, w2=w2, num_experts=experts)
        limit = 3e-2
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
    topk_ids = torch.stack([torch.randperm(experts, generator=gen) for _ in range(tokens)]).to(torch.int32)
    topk_weights = 0.1 + torch.rand(tokens, top_k, generator=gen)
    got = backend.forward(x, topk_ids, topk_weights, backend.prepare(weights))
    error = row_errors(got.double(), reference_moe(x, topk_ids, topk_weights, w13, w2))
    assert float(error.max()) < limit, f"worst row off by {float(error.max()):.3g} (seed={seed})"


# --------------------------------------------------------------------------- quantised dispatch


def test_forward_grouped_with_dispatch_scales(interpreter_platform: PlatformInfo) -> None:
    """Rows that arrive quantised (expert-parallel dispatch) give what their dequantized rows give.

    e4m3 rows with per-128-column scales feed the FP8 GEMM directly, which must equal
    the backend quantising bf16 rows itself; per-row scales are dequantized first.
    """
    from powertrain_cuda_sm100.kernels.fp8_quant import quantize_per_token_group

    seed = fresh_seed()
    gen = generator(seed)
    experts, hidden, intermediate = 4, 320, 192
    backend = _backend(interpreter_platform, torch.bfloat16)
    w13 = torch.randn(experts, 2 * intermediate, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(experts, hidden, intermediate, generator=gen) / intermediate**0.5
    (q13, s13), (q2, s2) = quantize_blocks(w13, (128, 128)), quantize_blocks(w2, (128, 128))
    fp8 = backend.prepare(
        ExpertWeights(w13=q13, w2=q2, num_experts=experts, w13_scale=s13, w2_scale=s2, block_shape=(128, 128))
    )
    counts = torch.tensor([3, 0, 5, 2])
    rows = torch.randn(int(counts.sum()), hidden, generator=gen).to(torch.bfloat16)
    quantised, scales = quantize_per_token_group(rows)
    got = backend.forward_grouped(quantised, counts, fp8, scales)
    want = backend.forward_grouped(rows, counts, fp8)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want), f"pre-quantised rows differ (seed={seed})"

    plain = backend.prepare(ExpertWeights(w13=w13.to(torch.bfloat16), w2=w2.to(torch.bfloat16), num_experts=experts))
    per_row = 0.5 + torch.rand(rows.shape[0], generator=gen)
    got = backend.forward_grouped(rows, counts, plain, per_row)
    want = backend.forward_grouped((rows.float() * per_row[:, None]).to(torch.bfloat16), counts, plain)
    assert torch.equal(got, want), f"per-row scales not applied (seed={seed})"

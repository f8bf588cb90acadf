"""``torch-grouped``: the portable MoE backend, in plain torch.

The (token, slot) pairs are sorted by expert once, so each active expert runs one
matmul over its contiguous group of rows: the same shape of work as a grouped-GEMM
kernel, with a Python loop over active experts only (never over tokens). Results
are written back per pair and summed over the top-k slots in float32, in a fixed
order, so the output does not depend on atomics (``index_add_`` on CUDA adds in
whatever order threads arrive).

FP8 block-scaled and packed FP4 experts stay so in memory; an expert's weights are
dequantized (``loader.fp8.dequantize_blocks``, ``loader.fp4.dequantize_fp4``) only in a
step that routes tokens to it.

With ``row_tile`` (``torch-grouped-invariant``) each group's rows are padded to whole
tiles of that many and multiplied tile by tile in one batched matmul: every row then goes
through a matmul of the same shape however many tokens the expert got, which makes a
token's output independent of the batch (a plain matmul's kernel, and with it the
rounding, changes with the row count: MKL's float32 gemm gives other bits for 1, 2 and 5
rows). The padding costs up to ``row_tile - 1`` rows of work per active expert.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from powertrain.interfaces import ExpertWeights, dequantize_row_groups
from powertrain.layers.activation import swiglu
from powertrain.layers.linear import tiled_matmul
from powertrain.loader.fp4 import dequantize_fp4
from powertrain.loader.fp8 import dequantize_blocks


def expert_matrices(weights: ExpertWeights, local: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Local expert ``local``'s (w13, w2) in ``dtype``, dequantized if FP8 or FP4."""
    if weights.fp4:
        assert weights.w13_scale is not None and weights.w2_scale is not None
        return (
            dequantize_fp4(weights.w13[local], weights.w13_scale[local], dtype),
            dequantize_fp4(weights.w2[local], weights.w2_scale[local], dtype),
        )
    if weights.block_shape is None:
        return weights.w13[local].to(dtype), weights.w2[local].to(dtype)
    assert weights.w13_scale is not None and weights.w2_scale is not None
    return (
        dequantize_blocks(weights.w13[local], weights.w13_scale[local], weights.block_shape, dtype),
        dequantize_blocks(weights.w2[local], weights.w2_scale[local], weights.block_shape, dtype),
    )


def tiled_linear(x: torch.Tensor, weight: torch.Tensor, tile: int | None) -> torch.Tensor:
    """``F.linear(x, weight)``; with ``tile``, in whole ``tile``-row matmuls (``tiled_matmul``)."""
    return F.linear(x, weight) if tile is None else tiled_matmul(x, weight.t(), tile)


def _run_experts(
    rows: torch.Tensor,
    counts: list[int],
    weights: ExpertWeights,
    out: torch.Tensor,
    destinations: torch.Tensor | None,
    row_tile: int | None = None,
) -> None:
    """Rows grouped by local expert (``counts`` per expert) through their experts.

    Group ``e``'s results go to ``out[destinations[group rows]]`` (or, without
    destinations, to the same rows of ``out``); ``out``'s dtype is the accumulator.
    """
    start = 0
    for local, count in enumerate(counts):
        if count == 0:
            continue
        end = start + count
        w13, w2 = expert_matrices(weights, local, rows.dtype)
        gate, up = tiled_linear(rows[start:end], w13, row_tile).float().chunk(2, dim=-1)
        result = tiled_linear(swiglu(gate, up, weights.swiglu_limit).to(rows.dtype), w2, row_tile)
        if destinations is None:
            out[start:end] = result
        else:
            out[destinations[start:end]] = result.to(out.dtype)
        start = end


class TorchGroupedMoE:
    """``interfaces.MoEBackend`` in plain torch: any device torch runs on, float, FP8 or FP4
    experts, plain or clamped (``swiglu_limit``) SwiGLU.

    Float32 inputs are computed in float32. Half-precision inputs run their matmuls
    in their dtype (whose kernels accumulate in float32) with the activation and the
    sum over top-k slots in float32, rounded once at the end.
    """

    name = "torch-grouped"

    def __init__(self, dtype: torch.dtype = torch.bfloat16, row_tile: int | None = None) -> None:
        #: What quantised activations (``forward_grouped`` with scales) are computed in.
        self.dtype = dtype
        #: Rows per matmul tile, for batch invariance (see the module doc); None: one matmul per group.
        self.row_tile = row_tile

    def prepare(self, weights: ExpertWeights) -> ExpertWeights:
        # The loader's layout is already what this backend multiplies with: keep it
        # (FP8 and FP4 included), only check it.
        weights.check()
        return weights

    def forward(
        self,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        weights: ExpertWeights,
    ) -> torch.Tensor:
        num_tokens, top_k = topk_ids.shape
        local_experts = weights.local_experts
        # Flat pair p = token * top_k + slot. Another rank's experts go to a sentinel
        # group past the last local expert, which is never run.
        expert_of_pair = topk_ids.reshape(-1).long() - weights.first_expert
        foreign = (expert_of_pair < 0) | (expert_of_pair >= local_experts)
        expert_of_pair = expert_of_pair.masked_fill(foreign, local_experts)
        pairs_by_expert = torch.argsort(expert_of_pair, stable=True)
        counts = torch.bincount(expert_of_pair, minlength=local_experts + 1).tolist()
        local_pairs = pairs_by_expert[: sum(counts[:local_experts])]

        per_pair = torch.zeros(num_tokens * top_k, hidden.shape[1], dtype=torch.float32, device=hidden.device)
        rows = hidden[torch.div(local_pairs, top_k, rounding_mode="floor")]
        _run_experts(rows, counts[:local_experts], weights, per_pair, local_pairs, self.row_tile)
        per_slot = per_pair.view(num_tokens, top_k, hidden.shape[1]).mul_(topk_weights.float().unsqueeze(-1))
        return per_slot.sum(dim=1).to(hidden.dtype)

    def forward_grouped(
        self,
        hidden: torch.Tensor,
        tokens_per_expert: torch.Tensor,
        weights: ExpertWeights,
        scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Rows grouped by local expert, unweighted.

        ``scales`` dequantize dispatched activations: ``[rows]`` (one per row, as
        Ascend's dispatch gives) or ``[rows, groups]`` (one per group of
        ``hidden / groups`` columns, as DeepEP's FP8 dispatch gives); the result is
        then in this backend's dtype.
        """
        counts = tokens_per_expert.tolist()
        if len(counts) != weights.local_experts or sum(counts) != hidden.shape[0]:
            raise ValueError(
                f"tokens_per_expert {counts} must have one count per local expert ({weights.local_experts}) "
                f"summing to the {hidden.shape[0]} rows"
            )
        if scales is not None:
            hidden = dequantize_row_groups(hidden, scales).to(self.dtype)
        out = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device)
        _run_experts(hidden, counts, weights, out, None, self.row_tile)
        return out

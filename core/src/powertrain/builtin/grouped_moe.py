"""``torch-grouped``: the portable MoE backend, in plain torch.

The (token, slot) pairs are sorted by expert once, so each active expert runs one
matmul over its contiguous group of rows: the same shape of work as a grouped-GEMM
kernel, with a Python loop over active experts only (never over tokens). Results
are written back per pair and summed over the top-k slots in float32, in a fixed
order, so the output does not depend on atomics (``index_add_`` on CUDA adds in
whatever order threads arrive).

FP8 block-scaled experts stay FP8 in memory; an expert's weights are dequantized
(``loader.fp8.dequantize_blocks``) only in a step that routes tokens to it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from powertrain.interfaces import ExpertWeights
from powertrain.loader.fp8 import FP8_DTYPE, dequantize_blocks


def _blocks(rows: int, cols: int, block: tuple[int, int]) -> tuple[int, int]:
    return -(-rows // block[0]), -(-cols // block[1])


def check_expert_weights(weights: ExpertWeights) -> None:
    """Raise ValueError unless ``weights`` is a consistent set of (FP8 or float) experts."""
    w13, w2 = weights.w13, weights.w2
    if w13.dim() != 3 or w2.dim() != 3 or w13.shape[1] % 2:
        raise ValueError(
            f"ExpertWeights: w13 must be [experts, 2 * intermediate, hidden] and w2 [experts, hidden, intermediate], "
            f"got {tuple(w13.shape)} and {tuple(w2.shape)}"
        )
    local, hidden, intermediate = w13.shape[0], w13.shape[2], w13.shape[1] // 2
    if tuple(w2.shape) != (local, hidden, intermediate):
        raise ValueError(
            f"ExpertWeights: w13 {tuple(w13.shape)} implies w2 of shape {(local, hidden, intermediate)}, "
            f"got {tuple(w2.shape)}"
        )
    if weights.first_expert < 0 or weights.first_expert + local > weights.num_experts:
        raise ValueError(
            f"ExpertWeights: experts {weights.first_expert}..{weights.first_expert + local - 1} "
            f"are not a slice of the {weights.num_experts} experts"
        )
    scales = (weights.w13_scale, weights.w2_scale, weights.block_shape)
    if all(s is None for s in scales):
        if not (w13.is_floating_point() and w2.is_floating_point()) or FP8_DTYPE in (w13.dtype, w2.dtype):
            raise ValueError(f"ExpertWeights: {w13.dtype}/{w2.dtype} weights need w13_scale, w2_scale and block_shape")
        return
    if any(s is None for s in scales):
        raise ValueError("ExpertWeights: FP8 experts need all of w13_scale, w2_scale and block_shape")
    if w13.dtype != FP8_DTYPE or w2.dtype != FP8_DTYPE:
        raise ValueError(f"ExpertWeights: block scales come with {FP8_DTYPE} weights, got {w13.dtype}/{w2.dtype}")
    block = weights.block_shape
    for label, weight, scale in (("w13", w13, weights.w13_scale), ("w2", w2, weights.w2_scale)):
        want = (local, *_blocks(weight.shape[1], weight.shape[2], block))
        if tuple(scale.shape) != want:
            raise ValueError(
                f"ExpertWeights: {label} {tuple(weight.shape)} in {block[0]}x{block[1]} blocks needs "
                f"{label}_scale of shape {want}, got {tuple(scale.shape)}"
            )


def expert_matrices(weights: ExpertWeights, local: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Local expert ``local``'s (w13, w2) in ``dtype``, dequantized if FP8."""
    if weights.block_shape is None:
        return weights.w13[local].to(dtype), weights.w2[local].to(dtype)
    assert weights.w13_scale is not None and weights.w2_scale is not None
    return (
        dequantize_blocks(weights.w13[local], weights.w13_scale[local], weights.block_shape, dtype),
        dequantize_blocks(weights.w2[local], weights.w2_scale[local], weights.block_shape, dtype),
    )


def _run_experts(
    rows: torch.Tensor,
    counts: list[int],
    weights: ExpertWeights,
    out: torch.Tensor,
    destinations: torch.Tensor | None,
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
        gate, up = F.linear(rows[start:end], w13).float().chunk(2, dim=-1)
        result = F.linear((F.silu(gate) * up).to(rows.dtype), w2)
        if destinations is None:
            out[start:end] = result
        else:
            out[destinations[start:end]] = result.to(out.dtype)
        start = end


class TorchGroupedMoE:
    """``interfaces.MoEBackend`` in plain torch: any device torch runs on, float or FP8 experts.

    Float32 inputs are computed in float32. Half-precision inputs run their matmuls
    in their dtype (whose kernels accumulate in float32) with the activation and the
    sum over top-k slots in float32, rounded once at the end.
    """

    name = "torch-grouped"

    def __init__(self, dtype: torch.dtype = torch.bfloat16) -> None:
        #: What quantised activations (``forward_grouped`` with scales) are computed in.
        self.dtype = dtype

    def prepare(self, weights: ExpertWeights) -> ExpertWeights:
        # The loader's layout is already what this backend multiplies with: keep it
        # (FP8 included), only check it.
        check_expert_weights(weights)
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
        _run_experts(rows, counts[:local_experts], weights, per_pair, local_pairs)
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
            hidden = _dequantize_rows(hidden, scales).to(self.dtype)
        out = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device)
        _run_experts(hidden, counts, weights, out, None)
        return out


def _dequantize_rows(hidden: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    rows, width = hidden.shape
    if rows == 0:
        return hidden.float()
    per_group = scales.float().reshape(rows, -1)
    groups = per_group.shape[1]
    if width % groups:
        raise ValueError(f"scales of shape {tuple(scales.shape)} do not split {width} columns into equal groups")
    return (hidden.float().view(rows, groups, width // groups) * per_group.unsqueeze(-1)).view(rows, width)

"""``triton-sm100``'s MoE backend: align by expert, two fused grouped GEMMs, combine.

``forward``: the (token, slot) pairs are sorted by local expert and padded to
M-blocks (``kernels.moe_align``); the gate/up GEMM gathers tokens and writes
``silu(gate) * up`` per sorted row; the down GEMM weights each row by its router
score and writes it to its pair's row; ``kernels.moe_combine`` sums a token's
slots in a fixed order. ``forward_grouped`` (rows already grouped, unweighted:
the expert-parallel path) runs the same GEMMs with one slot per row and weight 1,
writing straight into the output.

FP8 experts (e4m3, 128x128 float32 block scales) stay FP8: activations are
quantised per token and 128 columns before the gate/up GEMM, and the gate/up
epilogue quantises its own output the same way for the down GEMM.

FP4 experts (DeepSeek-V4's e2m1 with ue8m0 scales per 32 columns) stay packed, a
quarter of bf16's bytes: each GEMM dequantises its weight tile to the activations'
dtype in registers (weight-only: the activations are not quantised).

DeepSeek-V4's clamped SwiGLU (``ExpertWeights.swiglu_limit``) is applied in the gate/up
epilogue, before the activation.
"""

from __future__ import annotations

import attrs
import torch

from powertrain.interfaces import ExpertWeights, MoEBackendContext, dequantize_row_groups
from powertrain_cuda_sm100.capabilities import MOE_CAPABILITIES
from powertrain_cuda_sm100.kernels import moe_gemm
from powertrain_cuda_sm100.kernels.fp8_quant import FP8_DTYPE, GROUP, quantize_per_token_group
from powertrain_cuda_sm100.kernels.moe_align import Alignment, align_by_expert
from powertrain_cuda_sm100.kernels.moe_combine import combine

#: The only FP8 block shape the kernels handle: a K block must be one activation scale group.
FP8_BLOCK = (GROUP, GROUP)
HALF_DTYPES = (torch.bfloat16, torch.float16)


@attrs.frozen
class PreparedExperts:
    """Experts as the kernels read them: ``w13`` ``[E, 2I, H]`` and ``w2`` ``[E, H, I]``
    contiguous (K-major B operands, the loader's own orientation), FP8 with
    contiguous float32 block scales."""

    w13: torch.Tensor
    w2: torch.Tensor
    w13_scale: torch.Tensor | None
    w2_scale: torch.Tensor | None
    num_experts: int
    first_expert: int
    swiglu_limit: float | None = None
    #: Packed e2m1 ``w13`` ``[E, 2I, H / 2]`` / ``w2`` ``[E, H, I / 2]`` (uint8) with ue8m0
    #: scale bytes (uint8) per 32 columns.
    fp4: bool = False

    @property
    def fp8(self) -> bool:
        return self.w13_scale is not None and not self.fp4

    @property
    def local_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.w13.shape[2] * (2 if self.fp4 else 1)


class TritonMoE:
    """``interfaces.MoEBackend`` in Triton, for bf16/fp16 activations and bf16/fp16, FP8 or FP4 experts."""

    name = "triton-sm100"

    def __init__(self, context: MoEBackendContext) -> None:
        if context.dtype not in HALF_DTYPES:
            raise ValueError(f"triton-sm100 MoE computes in bfloat16 or float16, not {context.dtype}")
        self.dtype = context.dtype
        self.capability = context.platform.capability or (10, 0)

    # ----------------------------------------------------------------------- weights

    def prepare(self, weights: ExpertWeights) -> PreparedExperts:
        weights.check()
        weights.refuse_unsupported(self.name, MOE_CAPABILITIES)
        if weights.local_experts == 0:
            raise ValueError("triton-sm100 MoE: ExpertWeights holds no experts")
        if weights.fp4:
            assert weights.w13_scale is not None and weights.w2_scale is not None
            return PreparedExperts(
                weights.w13.contiguous(),
                weights.w2.contiguous(),
                weights.w13_scale.view(torch.uint8).contiguous(),
                weights.w2_scale.view(torch.uint8).contiguous(),
                weights.num_experts,
                weights.first_expert,
                weights.swiglu_limit,
                fp4=True,
            )
        if weights.block_shape is None:
            w13, w2 = weights.w13.to(self.dtype).contiguous(), weights.w2.to(self.dtype).contiguous()
            return PreparedExperts(w13, w2, None, None, weights.num_experts, weights.first_expert, weights.swiglu_limit)
        if tuple(weights.block_shape) != FP8_BLOCK:
            raise ValueError(
                f"triton-sm100 MoE supports FP8 experts with {FP8_BLOCK[0]}x{FP8_BLOCK[1]} block scales "
                f"(DeepSeek-V3's), got block_shape {tuple(weights.block_shape)}; dequantize the experts to bf16 "
                "or use the torch-grouped backend"
            )
        assert weights.w13_scale is not None and weights.w2_scale is not None
        return PreparedExperts(
            weights.w13.contiguous(),
            weights.w2.contiguous(),
            weights.w13_scale.float().contiguous(),
            weights.w2_scale.float().contiguous(),
            weights.num_experts,
            weights.first_expert,
            weights.swiglu_limit,
        )

    # ----------------------------------------------------------------------- forward

    def forward(
        self,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        weights: PreparedExperts,
    ) -> torch.Tensor:
        self._check_hidden(hidden, weights)
        tokens, top_k = topk_ids.shape
        out = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device)
        if tokens == 0:
            return out
        configs = self._configs(weights, tokens * top_k)
        align = align_by_expert(topk_ids, weights.first_expert, weights.local_experts, configs.block_m)
        pair_rows = torch.empty((tokens * top_k, hidden.shape[1]), dtype=hidden.dtype, device=hidden.device)
        flat_weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
        self._experts(hidden.contiguous(), None, weights, align, top_k, flat_weights, pair_rows, configs)
        return combine(pair_rows, topk_ids, weights.first_expert, weights.local_experts, out)

    def forward_grouped(
        self,
        hidden: torch.Tensor,
        tokens_per_expert: torch.Tensor,
        weights: PreparedExperts,
        scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Rows grouped by local expert, unweighted.

        ``scales`` come with quantised dispatch: e4m3 rows with one float32 scale per
        128 columns (DeepEP's FP8 dispatch) feed the FP8 GEMM as they are; any other
        quantisation (one scale per row, int8) is dequantized to this backend's
        dtype first. The result is then in that dtype. The counts must sum to the
        rows; that is not checked here, as checking would wait for the device.
        """
        if tokens_per_expert.shape != (weights.local_experts,):
            raise ValueError(
                f"tokens_per_expert has shape {tuple(tokens_per_expert.shape)}; expected one count per local "
                f"expert ({weights.local_experts},)"
            )
        rows = hidden.shape[0]
        activation_scale = None
        if scales is not None:
            groups = -(-hidden.shape[1] // GROUP)
            if weights.fp8 and hidden.dtype == FP8_DTYPE and tuple(scales.shape) == (rows, groups):
                activation_scale = scales.float().contiguous()
            else:
                hidden = dequantize_row_groups(hidden, scales).to(self.dtype)
        if activation_scale is None:
            self._check_hidden(hidden, weights)
        elif hidden.shape[1] != weights.hidden_size:
            raise ValueError(f"dispatched rows of shape {tuple(hidden.shape)}; expected [rows, {weights.hidden_size}]")
        out_dtype = self.dtype if activation_scale is not None else hidden.dtype
        out = torch.empty((rows, hidden.shape[1]), dtype=out_dtype, device=hidden.device)
        if rows == 0:
            return out
        # One slot per row, expert given by its group: the counts become ids (no host sync:
        # the output size is the row count).
        experts = torch.arange(weights.local_experts, device=hidden.device)
        ids = torch.repeat_interleave(experts, tokens_per_expert.to(hidden.device), output_size=rows)
        configs = self._configs(weights, rows)
        align = align_by_expert(ids.view(rows, 1), 0, weights.local_experts, configs.block_m)
        self._experts(hidden.contiguous(), activation_scale, weights, align, 1, None, out, configs)
        return out

    # ----------------------------------------------------------------------- internals

    def _configs(self, weights: PreparedExperts, rows: int) -> moe_gemm.MoEConfigs:
        return moe_gemm.pick_configs(self.capability, weights.fp8, rows / weights.local_experts)

    def _check_hidden(self, hidden: torch.Tensor, weights: PreparedExperts) -> None:
        if hidden.dtype not in HALF_DTYPES:
            raise ValueError(f"triton-sm100 MoE takes bfloat16 or float16 hidden states, got {hidden.dtype}")
        if not weights.fp8 and not weights.fp4 and hidden.dtype != weights.w13.dtype:
            raise ValueError(
                f"hidden states are {hidden.dtype} but the experts were prepared in {weights.w13.dtype}; "
                "build the backend with the model's dtype"
            )
        if hidden.dim() != 2 or hidden.shape[1] != weights.hidden_size:
            raise ValueError(f"hidden states of shape {tuple(hidden.shape)}; expected [tokens, {weights.hidden_size}]")

    def _experts(
        self,
        hidden: torch.Tensor,
        activation_scale: torch.Tensor | None,
        weights: PreparedExperts,
        align: Alignment,
        top_k: int,
        topk_weights: torch.Tensor | None,
        out: torch.Tensor,
        configs: moe_gemm.MoEConfigs,
    ) -> None:
        """Gate/up then down over the aligned rows; row ``pair`` of ``out`` gets its result."""
        if weights.fp8:
            if activation_scale is None:
                hidden, activation_scale = quantize_per_token_group(hidden)
            act, act_scale = moe_gemm.gate_up_silu(
                hidden,
                activation_scale,
                weights.w13,
                weights.w13_scale,
                align,
                top_k,
                configs.gate_up,
                FP8_DTYPE,
                weights.swiglu_limit,
            )
            moe_gemm.down(act, act_scale, weights.w2, weights.w2_scale, align, topk_weights, out, configs.down)
        else:  # bf16/fp16 experts, or FP4 ones dequantised tile by tile (their scales ride along)
            act, _ = moe_gemm.gate_up_silu(
                hidden,
                None,
                weights.w13,
                weights.w13_scale,
                align,
                top_k,
                configs.gate_up,
                hidden.dtype,
                weights.swiglu_limit,
                fp4=weights.fp4,
            )
            moe_gemm.down(
                act, None, weights.w2, weights.w2_scale, align, topk_weights, out, configs.down, fp4=weights.fp4
            )

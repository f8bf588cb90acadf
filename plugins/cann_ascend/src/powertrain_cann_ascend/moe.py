"""``ascend-cann``: routed experts through torch_npu's fused MoE operators.

One layer's forward is five ops, as the torch_npu API reference documents them
(Ascend/op-plugin ``docs/context/torch_npu-*.md``)::

    npu_moe_init_routing_v2   (token, slot) pairs sorted by expert; pairs of experts
                              outside this rank's ``active_expert_range`` are left out
    npu_grouped_matmul        gate/up: one [H, 2I] matrix per expert over its rows
    npu_swiglu                silu(first half) * second half; with DeepSeek-V4's
                              swiglu_limit, npu_clipped_swiglu (front/back halves,
                              alpha 1, bias 0, both halves clamped at the limit)
    npu_grouped_matmul        down: [I, H] per expert
    npu_moe_finalize_routing  sum over slots of weight * row, back in token order

Routing can also run on the device (``npu_moe_gating_top_k``) for the configs
``gating.routing_support`` accepts; the others route in the core.

Two documented constraints shape the code around the ops:

* ``npu_grouped_matmul`` wants ``group_list`` to cover exactly the rows of ``x``
  (the last cumulative count equals ``x.shape[0]``). Under expert parallelism
  init_routing leaves foreign pairs out, so the number of local pairs is read to
  the host (one sync per layer) and only those rows go through the experts; a full
  expert set needs no read.
* ``npu_moe_finalize_routing`` (drop_pad_mode 2: row-major indices) wants every
  index in ``[0, num_tokens * top_k)``, while init_routing marks foreign pairs -1.
  Expert outputs are padded with zero rows to ``num_tokens * top_k`` and foreign
  pairs point at the last row, which is padding whenever any pair is foreign, so
  they contribute exactly nothing.

Quantised dispatch (``forward_grouped`` with ``scales``): the int8 rows are
dequantized to the layer's dtype first (``interfaces.dequantize_row_groups``), then
multiplied like any rows. The op's int8 path (per_token_scale) needs int8 weights,
which bf16/fp16 experts are not.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from powertrain.components import Availability
from powertrain.interfaces import ExpertWeights, MoEBackendContext, RoutingConfig, dequantize_row_groups
from powertrain_cann_ascend import gating
from powertrain_cann_ascend.capabilities import MOE_CAPABILITIES

#: Expert dtypes npu_grouped_matmul multiplies without quantisation (float32 only
#: for single tensors; the record declares bf16 and fp16).
EXPERT_DTYPES = (torch.bfloat16, torch.float16)
#: npu_grouped_matmul: at most 1024 groups with a tensor group_list, and every
#: tensor's last dimension below 65536.
MAX_GROUPS = 1024
INNER_LIMIT = 65536


@attrs.frozen(kw_only=True)
class AscendExperts:
    """One layer's experts as ``npu_grouped_matmul`` multiplies them: ``x @ w``.

    ``w13`` is ``[local, hidden, 2 * intermediate]`` (gate columns first, as
    npu_swiglu gates the first half), ``w2`` is ``[local, intermediate, hidden]``.
    ``swiglu_limit``: DeepSeek-V4's clamp of the SwiGLU's inputs (None: plain SwiGLU).
    """

    w13: torch.Tensor
    w2: torch.Tensor
    num_experts: int
    first_expert: int
    swiglu_limit: float | None = None

    @property
    def local_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.w13.dtype

    @property
    def is_slice(self) -> bool:
        """Whether other ranks hold some of the experts (expert parallelism)."""
        return self.local_experts != self.num_experts


class AscendMoE:
    """``interfaces.MoEBackend`` and ``MoERouter`` on torch_npu's operators.

    ``ops`` is the ``torch_npu`` module (or, in tests, stand-ins with the same
    names and semantics); ``gating_limits`` says which release's documented limits
    of ``npu_moe_gating_top_k`` to respect.
    """

    name = "ascend-cann"

    def __init__(
        self, context: MoEBackendContext, ops: Any, gating_limits: gating.GatingLimits = gating.GENERAL
    ) -> None:
        if context.dtype not in EXPERT_DTYPES:
            raise ValueError(
                f"ascend-cann runs bf16 or fp16 experts, not {context.dtype}; choose another MoE backend for it"
            )
        self.context = context
        self.dtype = context.dtype
        self.ops = ops
        self.gating_limits = gating_limits

    # ----------------------------------------------------------------------- routing

    def routing_support(self, config: Any) -> Availability:
        return gating.routing_support(config, self.gating_limits)

    def route(
        self, router_logits: torch.Tensor, config: RoutingConfig, correction_bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``layers.moe.route``'s choice, computed by ``npu_moe_gating_top_k`` in float32."""
        support = self.routing_support(config)
        if not support.available:
            raise ValueError(f"ascend-cann cannot route this layer on the device: {support.reason}")
        if config.uses_correction_bias != (correction_bias is not None):
            need = "needs" if config.uses_correction_bias else "takes no"
            raise ValueError(f"topk_method {config.topk_method!r} {need} e_score_correction_bias")
        args = gating.gating_args(config)
        # The op wants bias in x's dtype; float32 keeps the choice identical to the core's.
        bias = None if correction_bias is None else correction_bias.float()
        weights, ids, _ = self.ops.npu_moe_gating_top_k(router_logits.float(), args.k, bias=bias, **args.kwargs())
        return ids.to(torch.int32), weights.float()

    # ----------------------------------------------------------------------- experts

    def prepare(self, weights: ExpertWeights) -> AscendExperts:
        """Check the experts and lay them out as ``[E, K, N]`` for npu_grouped_matmul."""
        weights.check()
        if weights.block_shape is not None:
            raise ValueError(
                "ascend-cann multiplies bf16/fp16 experts; FP8 block-scaled experts are not supported "
                "(the record does not declare fp8-block): load the checkpoint dequantized"
            )
        weights.refuse_unsupported("ascend-cann", MOE_CAPABILITIES)
        if weights.w13.dtype not in EXPERT_DTYPES or weights.w2.dtype != weights.w13.dtype:
            raise ValueError(
                f"ascend-cann multiplies bf16 or fp16 experts, got w13 {weights.w13.dtype} and w2 {weights.w2.dtype}"
            )
        local, two_i, hidden = weights.w13.shape
        if local > MAX_GROUPS:
            raise ValueError(f"npu_grouped_matmul takes at most {MAX_GROUPS} experts per call, this rank holds {local}")
        if max(hidden, two_i) >= INNER_LIMIT:
            raise ValueError(
                f"npu_grouped_matmul needs every last dimension below {INNER_LIMIT}: "
                f"hidden {hidden}, 2 * intermediate {two_i}"
            )
        return AscendExperts(
            w13=weights.w13.transpose(1, 2).contiguous(),
            w2=weights.w2.transpose(1, 2).contiguous(),
            num_experts=weights.num_experts,
            first_expert=weights.first_expert,
            swiglu_limit=weights.swiglu_limit,
        )

    def forward(
        self,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        weights: AscendExperts,
    ) -> torch.Tensor:
        num_tokens, top_k = topk_ids.shape
        if num_tokens == 0:  # the ops take no empty tensors
            return hidden.new_empty((0, hidden.shape[1]))
        self._check_dtype(hidden, weights)
        pairs = num_tokens * top_k
        first = weights.first_expert
        expanded, expanded_row_idx, counts, _ = self.ops.npu_moe_init_routing_v2(
            hidden,
            topk_ids.to(torch.int32),
            active_num=pairs,
            expert_num=weights.num_experts,
            drop_pad_mode=0,
            expert_tokens_num_type=1,  # counts per expert
            expert_tokens_num_flag=True,
            quant_mode=-1,
            active_expert_range=[first, first + weights.local_experts],
            row_idx_type=0,  # expanded_row_idx[pair] = its sorted row, -1 if foreign
        )
        rows = pairs
        if weights.is_slice:
            rows = int(counts.sum())  # the host read described in the module docstring
            if rows == 0:
                return torch.zeros_like(hidden)
        out = self._experts(expanded[:rows], counts, weights)
        if rows < pairs:
            padding = out.new_zeros((pairs - rows, out.shape[1]))
            out = torch.cat([out, padding])
            expanded_row_idx = torch.where(expanded_row_idx < 0, pairs - 1, expanded_row_idx)
        return self.ops.npu_moe_finalize_routing(
            out,
            None,
            None,
            None,
            topk_weights.to(out.dtype),
            expanded_row_idx.to(torch.int32),
            topk_ids.to(torch.int32),
            drop_pad_mode=2,  # dropless, index of pair (t, k) at t * top_k + k
        )

    def forward_grouped(
        self,
        hidden: torch.Tensor,
        tokens_per_expert: torch.Tensor,
        weights: AscendExperts,
        scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if tokens_per_expert.shape != (weights.local_experts,):
            raise ValueError(
                f"tokens_per_expert has shape {tuple(tokens_per_expert.shape)}, expected one count per "
                f"local expert ({weights.local_experts},)"
            )
        if scales is not None:
            hidden = dequantize_row_groups(hidden, scales).to(weights.dtype)
        if hidden.shape[0] == 0:
            return hidden.new_empty((0, hidden.shape[1]))
        self._check_dtype(hidden, weights)
        return self._experts(hidden, tokens_per_expert, weights)

    # ----------------------------------------------------------------------- helpers

    def _experts(self, rows: torch.Tensor, counts: torch.Tensor, weights: AscendExperts) -> torch.Tensor:
        """Rows grouped by local expert (``counts`` each) through gate/up, SwiGLU, down."""
        # Cumulative counts (group_list_type 0): the count form may not have length 1.
        group_list = torch.cumsum(counts.to(torch.int64), dim=0)
        grouped = {"group_list": group_list, "group_list_type": 0, "group_type": 0, "split_item": 3}
        gate_up = self.ops.npu_grouped_matmul([rows], [weights.w13], **grouped)[0]
        if weights.swiglu_limit is None:
            activated = self.ops.npu_swiglu(gate_up, dim=-1)
        else:  # silu(min(gate, limit)) * clamp(up, -limit, limit), as ExpertWeights.swiglu_limit says
            limit = float(weights.swiglu_limit)
            activated = self.ops.npu_clipped_swiglu(
                gate_up, dim=-1, alpha=1.0, limit=limit, bias=0.0, interleaved=False
            )
        return self.ops.npu_grouped_matmul([activated], [weights.w2], **grouped)[0]

    @staticmethod
    def _check_dtype(hidden: torch.Tensor, weights: AscendExperts) -> None:
        if hidden.dtype != weights.dtype:
            raise ValueError(
                f"hidden states are {hidden.dtype} but the experts are {weights.dtype}; "
                "npu_grouped_matmul multiplies equal dtypes"
            )

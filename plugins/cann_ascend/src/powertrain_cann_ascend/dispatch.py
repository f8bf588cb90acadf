"""Expert-parallel token exchange with ``npu_moe_distribute_dispatch`` / ``_combine``.

The two ops (torch_npu API reference, Ascend/op-plugin
``docs/context/torch_npu-npu_moe_distribute_{dispatch,combine}.md``) do the
all-to-all over an HCCL group addressed by its name, with the expert layout
implied by ``moe_expert_num / ep_world_size``: rank ``r`` holds experts
``r * local ... (r + 1) * local - 1`` (no shared-expert ranks here).

What the code around them has to respect:

* dispatch returns a receive buffer of ``A`` rows (``A = global_bs * min(local,
  top_k)``), of which only the first ``sum(expert_token_nums)`` are data, grouped
  by local expert. ``interfaces.ExpertDispatcher`` hands a MoE backend exactly the
  received rows, so their count is read to the host (one sync per layer) and the
  buffer sliced; ``combine`` pads the expert outputs back to ``A`` rows.
* ``expand_idx``, ``ep_recv_counts``, ``tp_recv_counts`` and ``expand_scales`` are
  opaque: they go back to combine untouched (the reference says their contents
  differ across SoCs and releases).
* ``global_bs`` must be the same on every rank and in every layer, and at least
  ``max_bs * ep_world_size`` when ranks send different token counts, so it is
  fixed from ``max_tokens_per_rank`` (the reference's A2 limit is 256 tokens per
  rank, A3's 512); a larger batch is refused, to be split by the caller.
* the ops take no empty batch, so a rank with no tokens sends one zero token to
  experts ``0 .. top_k-1`` with zero weights and drops its result: every rank must
  enter every collective.
* with ``quantize`` the op quantises rows to int8 with one float32 scale per row
  (quant_mode 2); those scales come back as ``dispatch``'s third result.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

#: Hidden-state dtypes the ops exchange.
EXCHANGE_DTYPES = (torch.bfloat16, torch.float16)
#: quant_mode values of npu_moe_distribute_dispatch.
NO_QUANT, DYNAMIC_INT8 = 0, 2


def ep_group_name(communicator: Any) -> str:
    """HCCL's name for the communicator's process group, which the ops take as ``group_ep``."""
    from powertrain_cann_ascend.communicator import hccl_group_name

    return hccl_group_name(communicator.group, communicator.rank)


@attrs.frozen(kw_only=True)
class DispatchHandle:
    """What combine needs from one dispatch (the op's outputs passed through untouched)."""

    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    expand_idx: torch.Tensor
    ep_recv_counts: torch.Tensor
    tp_recv_counts: torch.Tensor | None
    expand_scales: torch.Tensor | None
    num_experts: int
    #: Rows of dispatch's receive buffer (combine takes a buffer of the same size).
    buffer_rows: int
    #: The caller's tokens (0 when one padding token was sent instead).
    num_tokens: int
    dtype: torch.dtype


class AscendDispatcher:
    """``interfaces.ExpertDispatcher`` over HCCL with the fused MoE dispatch/combine ops."""

    def __init__(self, communicator: Any, ops: Any, *, max_tokens_per_rank: int = 256, quantize: bool = False) -> None:
        if communicator.world_size < 2:
            raise ValueError(
                f"expert-parallel dispatch needs at least 2 ranks, the communicator has {communicator.world_size}; "
                "a single rank runs MoEBackend.forward directly"
            )
        if max_tokens_per_rank < 1:
            raise ValueError(f"max_tokens_per_rank must be positive, got {max_tokens_per_rank}")
        self.ops = ops
        self.rank = communicator.rank
        self.world_size = communicator.world_size
        self.group_name = ep_group_name(communicator)
        self.max_tokens_per_rank = max_tokens_per_rank
        self.global_bs = max_tokens_per_rank * self.world_size
        self.quantize = quantize

    def dispatch(
        self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, DispatchHandle]:
        num_tokens, top_k = topk_ids.shape
        self._check(hidden, topk_ids, topk_weights, num_experts)
        if num_tokens == 0:
            hidden = hidden.new_zeros((1, hidden.shape[1]))
            topk_ids = torch.arange(top_k, dtype=torch.int32, device=hidden.device).unsqueeze(0)
            topk_weights = torch.zeros((1, top_k), dtype=torch.float32, device=hidden.device)
        outputs = self.ops.npu_moe_distribute_dispatch(
            x=hidden,
            expert_ids=topk_ids.to(torch.int32),
            group_ep=self.group_name,
            ep_world_size=self.world_size,
            ep_rank_id=self.rank,
            moe_expert_num=num_experts,
            expert_shard_type=0,
            shared_expert_rank_num=0,
            quant_mode=DYNAMIC_INT8 if self.quantize else NO_QUANT,
            global_bs=self.global_bs,
            expert_token_nums_type=1,  # counts per local expert
        )
        expand_x, dynamic_scales, expand_idx, expert_token_nums, ep_recv_counts, tp_recv_counts, expand_scales = (
            outputs[:7]
        )
        received = int(expert_token_nums.sum())  # the host read described in the module docstring
        handle = DispatchHandle(
            topk_ids=topk_ids.to(torch.int32),
            topk_weights=topk_weights.float(),
            expand_idx=expand_idx,
            ep_recv_counts=ep_recv_counts,
            tp_recv_counts=tp_recv_counts,
            expand_scales=expand_scales,
            num_experts=num_experts,
            buffer_rows=expand_x.shape[0],
            num_tokens=num_tokens,
            dtype=hidden.dtype,
        )
        scales = dynamic_scales[:received] if self.quantize else None
        return expand_x[:received], expert_token_nums.to(torch.int64), scales, handle

    def combine(self, expert_output: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        rows = expert_output.shape[0]
        if rows > handle.buffer_rows:
            raise ValueError(f"combine got {rows} expert rows, but dispatch received at most {handle.buffer_rows}")
        expand_x = expert_output.to(handle.dtype)
        if rows < handle.buffer_rows:
            padding = expand_x.new_zeros((handle.buffer_rows - rows, expand_x.shape[1]))
            expand_x = torch.cat([expand_x, padding])
        out = self.ops.npu_moe_distribute_combine(
            expand_x=expand_x,
            expert_ids=handle.topk_ids,
            expand_idx=handle.expand_idx,
            ep_send_counts=handle.ep_recv_counts,
            expert_scales=handle.topk_weights,
            group_ep=self.group_name,
            ep_world_size=self.world_size,
            ep_rank_id=self.rank,
            moe_expert_num=handle.num_experts,
            tp_send_counts=handle.tp_recv_counts,
            expand_scales=handle.expand_scales,
            expert_shard_type=0,
            shared_expert_rank_num=0,
            global_bs=self.global_bs,
        )
        return out[: handle.num_tokens]

    def _check(
        self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int
    ) -> None:
        """What this rank can check alone, before entering a collective its peers wait in."""
        num_tokens, top_k = topk_ids.shape
        if hidden.dim() != 2 or hidden.shape[0] != num_tokens or tuple(topk_weights.shape) != (num_tokens, top_k):
            raise ValueError(
                f"dispatch: hidden {tuple(hidden.shape)}, topk_ids {tuple(topk_ids.shape)} and topk_weights "
                f"{tuple(topk_weights.shape)} must be [T, H], [T, K] and [T, K]"
            )
        if hidden.dtype not in EXCHANGE_DTYPES:
            raise ValueError(f"npu_moe_distribute_dispatch exchanges bf16 or fp16 hidden states, got {hidden.dtype}")
        if num_experts % self.world_size:
            raise ValueError(
                f"npu_moe_distribute_dispatch splits the {num_experts} experts evenly over "
                f"{self.world_size} ranks; {num_experts} is not a multiple of {self.world_size}"
            )
        if num_tokens > self.max_tokens_per_rank:
            raise ValueError(
                f"dispatch of {num_tokens} tokens exceeds max_tokens_per_rank = {self.max_tokens_per_rank} "
                "(global_bs is fixed from it); split the batch"
            )

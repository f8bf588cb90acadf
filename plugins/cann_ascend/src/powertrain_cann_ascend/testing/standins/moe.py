"""torch_npu's MoE operators in plain torch, from their documented semantics.

No Ascend NPU or torch_npu exists where these tests run, so the NPU is what is
mocked: ``MoEOpsStandIn`` has methods named and called exactly like the torch_npu
ops the MoE backend and dispatcher use, computing what the torch_npu API reference
(Ascend/op-plugin ``docs/context/torch_npu-*.md``) and the CANN op references say
they compute. Every argument is checked the way the reference documents it, so an
argument-mapping mistake fails here instead of on a device. Only the argument
combinations powertrain uses are implemented; anything else raises
NotImplementedError naming it.

Numerics follow the hardware's habit: half-precision inputs, float32 accumulation,
outputs rounded to the input dtype. Buffer rows the reference calls invalid are
filled with NaN, so a caller that reads them fails loudly.

``npu_moe_distribute_dispatch`` / ``_combine`` exchange real data between ranks
with ``torch.distributed.all_to_all_single`` over the stand-in's process group
(gloo in tests); the group is the one registered under ``group_ep``'s name.
Relaxed on purpose: the SoC lists of ``ep_world_size`` (A2: 16/32/64, A3: 8..288)
and A3's fixed hidden size 7168, so two CPU processes with small layers can run
the exchange.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

HALF_DTYPES = (torch.float16, torch.bfloat16)
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _require(condition: bool, op: str, message: str) -> None:
    if not condition:
        raise ValueError(f"{op}: {message}")


def _unsupported(op: str, what: str) -> NotImplementedError:
    return NotImplementedError(f"{op} stand-in: {what} is not implemented (powertrain does not use it)")


class MoEOpsStandIn:
    """The torch_npu MoE ops powertrain calls; ``moe_calls`` records (op name, kwargs) for tests."""

    def __init__(self, group: Any = None, group_name: str | None = None) -> None:
        self.group = group
        self.group_name = group_name
        self.moe_calls: list[tuple[str, dict[str, Any]]] = []

    def _record(self, op: str, **kwargs: Any) -> None:
        self.moe_calls.append((op, kwargs))

    # ------------------------------------------------------------------- gating

    def npu_moe_gating_top_k(
        self,
        x: torch.Tensor,
        k: int,
        *,
        bias: torch.Tensor | None = None,
        k_group: int = 1,
        group_count: int = 1,
        group_select_mode: int = 0,
        renorm: int = 0,
        norm_type: int = 0,
        out_flag: bool = False,
        routed_scaling_factor: float = 1.0,
        eps: float = 1e-20,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        op = "npu_moe_gating_top_k"
        self._record(
            op,
            k=k,
            bias=bias,
            k_group=k_group,
            group_count=group_count,
            group_select_mode=group_select_mode,
            renorm=renorm,
            norm_type=norm_type,
            out_flag=out_flag,
            routed_scaling_factor=routed_scaling_factor,
            eps=eps,
        )
        _require(x.dim() == 2 and x.dtype in FLOAT_DTYPES, op, f"x must be a 2D fp16/bf16/fp32 tensor, got {x.dtype}")
        rows, experts = x.shape
        _require(rows > 0, op, "x may not be empty")
        _require(experts <= 2048, op, f"at most 2048 experts, got {experts}")
        if bias is not None:
            _require(bias.dim() == 1 and bias.shape[0] == experts, op, f"bias must be [{experts}]")
            _require(bias.dtype == x.dtype, op, f"bias dtype {bias.dtype} must equal x's {x.dtype}")
        _require(group_count > 0 and experts % group_count == 0, op, f"group_count {group_count} must divide {experts}")
        per_group = experts // group_count
        _require(per_group > 2, op, f"experts per group must exceed 2, got {per_group}")
        _require(-(-per_group // 32) * 32 * group_count <= 2048, op, "32-aligned group width x group_count > 2048")
        _require(1 <= k_group <= group_count, op, f"k_group {k_group} must be in [1, group_count={group_count}]")
        _require(1 <= k <= per_group * k_group, op, f"k {k} must be in [1, {per_group * k_group}]")
        _require(group_select_mode in (0, 1), op, f"group_select_mode must be 0 or 1, got {group_select_mode}")
        _require(norm_type in (0, 1), op, f"norm_type must be 0 (softmax) or 1 (sigmoid), got {norm_type}")
        _require(renorm == 0, op, f"renorm must be 0 (torch_npu documents only 0), got {renorm}")

        norm = x.float().softmax(dim=-1) if norm_type == 0 else x.float().sigmoid()
        value = norm if bias is None else norm + bias.float()
        if group_count > 1:
            grouped = value.view(rows, group_count, per_group)
            top2_sum = grouped.topk(2, dim=-1).values.sum(dim=-1)
            score = grouped.amax(dim=-1) if group_select_mode == 0 else top2_sum
            kept = torch.sort(score, dim=-1, descending=True, stable=True).indices[:, :k_group]
            dropped = torch.ones_like(score, dtype=torch.bool).scatter_(1, kept, False)
            value = grouped.masked_fill(dropped.unsqueeze(-1), float("-inf")).view(rows, experts)
        ids = torch.sort(value, dim=-1, descending=True, stable=True).indices[:, :k]
        y = norm.gather(1, ids)
        if norm_type == 1:  # sigmoid always renormalises; softmax only with renorm=1
            y = y / (y.sum(dim=-1, keepdim=True) + eps)
        y = y * routed_scaling_factor
        return y.to(x.dtype), ids.to(torch.int32), norm

    # ------------------------------------------------------------------- expert pipeline

    def npu_moe_init_routing_v2(
        self,
        x: torch.Tensor,
        expert_idx: torch.Tensor,
        *,
        scale: torch.Tensor | None = None,
        offset: torch.Tensor | None = None,
        active_num: int = -1,
        expert_capacity: int = -1,
        expert_num: int = -1,
        drop_pad_mode: int = 0,
        expert_tokens_num_type: int = 0,
        expert_tokens_num_flag: bool = False,
        quant_mode: int = 0,
        active_expert_range: Sequence[int] = (),
        row_idx_type: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        op = "npu_moe_init_routing_v2"
        self._record(
            op,
            active_num=active_num,
            expert_num=expert_num,
            drop_pad_mode=drop_pad_mode,
            expert_tokens_num_type=expert_tokens_num_type,
            expert_tokens_num_flag=expert_tokens_num_flag,
            quant_mode=quant_mode,
            active_expert_range=list(active_expert_range),
            row_idx_type=row_idx_type,
        )
        _require(x.dim() == 2 and x.dtype in FLOAT_DTYPES, op, f"x must be a 2D float tensor, got {x.dtype}")
        _require(expert_idx.dim() == 2 and expert_idx.dtype == torch.int32, op, "expert_idx must be 2D int32")
        rows, k = expert_idx.shape
        _require(x.shape[0] == rows, op, f"x has {x.shape[0]} rows, expert_idx {rows}")
        _require(len(active_expert_range) == 2, op, "active_expert_range needs [expert_start, expert_end]")
        start, end = (int(v) for v in active_expert_range)
        _require(0 <= start < end <= 10240, op, f"active_expert_range {[start, end]} must be increasing in [0, 10240]")
        _require(0 <= expert_num <= 10240 and end <= expert_num, op, f"expert_end {end} exceeds expert_num")
        _require(active_num >= 0, op, f"active_num must be >= 0, got {active_num}")
        if active_num < rows * k:
            raise _unsupported(op, f"active_num {active_num} < NUM_ROWS * K = {rows * k} (truncation)")
        if drop_pad_mode != 0:
            raise _unsupported(op, f"drop_pad_mode={drop_pad_mode}")
        if quant_mode != -1 or scale is not None or offset is not None:
            raise _unsupported(op, f"quant_mode={quant_mode} / scale / offset")
        if not expert_tokens_num_flag or expert_tokens_num_type not in (0, 1):
            raise _unsupported(op, f"expert_tokens_num_type={expert_tokens_num_type} without flag")
        _require(row_idx_type in (0, 1), op, f"row_idx_type must be 0 or 1, got {row_idx_type}")
        flat = expert_idx.reshape(-1).long()
        _require(bool(((flat >= 0) & (flat < expert_num)).all()), op, "expert ids must lie in [0, expert_num)")

        active = (flat >= start) & (flat < end)
        available = int(active.sum())
        # Sort by expert with inactive pairs last (stable, so pairs of one expert keep token order).
        key = torch.where(active, flat, torch.iinfo(torch.int64).max)
        order = torch.sort(key, stable=True).indices
        expanded_x = torch.full((rows * k, x.shape[1]), float("nan"), dtype=x.dtype)
        expanded_x[:available] = x[order[:available] // k]
        if row_idx_type == 1:
            expanded_row_idx = order.to(torch.int32)
        else:
            expanded_row_idx = torch.full((rows * k,), -1, dtype=torch.int32)
            expanded_row_idx[order[:available]] = torch.arange(available, dtype=torch.int32)
        counts = torch.bincount(flat[active] - start, minlength=end - start).to(torch.int64)
        if expert_tokens_num_type == 0:
            counts = counts.cumsum(0)
        expanded_scale = torch.full((rows * k,), float("nan"))  # meaningless without scale
        return expanded_x, expanded_row_idx, counts, expanded_scale

    def npu_grouped_matmul(
        self,
        x: Sequence[torch.Tensor],
        weight: Sequence[torch.Tensor],
        *,
        bias: Any = None,
        scale: Any = None,
        offset: Any = None,
        antiquant_scale: Any = None,
        antiquant_offset: Any = None,
        per_token_scale: Any = None,
        group_list: torch.Tensor | None = None,
        activation_input: Any = None,
        activation_quant_scale: Any = None,
        activation_quant_offset: Any = None,
        split_item: int = 0,
        group_type: int | None = None,
        group_list_type: int = 0,
        act_type: int = 0,
        output_dtype: torch.dtype | None = None,
        tuning_config: Any = None,
    ) -> list[torch.Tensor]:
        op = "npu_grouped_matmul"
        self._record(op, split_item=split_item, group_type=group_type, group_list_type=group_list_type)
        extras = (bias, scale, offset, antiquant_scale, antiquant_offset, per_token_scale, activation_input)
        if any(e is not None for e in (*extras, activation_quant_scale, activation_quant_offset)):
            raise _unsupported(op, "bias, quantisation or activation inputs")
        if act_type != 0 or tuning_config is not None:
            raise _unsupported(op, f"act_type={act_type} / tuning_config")
        if len(x) != 1 or len(weight) != 1:
            raise _unsupported(op, f"{len(x)} x tensors and {len(weight)} weights (only single-single-single)")
        if group_type != 0 or split_item not in (2, 3):
            raise _unsupported(op, f"group_type={group_type}, split_item={split_item}")
        (a,), (w,) = x, weight
        _require(a.dim() == 2 and w.dim() == 3, op, f"x must be 2D and weight 3D, got {a.dim()}D and {w.dim()}D")
        _require(a.dtype == w.dtype and a.dtype in FLOAT_DTYPES, op, f"x {a.dtype} and weight {w.dtype} must match")
        _require(output_dtype in (None, a.dtype), op, f"output_dtype {output_dtype} must be None or {a.dtype}")
        groups, inner, width = w.shape
        _require(a.shape[1] == inner, op, f"x has K={a.shape[1]}, weight K={inner}")
        _require(max(inner, width) < 65536, op, "last dimensions must be below 65536")
        _require(
            isinstance(group_list, torch.Tensor) and group_list.dtype == torch.int64 and group_list.dim() == 1,
            op,
            "group_list must be a 1D int64 tensor",
        )
        assert group_list is not None
        _require(group_list.shape[0] == groups, op, f"group_list has {group_list.shape[0]} entries, weight {groups}")
        _require(groups <= 1024, op, f"at most 1024 groups, got {groups}")
        values = group_list.tolist()
        if group_list_type == 0:
            _require(all(v >= 0 for v in values), op, "cumulative group_list must be non-negative")
            rising = all(b >= a_ for a_, b in zip(values, values[1:], strict=False))
            _require(rising, op, "group_list must not decrease")
            _require(values[-1] == a.shape[0], op, f"group_list ends at {values[-1]}, x has {a.shape[0]} rows")
            counts = [b - a_ for a_, b in zip([0, *values], values, strict=False)]
        elif group_list_type == 1:
            _require(len(values) != 1, op, "a count group_list may not have length 1")
            _require(all(v >= 0 for v in values), op, "counts must be non-negative")
            _require(sum(values) == a.shape[0], op, f"counts sum to {sum(values)}, x has {a.shape[0]} rows")
            counts = values
        else:
            raise _unsupported(op, f"group_list_type={group_list_type}")
        _require(bool(torch.isfinite(a).all()), op, "x holds non-finite values (an invalid buffer row was passed)")
        out = torch.empty((a.shape[0], width), dtype=a.dtype)
        row = 0
        for group, count in enumerate(counts):
            out[row : row + count] = (a[row : row + count].float() @ w[group].float()).to(a.dtype)
            row += count
        return [out]

    def npu_swiglu(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        op = "npu_swiglu"
        self._record(op, dim=dim)
        _require(x.dtype in FLOAT_DTYPES and x.numel() > 0, op, "x must be a non-empty fp32/fp16/bf16 tensor")
        _require(x.is_contiguous(), op, "x must be contiguous")
        _require(x.shape[dim] % 2 == 0, op, f"dim {dim} of {tuple(x.shape)} must split in two halves")
        gate, up = x.float().chunk(2, dim=dim)
        return (F.silu(gate) * up).to(x.dtype)

    def npu_clipped_swiglu(
        self,
        x: torch.Tensor,
        *,
        group_index: torch.Tensor | None = None,
        dim: int = -1,
        alpha: float = 1.702,
        limit: float = 7.0,
        bias: float = 1.0,
        interleaved: bool = True,
    ) -> torch.Tensor:
        """The documented formula (op-plugin ``torch_npu-npu_clipped_swiglu.md``): ``x`` split
        along ``dim`` into ``A`` and ``B`` (even/odd columns with ``interleaved``, else front
        and back halves), ``A`` clamped above at ``limit``, ``B`` to ``[-limit, limit]``,
        ``y = A * sigmoid(alpha * A) * (B + bias)``; computed in float32 here (the operator's
        internal precision is not documented), returned in ``x``'s dtype."""
        op = "npu_clipped_swiglu"
        self._record(op, dim=dim, alpha=alpha, limit=limit, bias=bias, interleaved=interleaved)
        _require(x.dtype in FLOAT_DTYPES and x.dim() > 1, op, "x must be a fp32/fp16/bf16 tensor of 2 or more dims")
        _require(x.is_contiguous(), op, "x must be contiguous")
        _require(x.shape[dim] % 2 == 0, op, f"dim {dim} of {tuple(x.shape)} must split in two halves")
        if group_index is not None:
            raise _unsupported(op, "group_index")
        values = x.float().movedim(dim, -1)
        a, b = (values[..., ::2], values[..., 1::2]) if interleaved else values.chunk(2, dim=-1)
        a, b = a.clamp(max=limit), b.clamp(min=-limit, max=limit)
        return (a * torch.sigmoid(alpha * a) * (b + bias)).movedim(-1, dim).to(x.dtype)

    def npu_moe_finalize_routing(
        self,
        expanded_permuted_rows: torch.Tensor,
        skip1: torch.Tensor | None,
        skip2: torch.Tensor | None,
        bias: torch.Tensor | None,
        scales: torch.Tensor | None,
        expanded_src_to_dst_row: torch.Tensor,
        export_for_source_row: torch.Tensor | None,
        drop_pad_mode: int = 0,
    ) -> torch.Tensor:
        op = "npu_moe_finalize_routing"
        self._record(op, drop_pad_mode=drop_pad_mode)
        if skip1 is not None or skip2 is not None or bias is not None:
            raise _unsupported(op, "skip1 / skip2 / bias")
        if drop_pad_mode not in (0, 2):
            raise _unsupported(op, f"drop_pad_mode={drop_pad_mode} (drop-pad)")
        rows = expanded_permuted_rows
        _require(rows.dim() == 2 and rows.dtype in FLOAT_DTYPES, op, "expanded_permuted_rows must be a 2D float tensor")
        _require(scales is not None and scales.dim() == 2, op, "scales must be [NUM_ROWS, K]")
        assert scales is not None
        _require(scales.dtype == rows.dtype, op, f"scales {scales.dtype} must match the rows' {rows.dtype}")
        num_rows, k = scales.shape
        _require(rows.shape[0] == num_rows * k, op, f"expanded rows {rows.shape[0]} != NUM_ROWS * K = {num_rows * k}")
        index = expanded_src_to_dst_row
        _require(index.dtype == torch.int32 and tuple(index.shape) == (num_rows * k,), op, "index must be int32 [N*K]")
        _require(bool(((index >= 0) & (index < num_rows * k)).all()), op, "dropless indices must lie in [0, N*K)")
        if export_for_source_row is not None:
            _require(
                export_for_source_row.dtype == torch.int32 and tuple(export_for_source_row.shape) == (num_rows, k),
                op,
                "export_for_source_row must be int32 [NUM_ROWS, K]",
            )
        # Mode 2 lists pair (i, k) at i * K + k; mode 0 at i + k * NUM_ROWS.
        per_pair = index.long().view(num_rows, k) if drop_pad_mode == 2 else index.long().view(k, num_rows).T
        gathered = rows.float()[per_pair]  # [N, K, H]
        _require(bool(torch.isfinite(gathered).all()), op, "an index points at an invalid (non-finite) row")
        return (gathered * scales.float().unsqueeze(-1)).sum(dim=1).to(rows.dtype)

    # ------------------------------------------------------------------- expert parallelism

    def _ep_checks(
        self,
        op: str,
        group_ep: str,
        ep_world_size: int,
        ep_rank_id: int,
        moe_expert_num: int,
        expert_ids: torch.Tensor,
        *,
        expert_shard_type: int,
        shared_expert_rank_num: int,
        group_tp: str,
        tp_world_size: int,
    ) -> int:
        import torch.distributed as dist

        _require(self.group is not None, op, "the stand-in was built without a process group")
        _require(group_ep == self.group_name, op, f"group_ep {group_ep!r} is not the EP group {self.group_name!r}")
        _require(1 <= len(group_ep) < 128, op, "group_ep must have 1..127 characters")
        _require(ep_world_size == dist.get_world_size(self.group), op, f"ep_world_size {ep_world_size} != group size")
        _require(ep_rank_id == dist.get_rank(self.group), op, f"ep_rank_id {ep_rank_id} != this rank")
        if shared_expert_rank_num != 0 or expert_shard_type != 0:
            raise _unsupported(op, "shared-expert ranks")
        if group_tp or tp_world_size not in (0, 1):
            raise _unsupported(op, "a TP domain")
        _require(1 <= moe_expert_num <= 512, op, f"moe_expert_num {moe_expert_num} must be in [1, 512]")
        _require(moe_expert_num % ep_world_size == 0, op, f"moe_expert_num {moe_expert_num} % ep_world_size != 0")
        _require(expert_ids.dim() == 2 and expert_ids.dtype == torch.int32, op, "expert_ids must be 2D int32")
        bs, k = expert_ids.shape
        _require(bs > 0, op, "BS must be > 0 (no empty batches)")
        _require(0 < k <= min(16, moe_expert_num), op, f"K={k} must be in (0, min(16, moe_expert_num)]")
        ids = expert_ids.long()
        _require(bool(((ids >= 0) & (ids < moe_expert_num)).all()), op, "expert ids must lie in [0, moe_expert_num)")
        _require(bool((ids.sort(dim=1).values.diff(dim=1) != 0).all()), op, "a token's K expert ids must differ")
        return moe_expert_num // ep_world_size

    def _exchange(self, tensor: torch.Tensor, recv_splits: list[int], send_splits: list[int]) -> torch.Tensor:
        """Uneven all-to-all of rows, moved as raw bytes so any dtype crosses gloo."""
        import torch.distributed as dist

        row_bytes = math.prod(tensor.shape[1:]) * tensor.element_size()
        raw = tensor.contiguous().view(torch.uint8).reshape(tensor.shape[0], row_bytes)
        out = torch.empty((sum(recv_splits), row_bytes), dtype=torch.uint8)
        dist.all_to_all_single(out, raw, recv_splits, send_splits, group=self.group)
        return out.view(tensor.dtype).reshape(sum(recv_splits), *tensor.shape[1:])

    def _buffer_rows(self, op: str, global_bs: int, bs: int, world: int, local: int, k: int) -> int:
        """A: the receive buffer's rows, after checking global_bs the way the reference states it."""
        import torch.distributed as dist

        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(sizes, torch.tensor([bs]), group=self.group)
        max_bs = max(int(s) for s in sizes)
        if global_bs == 0:
            _require(all(int(s) == bs for s in sizes), op, "global_bs=0 needs the same BS on every rank")
            return bs * world * min(local, k)
        _require(global_bs >= max_bs * world, op, f"global_bs {global_bs} < max BS {max_bs} x ep_world_size {world}")
        return global_bs * min(local, k)

    def npu_moe_distribute_dispatch(
        self,
        x: torch.Tensor,
        expert_ids: torch.Tensor,
        group_ep: str,
        ep_world_size: int,
        ep_rank_id: int,
        moe_expert_num: int,
        *,
        scales: torch.Tensor | None = None,
        x_active_mask: torch.Tensor | None = None,
        expert_scales: torch.Tensor | None = None,
        group_tp: str = "",
        tp_world_size: int = 0,
        tp_rank_id: int = 0,
        expert_shard_type: int = 0,
        shared_expert_num: int = 1,
        shared_expert_rank_num: int = 0,
        quant_mode: int = 0,
        global_bs: int = 0,
        expert_token_nums_type: int = 1,
    ) -> tuple[torch.Tensor, ...]:
        import torch.distributed as dist

        op = "npu_moe_distribute_dispatch"
        self._record(
            op,
            ep_world_size=ep_world_size,
            moe_expert_num=moe_expert_num,
            quant_mode=quant_mode,
            global_bs=global_bs,
            expert_token_nums_type=expert_token_nums_type,
        )
        local = self._ep_checks(
            op,
            group_ep,
            ep_world_size,
            ep_rank_id,
            moe_expert_num,
            expert_ids,
            expert_shard_type=expert_shard_type,
            shared_expert_rank_num=shared_expert_rank_num,
            group_tp=group_tp,
            tp_world_size=tp_world_size,
        )
        if scales is not None or expert_scales is not None or x_active_mask is not None:
            raise _unsupported(op, "scales / expert_scales / x_active_mask")
        _require(quant_mode in (0, 2), op, f"quant_mode must be 0 or 2, got {quant_mode}")
        _require(expert_token_nums_type in (0, 1), op, "expert_token_nums_type must be 0 or 1")
        bs, k = expert_ids.shape
        _require(x.dim() == 2 and x.shape[0] == bs and x.dtype in HALF_DTYPES, op, "x must be bf16/fp16 [BS, H]")
        hidden = x.shape[1]
        _require(0 < hidden <= 7168 and hidden % 32 == 0, op, f"H={hidden} must be a multiple of 32 in (0, 7168]")
        world = ep_world_size
        buffer_rows = self._buffer_rows(op, global_bs, bs, world, local, k)

        # The pairs this rank sends, ordered by destination rank, then local expert, then token.
        flat_ids = expert_ids.reshape(-1).long()
        send_order = torch.sort(flat_ids, stable=True).indices  # expert-major; rank = expert // local
        per_expert = torch.bincount(flat_ids, minlength=moe_expert_num)  # [E], this rank's pairs per expert
        payload = x[send_order // k]
        row_scales = torch.ones(payload.shape[0])
        if quant_mode == 2:
            amax = payload.float().abs().amax(dim=-1).clamp(min=1e-12)
            row_scales = amax / 127.0
            payload = torch.round(payload.float() / row_scales.unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
        send_counts = per_expert.view(world, local)  # [dest rank, local expert]
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)  # [source rank, local expert]
        send_splits = send_counts.sum(dim=1).tolist()
        recv_splits = recv_counts.sum(dim=1).tolist()
        received = self._exchange(payload, recv_splits, send_splits)
        received_scales = self._exchange(row_scales.unsqueeze(-1), recv_splits, send_splits).squeeze(-1)

        # Regroup: received rows come by source rank (each by local expert); the output is
        # by local expert, then source rank.
        source_of, expert_of = torch.meshgrid(torch.arange(world), torch.arange(local), indexing="ij")
        block_source = source_of.reshape(-1).repeat_interleave(recv_counts.reshape(-1))
        block_expert = expert_of.reshape(-1).repeat_interleave(recv_counts.reshape(-1))
        regroup = torch.sort(block_expert * world + block_source, stable=True).indices
        total = regroup.shape[0]
        _require(total <= buffer_rows, op, f"received {total} rows, more than A = {buffer_rows}")
        fill: float | int = 0 if quant_mode == 2 else float("nan")
        expand_x = torch.full((buffer_rows, hidden), fill, dtype=payload.dtype)
        expand_x[:total] = received[regroup]
        dynamic_scales = torch.full((buffer_rows,), float("nan"))
        dynamic_scales[:total] = received_scales[regroup]
        expert_token_nums = recv_counts.sum(dim=0).to(torch.int64)
        if expert_token_nums_type == 0:
            expert_token_nums = expert_token_nums.cumsum(0)
        # Opaque to callers (the reference says so); here: where each pair sits in this
        # rank's send order, and the received blocks' prefix sums in output order (A3 layout).
        expand_idx = torch.empty(bs * k, dtype=torch.int32)
        expand_idx[send_order] = torch.arange(bs * k, dtype=torch.int32)
        ep_recv_counts = recv_counts.T.reshape(-1).cumsum(0).to(torch.int32)
        tp_recv_counts = torch.zeros(1, dtype=torch.int32)
        return (
            expand_x,
            dynamic_scales if quant_mode == 2 else None,
            expand_idx,
            expert_token_nums,
            ep_recv_counts,
            tp_recv_counts,
            None,  # expand_scales: only with expert_scales (A2)
        )

    def npu_moe_distribute_combine(
        self,
        expand_x: torch.Tensor,
        expert_ids: torch.Tensor,
        expand_idx: torch.Tensor,
        ep_send_counts: torch.Tensor,
        expert_scales: torch.Tensor,
        group_ep: str,
        ep_world_size: int,
        ep_rank_id: int,
        moe_expert_num: int,
        *,
        tp_send_counts: torch.Tensor | None = None,
        x_active_mask: torch.Tensor | None = None,
        activation_scale: torch.Tensor | None = None,
        weight_scale: torch.Tensor | None = None,
        group_list: torch.Tensor | None = None,
        expand_scales: torch.Tensor | None = None,
        shared_expert_x: torch.Tensor | None = None,
        group_tp: str = "",
        tp_world_size: int = 0,
        tp_rank_id: int = 0,
        expert_shard_type: int = 0,
        shared_expert_num: int = 1,
        shared_expert_rank_num: int = 0,
        global_bs: int = 0,
        out_dtype: int = 0,
        comm_quant_mode: int = 0,
        group_list_type: int = 0,
    ) -> torch.Tensor:
        op = "npu_moe_distribute_combine"
        self._record(op, ep_world_size=ep_world_size, moe_expert_num=moe_expert_num, global_bs=global_bs)
        local = self._ep_checks(
            op,
            group_ep,
            ep_world_size,
            ep_rank_id,
            moe_expert_num,
            expert_ids,
            expert_shard_type=expert_shard_type,
            shared_expert_rank_num=shared_expert_rank_num,
            group_tp=group_tp,
            tp_world_size=tp_world_size,
        )
        reserved = (x_active_mask, activation_scale, weight_scale, group_list, shared_expert_x)
        if any(r is not None for r in reserved) or comm_quant_mode != 0 or expand_scales is not None:
            raise _unsupported(op, "reserved inputs, expand_scales or comm_quant_mode")
        bs, k = expert_ids.shape
        world = ep_world_size
        _require(expand_x.dim() == 2 and expand_x.dtype in HALF_DTYPES, op, "expand_x must be bf16/fp16 [A, H]")
        buffer_rows = self._buffer_rows(op, global_bs, bs, world, local, k)
        _require(expand_x.shape[0] == buffer_rows, op, f"expand_x has {expand_x.shape[0]} rows, A = {buffer_rows}")
        _require(
            tuple(expert_scales.shape) == (bs, k) and expert_scales.dtype == torch.float32,
            op,
            "expert_scales must be float32 [BS, K]",
        )
        idx_ok = expand_idx.dtype == torch.int32 and tuple(expand_idx.shape) == (bs * k,)
        _require(idx_ok, op, "expand_idx must be int32 [BS * K]")
        _require(tuple(ep_send_counts.shape) == (world * local,), op, "ep_send_counts must be [ep_world_size * local]")

        # Undo dispatch's regrouping: rows by (local expert, source) back to source-major.
        block_counts = torch.diff(ep_send_counts.long(), prepend=torch.zeros(1, dtype=torch.int64))
        recv_counts = block_counts.view(local, world).T  # [source rank, local expert]
        total = int(recv_counts.sum())
        source_of, expert_of = torch.meshgrid(torch.arange(world), torch.arange(local), indexing="ij")
        block_source = source_of.reshape(-1).repeat_interleave(recv_counts.reshape(-1))
        block_expert = expert_of.reshape(-1).repeat_interleave(recv_counts.reshape(-1))
        regroup = torch.sort(block_expert * world + block_source, stable=True).indices
        by_source = torch.empty((total, expand_x.shape[1]), dtype=expand_x.dtype)
        by_source[regroup] = expand_x[:total]
        _require(bool(torch.isfinite(by_source).all()), op, "expert outputs hold non-finite values")

        send_counts = torch.bincount(expert_ids.reshape(-1).long(), minlength=moe_expert_num).view(world, local)
        back = self._exchange(by_source, send_counts.sum(dim=1).tolist(), recv_counts.sum(dim=1).tolist())
        per_pair = back[expand_idx.long()].float().view(bs, k, -1)  # back in (token, slot) order
        return (per_pair * expert_scales.unsqueeze(-1)).sum(dim=1).to(expand_x.dtype)

"""Stand-ins for the torch_npu operators the attention backend calls (no NPU here).

``FusedInferAttentionStandIn`` is NOT torch_npu: it is a plain-torch implementation of
``torch_npu.npu_fused_infer_attention_score`` and ``torch_npu.npu_scatter_nd_update_``
written from their documentation (Ascend Extension for PyTorch 7.0.0; Ascend/op-plugin
``docs/context/torch_npu-npu_fused_infer_attention_score.md`` and
``docs/context/torch_npu-npu_scatter_nd_update_.md``). It serves only the argument
combinations the backend uses -- paged BSH (decode and causal prefill) and paged TND
with query_rope/key_rope (MLA) -- and raises NotImplementedError naming anything else.

It validates what the documentation constrains (shapes, layouts, dtypes, block sizes,
sparse modes and masks, cumulative vs per-batch lengths, contiguity), so a mapping
bug fails loudly instead of computing something plausible. Arithmetic is float32.
"""

from __future__ import annotations

import math
from typing import Any

import torch

MAX_INT = 2147483647
HALF_DTYPES = (torch.float16, torch.bfloat16)
MASK_SIZE = 2048

#: Keyword arguments the backend never uses: they must stay at their defaults.
_UNUSED = (
    "pse_shift",
    "dequant_scale1",
    "quant_scale1",
    "dequant_scale2",
    "quant_scale2",
    "quant_offset2",
    "antiquant_scale",
    "antiquant_offset",
    "query_padding_size",
    "kv_padding_size",
    "key_antiquant_scale",
    "key_antiquant_offset",
    "value_antiquant_scale",
    "value_antiquant_offset",
    "key_shared_prefix",
    "value_shared_prefix",
    "actual_shared_prefix_len",
    "key_rope_antiquant_scale",
)


class FusedInferAttentionStandIn:
    """A stand-in for the ``torch_npu`` module: the two operators the attention backend calls.

    ``attention_calls`` records each fused-attention call's keyword arguments (and the query shape)
    so tests can assert how many calls a step makes and with what.
    """

    def __init__(self) -> None:
        self.attention_calls: list[dict[str, Any]] = []

    # ----------------------------------------------------------------------- cache write

    def npu_scatter_nd_update_(self, input: torch.Tensor, indices: torch.Tensor, updates: torch.Tensor) -> torch.Tensor:
        """In place: ``input[indices[i]] = updates[i]``; indices' last dim indexes input's leading dims."""
        if not 1 <= input.dim() <= 8:
            raise ValueError(f"npu_scatter_nd_update_: input must have 1-8 dims, got {input.dim()}")
        if indices.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"npu_scatter_nd_update_: indices must be int32 or int64, got {indices.dtype}")
        if indices.dim() < 2:
            raise ValueError(f"npu_scatter_nd_update_: indices must be at least 2-d, got {tuple(indices.shape)}")
        depth = indices.shape[-1]
        if depth > input.dim():
            raise ValueError(f"npu_scatter_nd_update_: indices' last dim {depth} exceeds input's {input.dim()} dims")
        want = (*indices.shape[:-1], *input.shape[depth:])
        if tuple(updates.shape) != want:
            raise ValueError(
                f"npu_scatter_nd_update_: updates must be {want} for input {tuple(input.shape)} and indices "
                f"{tuple(indices.shape)}, got {tuple(updates.shape)}"
            )
        if updates.dtype != input.dtype:
            raise TypeError(f"npu_scatter_nd_update_: updates are {updates.dtype}, input is {input.dtype}")
        flat = indices.reshape(-1, depth).long()
        bounds = torch.tensor(input.shape[:depth], device=flat.device)
        if len(flat) and ((flat < 0).any() or (flat >= bounds).any()):
            raise IndexError("npu_scatter_nd_update_: indices out of range (the op does not support that)")
        input[tuple(flat.unbind(-1))] = updates.reshape(-1, *input.shape[depth:])
        return input

    # ----------------------------------------------------------------------- fused attention

    def npu_fused_infer_attention_score(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        pse_shift: torch.Tensor | None = None,
        atten_mask: torch.Tensor | None = None,
        actual_seq_lengths: list[int] | None = None,
        actual_seq_lengths_kv: list[int] | None = None,
        dequant_scale1: torch.Tensor | None = None,
        quant_scale1: torch.Tensor | None = None,
        dequant_scale2: torch.Tensor | None = None,
        quant_scale2: torch.Tensor | None = None,
        quant_offset2: torch.Tensor | None = None,
        antiquant_scale: torch.Tensor | None = None,
        antiquant_offset: torch.Tensor | None = None,
        block_table: torch.Tensor | None = None,
        query_padding_size: torch.Tensor | None = None,
        kv_padding_size: torch.Tensor | None = None,
        key_antiquant_scale: torch.Tensor | None = None,
        key_antiquant_offset: torch.Tensor | None = None,
        value_antiquant_scale: torch.Tensor | None = None,
        value_antiquant_offset: torch.Tensor | None = None,
        key_shared_prefix: torch.Tensor | None = None,
        value_shared_prefix: torch.Tensor | None = None,
        actual_shared_prefix_len: list[int] | None = None,
        query_rope: torch.Tensor | None = None,
        key_rope: torch.Tensor | None = None,
        key_rope_antiquant_scale: torch.Tensor | None = None,
        num_heads: int = 1,
        scale: float = 1.0,
        pre_tokens: int = MAX_INT,
        next_tokens: int = MAX_INT,
        input_layout: str = "BSH",
        num_key_value_heads: int = 0,
        sparse_mode: int = 0,
        inner_precise: int = 0,
        block_size: int = 0,
        antiquant_mode: int = 0,
        softmax_lse_flag: bool = False,
        key_antiquant_mode: int = 0,
        value_antiquant_mode: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(attention_out, softmax_lse)``; lse is the documented ``[1]`` zero tensor."""
        # The refusals below are deliberate, not gaps: the backend never passes these
        # arguments, and a stand-in guessing their semantics would let a mapping that
        # started passing them compute something plausible instead of failing here
        # (test_attention.py checks that an unserved argument is refused by name).
        given = locals()
        unused = [name for name in _UNUSED if given[name] is not None]
        if unused:
            raise NotImplementedError(f"stand-in: {unused} (quantisation, pse, padding, prefix) are not served")
        if (antiquant_mode, key_antiquant_mode, value_antiquant_mode) != (0, 0, 0) or softmax_lse_flag:
            raise NotImplementedError("stand-in: antiquant modes and softmax_lse_flag=True are not served")
        if (pre_tokens, next_tokens) != (MAX_INT, MAX_INT):
            raise NotImplementedError("stand-in: pre_tokens/next_tokens (band masks) are not served")
        if inner_precise not in (0, 1):
            raise NotImplementedError(f"stand-in: inner_precise={inner_precise} (row-invalid correction)")
        if block_table is None:
            raise NotImplementedError("stand-in: only the paged (block_table) form is served")
        if input_layout not in ("BSH", "TND"):
            raise NotImplementedError(f"stand-in: input_layout {input_layout!r} (served: BSH, TND)")
        self.attention_calls.append(
            {
                "query_shape": tuple(query.shape),
                "input_layout": input_layout,
                "sparse_mode": sparse_mode,
                "rope": query_rope is not None,
                "actual_seq_lengths": actual_seq_lengths,
                "actual_seq_lengths_kv": actual_seq_lengths_kv,
            }
        )

        # dtypes and contiguity
        if query.dtype not in HALF_DTYPES:
            raise TypeError(f"query must be float16 or bfloat16, got {query.dtype}")
        for name, t in (("key", key), ("value", value)):
            if t.dtype != query.dtype:
                raise TypeError(f"{name} is {t.dtype} but query is {query.dtype} (no quantisation is served)")
        tensors = {"query": query, "key": key, "value": value, "query_rope": query_rope, "key_rope": key_rope}
        for name, t in tensors.items():
            if t is not None and not t.is_contiguous():
                raise ValueError(f"{name}: the op does not take non-contiguous tensors")
        if (query_rope is None) != (key_rope is None):
            raise ValueError("query_rope and key_rope must be given together")
        mla = query_rope is not None

        # heads
        kv_heads = num_key_value_heads or num_heads
        if num_heads < 1 or num_heads % kv_heads:
            raise ValueError(f"num_heads={num_heads} must be a multiple of num_key_value_heads={kv_heads}")
        if num_heads // kv_heads > 64:
            raise ValueError(f"num_heads / num_key_value_heads = {num_heads // kv_heads} exceeds 64")

        # query rows per sequence
        if input_layout == "BSH":
            if query.dim() != 3 or query.shape[2] % num_heads:
                raise ValueError(f"BSH query must be [B, S, num_heads * D], got {tuple(query.shape)}")
            batch, q_s = query.shape[0], query.shape[1]
            head_dim = query.shape[2] // num_heads
            if q_s == 1:  # "Q_S为1时该参数无效" for layouts other than TND
                q_lens = [1] * batch
            else:
                q_lens = _per_batch("actual_seq_lengths", actual_seq_lengths, batch, q_s)
                if any(q > q_s for q in q_lens):
                    raise ValueError(f"actual_seq_lengths {q_lens} exceed the query's S={q_s}")
            q_starts = [b * q_s for b in range(batch)]
            q_rows = query.reshape(batch * q_s, num_heads, head_dim)
        else:  # TND
            if query.dim() != 3 or query.shape[1] != num_heads:
                raise ValueError(f"TND query must be [T, num_heads={num_heads}, D], got {tuple(query.shape)}")
            if actual_seq_lengths is None or actual_seq_lengths_kv is None:
                raise ValueError("TND needs both actual_seq_lengths and actual_seq_lengths_kv")
            cumulative = [int(x) for x in actual_seq_lengths]
            if any(b < a for a, b in zip([0, *cumulative], cumulative, strict=False)) or cumulative[0] < 0:
                raise ValueError(f"TND actual_seq_lengths must be cumulative (non-decreasing), got {cumulative}")
            if cumulative[-1] != query.shape[0]:
                raise ValueError(f"TND actual_seq_lengths end at {cumulative[-1]}, the query has T={query.shape[0]}")
            batch = len(cumulative)
            q_starts = [0, *cumulative[:-1]]
            q_lens = [b - a for a, b in zip(q_starts, cumulative, strict=True)]
            q_s = max(q_lens)
            head_dim = query.shape[2]
            q_rows = query

        # paged keys
        if block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.shape[0] != batch:
            raise ValueError(
                f"block_table must be int32 [B={batch}, max_blocks], got {block_table.dtype} {tuple(block_table.shape)}"
            )
        if key.dim() != 3 or tuple(key.shape) != tuple(value.shape):
            raise ValueError(
                f"paged key/value must both be [blocknum, blocksize, H], got {tuple(key.shape)}, {tuple(value.shape)}"
            )
        if key.shape[1] != block_size:
            raise ValueError(f"key blocks hold {key.shape[1]} tokens but block_size={block_size}")
        if actual_seq_lengths_kv is None:
            raise ValueError("page attention needs actual_seq_lengths_kv")
        kv_lens = _per_batch("actual_seq_lengths_kv", actual_seq_lengths_kv, batch, None)
        needed = max(math.ceil(n / block_size) for n in kv_lens)
        if block_table.shape[1] < needed:
            raise ValueError(f"block_table has {block_table.shape[1]} columns, the longest sequence needs {needed}")

        if mla:
            self._check_mla(query, query_rope, key, key_rope, num_heads, kv_heads, q_lens, input_layout, block_size)
        else:
            if key.shape[2] != kv_heads * head_dim:
                raise ValueError(f"key H={key.shape[2]} is not num_key_value_heads * D = {kv_heads} * {head_dim}")
            if q_s > 1:
                if block_size not in (128, 256, 384, 512):
                    raise ValueError(
                        f"paged prompt attention needs block_size a multiple of 128 in [128, 512], got {block_size}"
                    )
                if head_dim % 16:
                    raise ValueError(f"D={head_dim} must be 16-aligned for float16/bfloat16 prompts")
            elif block_size % 16:
                raise ValueError(f"paged decode needs block_size 16-aligned, got {block_size}")

        # masks
        causal = False
        if q_s > 1:
            if sparse_mode == 3:
                _check_causal_mask(atten_mask)
                causal = True
            elif sparse_mode != 0 or atten_mask is not None:
                # Only 0 (no mask) and 3 (rightDownCausal) are mapped to; others refused, as above.
                raise NotImplementedError(f"stand-in: sparse_mode={sparse_mode} with mask={atten_mask is not None}")
            if mla and not causal:
                raise ValueError("the rope (MLA) path with Q_S > 1 takes only sparse_mode=3 with the mask")
        elif mla and (sparse_mode != 0 or atten_mask is not None):
            raise ValueError("the rope (MLA) path with Q_S = 1 takes only sparse_mode=0 without a mask")
        elif atten_mask is not None:
            raise NotImplementedError("stand-in: a mask with Q_S = 1")
        if causal and any(q > kv for q, kv in zip(q_lens, kv_lens, strict=True)):
            raise ValueError(f"rightDownCausal needs query lengths {q_lens} <= kv lengths {kv_lens}")

        # compute
        value_dim = value.shape[2] // kv_heads
        out_rows = torch.zeros((q_rows.shape[0], num_heads, value_dim), dtype=torch.float32, device=query.device)
        rope_rows = None if query_rope is None else query_rope.reshape(-1, num_heads, query_rope.shape[-1])
        for b in range(batch):
            q_len, kv_len, start = q_lens[b], kv_lens[b], q_starts[b]
            blocks = block_table[b, : math.ceil(kv_len / block_size)].long()
            k = key[blocks].reshape(-1, kv_heads, key.shape[2] // kv_heads)[:kv_len].float()
            v = value[blocks].reshape(-1, kv_heads, value_dim)[:kv_len].float()
            q = q_rows[start : start + q_len].float()
            scores = _scores(q, k, kv_heads)
            if rope_rows is not None:
                k_rope = key_rope[blocks].reshape(-1, 1, key_rope.shape[-1])[:kv_len].float()
                scores = scores + _scores(rope_rows[start : start + q_len].float(), k_rope, kv_heads)
            scores = scores * scale
            if causal:  # row i sees keys up to i + (kv_len - q_len): the diagonal ends bottom-right
                visible = torch.arange(kv_len)[None, :] <= torch.arange(q_len)[:, None] + (kv_len - q_len)
                scores = scores.masked_fill(~visible.to(scores.device), float("-inf"))
            probs = torch.softmax(scores, dim=-1)  # [kv_heads, group, q_len, kv_len]
            group = num_heads // kv_heads
            out = probs @ v.permute(1, 0, 2).unsqueeze(1)  # [kv_heads, group, q_len, dv]
            out_rows[start : start + q_len] = out.permute(2, 0, 1, 3).reshape(q_len, kv_heads * group, value_dim)
        out = out_rows.to(query.dtype)
        if input_layout == "BSH":
            out = out.reshape(batch, q_s, num_heads * value_dim)
        return out, torch.zeros(1, dtype=torch.float32, device=query.device)

    @staticmethod
    def _check_mla(
        query: torch.Tensor,
        query_rope: torch.Tensor,
        key: torch.Tensor,
        key_rope: torch.Tensor,
        num_heads: int,
        kv_heads: int,
        q_lens: list[int],
        input_layout: str,
        block_size: int,
    ) -> None:
        """The documented rope-path (query d = 512) constraints."""
        if query_rope.dtype != query.dtype or key_rope.dtype != key.dtype:
            raise TypeError("query_rope/key_rope must have the dtypes of query/key")
        if input_layout != "TND":
            raise NotImplementedError(f"stand-in: the rope path is served in TND, got {input_layout}")
        if query.shape[-1] != 512:
            raise NotImplementedError(f"stand-in: the rope path with query d={query.shape[-1]} (served: 512)")
        if num_heads not in (32, 64, 128):
            raise ValueError(f"the rope path with d=512 takes 32, 64 or 128 query heads, got {num_heads}")
        if kv_heads != 1 or key.shape[2] != 512:
            raise ValueError(f"the rope path needs key n=1, d=512; got {kv_heads} heads, H={key.shape[2]}")
        if tuple(query_rope.shape) != (*query.shape[:-1], 64):
            raise ValueError(f"query_rope must be {(*query.shape[:-1], 64)}, got {tuple(query_rope.shape)}")
        if tuple(key_rope.shape) != (*key.shape[:-1], 64):
            raise ValueError(f"key_rope must be {(*key.shape[:-1], 64)}, got {tuple(key_rope.shape)}")
        if block_size not in (16, 128):
            raise ValueError(f"the rope path takes block_size 16 or 128, got {block_size}")
        if any(not 1 <= q <= 16 for q in q_lens):
            raise ValueError(f"the rope path takes 1..16 query tokens per sequence, got {q_lens}")


def _per_batch(name: str, values: list[int] | None, batch: int, default: int | None) -> list[int]:
    """Length 1: every batch uses it; length >= B: the first B are used (as documented)."""
    if values is None:
        if default is None:
            raise ValueError(f"{name} is required here")
        return [default] * batch
    values = [int(v) for v in values]
    if any(v < 0 for v in values):
        raise ValueError(f"{name} {values} has negative lengths")
    if len(values) == 1:
        return values * batch
    if len(values) < batch:
        raise ValueError(f"{name} has {len(values)} entries for {batch} batches (length 1 or >= B only)")
    return values[:batch]


def _check_causal_mask(mask: torch.Tensor | None) -> None:
    if mask is None:
        raise ValueError("sparse_mode=3 needs atten_mask")
    if tuple(mask.shape) not in ((MASK_SIZE, MASK_SIZE), (1, MASK_SIZE, MASK_SIZE), (1, 1, MASK_SIZE, MASK_SIZE)):
        raise ValueError(f"sparse_mode=3 needs the 2048x2048 optimised mask, got shape {tuple(mask.shape)}")
    if mask.dtype not in (torch.bool, torch.int8, torch.uint8):
        raise TypeError(f"atten_mask must be bool, int8 or uint8, got {mask.dtype}")
    expected = torch.triu(torch.ones((MASK_SIZE, MASK_SIZE), dtype=torch.bool, device=mask.device), diagonal=1)
    if not torch.equal(mask.reshape(MASK_SIZE, MASK_SIZE).bool(), expected):
        raise ValueError("atten_mask must be lower-triangular: 1 (masked) above the diagonal, 0 on and below")


def _scores(q: torch.Tensor, k: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``q`` [q_len, heads, d], ``k`` [kv_len, kv_heads, d] -> [kv_heads, group, q_len, kv_len]."""
    q_len, heads, dim = q.shape
    grouped = q.reshape(q_len, kv_heads, heads // kv_heads, dim).permute(1, 2, 0, 3)
    return grouped @ k.permute(1, 2, 0).unsqueeze(1)

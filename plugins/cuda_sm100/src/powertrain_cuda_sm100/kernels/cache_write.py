"""Rotary embedding fused with the paged KV-cache write.

One pass per (token, head): a query head is rotated into a fresh query tensor; a key
head is rotated and written, with its value head, straight to the token's cache slot.
Unfused, the rotation reads and writes query and key once more and the cache store
reads the keys again. Without cos/sin the same kernel is the plain cache store.

Rotation as ``powertrain.layers.rotary.apply_rotary``: the first ``half`` dims pair
with the next ``half`` (``x1 * cos - x2 * sin``, ``x2 * cos + x1 * sin``) and dims
past ``2 * half`` pass through; the products are taken in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate(row, cos_row, sin_row, HALF: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_SIZE: tl.constexpr):
    """One head ``row`` (pointer to its first element) rotated, as float32 [BLOCK_D]."""
    d = tl.arange(0, BLOCK_D)
    inside = d < HEAD_SIZE
    x = tl.load(row + d, mask=inside, other=0.0).to(tl.float32)
    if HALF > 0:
        first = d < HALF
        rotated = d < 2 * HALF
        partner = tl.where(first, d + HALF, d - HALF)
        angle = tl.where(first, d, d - HALF)
        other = tl.load(row + partner, mask=rotated, other=0.0).to(tl.float32)
        cos = tl.load(cos_row + angle, mask=rotated, other=1.0).to(tl.float32)
        sin = tl.load(sin_row + angle, mask=rotated, other=0.0).to(tl.float32)
        signed = tl.where(first, -other, other)
        x = tl.where(rotated, x * cos + signed * sin, x)
    return x


@triton.jit
def rotary_cache_write_kernel(
    query,  # [tokens, heads, head_size] (row and head strides given; dims contiguous)
    key,  # [tokens, kv_heads, head_size]
    value,
    query_out,  # [tokens, heads, head_size], contiguous
    key_cache,  # [slots, kv_heads, head_size]: the block-token-major cache, a slot per row
    value_cache,
    slot_mapping,  # int64 [cache_tokens]; -1 = padding, not written
    cos,  # [tokens, HALF] (contiguous)
    sin,
    cache_tokens,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HALF: tl.constexpr,  # rotary_dim // 2; 0 = no rotation
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    inside = d < HEAD_SIZE
    cos_row = cos + token * HALF
    sin_row = sin + token * HALF
    if head < NUM_HEADS:
        q = _rotate(query + token * stride_qt + head * stride_qh, cos_row, sin_row, HALF, BLOCK_D, HEAD_SIZE)
        out = query_out + (token * NUM_HEADS + head) * HEAD_SIZE + d
        tl.store(out, q.to(query_out.dtype.element_ty), mask=inside)
    else:
        kv_head = head - NUM_HEADS
        slot = tl.load(slot_mapping + token, mask=token < cache_tokens, other=-1)
        if slot >= 0:
            k = _rotate(key + token * stride_kt + kv_head * stride_kh, cos_row, sin_row, HALF, BLOCK_D, HEAD_SIZE)
            v = tl.load(value + token * stride_vt + kv_head * stride_vh + d, mask=inside)
            where = (slot * NUM_KV_HEADS + kv_head) * HEAD_SIZE + d
            tl.store(key_cache + where, k.to(key_cache.dtype.element_ty), mask=inside)
            tl.store(value_cache + where, v.to(value_cache.dtype.element_ty), mask=inside)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """A [tokens, heads, dim] tensor whose last dim is contiguous (views of a fused qkv are)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def rotary_cache_write(
    query: torch.Tensor | None,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,  # [blocks, block_size, kv_heads, head_size]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    cos: torch.Tensor | None = None,  # [tokens, rotary_dim // 2]
    sin: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Write (rotated) key and value to their slots; return the (rotated) query, contiguous
    (None without a query: then this is only the cache store, with no host sync).

    Shapes are not checked here: ``TritonAttention.forward_rotary`` checks them once per
    call (``attention._check_cache_write``) before it gets here."""
    tokens, kv_heads, head_size = key.shape
    heads = 0 if query is None else query.shape[1]
    key, value = _rows(key), _rows(value)
    half = 0 if cos is None else cos.shape[-1]
    if half:
        cos, sin = cos.contiguous(), sin.contiguous()
    else:
        cos = sin = key  # unread
    if query is None:
        query = query_out = key  # unread: no program serves a query head
    else:
        query = _rows(query)
        query_out = torch.empty((tokens, heads, head_size), dtype=query.dtype, device=query.device)
    if tokens:
        rotary_cache_write_kernel[(tokens, heads + kv_heads)](
            query,
            key,
            value,
            query_out,
            key_cache,
            value_cache,
            slot_mapping,
            cos,
            sin,
            slot_mapping.shape[0],
            query.stride(0),
            query.stride(1),
            key.stride(0),
            key.stride(1),
            value.stride(0),
            value.stride(1),
            NUM_HEADS=heads,
            NUM_KV_HEADS=kv_heads,
            HEAD_SIZE=head_size,
            HALF=half,
            BLOCK_D=triton.next_power_of_2(head_size),
        )
    return None if heads == 0 else query_out


def aot_specs(capability: tuple[int, int]) -> list[dict]:
    """How the launcher compiles this kernel for a bf16 Llama-style layer (head_size 128)."""
    del capability  # one config: the kernel is a memory copy with a few flops
    pointers = {name: "*bf16" for name in ("query", "key", "value", "query_out", "key_cache", "value_cache")}
    signature = {
        **pointers,
        "slot_mapping": "*i64",
        "cos": "*bf16",
        "sin": "*bf16",
        **{name: "i32" for name in ("cache_tokens", "stride_qt", "stride_qh", "stride_kt", "stride_kh")},
        "stride_vt": "i32",
        "stride_vh": "i32",
        **{name: "constexpr" for name in ("NUM_HEADS", "NUM_KV_HEADS", "HEAD_SIZE", "HALF", "BLOCK_D")},
    }
    constexprs = {"NUM_HEADS": 32, "NUM_KV_HEADS": 8, "HEAD_SIZE": 128, "HALF": 64, "BLOCK_D": 128}
    return [
        {
            "name": "rotary_cache_write",
            "fn": rotary_cache_write_kernel,
            "signature": signature,
            "constexprs": constexprs,
            "options": {"num_warps": 1, "num_stages": 1},
        }
    ]

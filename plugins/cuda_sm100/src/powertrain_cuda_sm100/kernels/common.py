"""Pieces every attention kernel shares: the dot wrapper, padding, and machine size.

``mma`` exists because of one interpreter quirk (see ``support.interpreting``): the
Triton interpreter multiplies bf16/fp16 operands wrongly, so under it every dot is
taken in float32. Compiled kernels multiply in the operands' own dtype (tensor
cores); float32 operands use 3xTF32, which keeps float32 accuracy on tensor cores
(plain TF32 would miss the float32 tolerance of the conformance kit).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from powertrain_cuda_sm100 import support

#: ``tl.dot`` needs every dimension to be at least this.
MIN_DOT = 16

#: Under the interpreter there is no GPU to fill; pretending to have a few SMs makes
#: the split-KV paths run (and be tested) on the small batches of the test suites.
INTERPRETER_SM_COUNT = 8


@triton.jit
def mma(a, b, acc, DOT_F32: tl.constexpr):
    """``acc + a @ b`` accumulated in float32."""
    if DOT_F32:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision="tf32x3")


@triton.jit
def paged_kv_tile(
    table,  # the sequence's row of the block table
    key_cache_ptr,
    value_cache_ptr,
    tile,
    end,
    kv_head,
    dims,
    dim_ok,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Keys ``tile .. tile + BLOCK_N`` of one sequence (those before ``end``), gathered
    from the block-token-major cache through its block table: ``(keys, key_ok, k, v)``."""
    keys = tile + tl.arange(0, BLOCK_N)
    key_ok = keys < end
    block = tl.load(table + keys // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
    offset = keys % BLOCK_SIZE
    kv_mask = key_ok[:, None] & dim_ok[None, :]
    k_rows = key_cache_ptr + block * stride_kb + offset * stride_kt + kv_head * stride_kh
    v_rows = value_cache_ptr + block * stride_vb + offset * stride_vt + kv_head * stride_vh
    k = tl.load(k_rows[:, None] + dims[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_rows[:, None] + dims[None, :], mask=kv_mask, other=0.0)
    return keys, key_ok, k, v


@triton.jit
def paged_rows(base, table, index, ok, PER_BLOCK: tl.constexpr, stride_b, stride_t, dims, dim_ok):
    """Rows ``index`` (masked by ``ok``) of a paged tensor ``[blocks, PER_BLOCK, dim]`` read
    through one sequence's block-table row ``table``; masked rows are zeros."""
    index = tl.where(ok, index, 0)
    block = tl.load(table + index // PER_BLOCK, mask=ok, other=0).to(tl.int64)
    rows = base + block * stride_b + (index % PER_BLOCK) * stride_t
    return tl.load(rows[:, None] + dims[None, :], mask=ok[:, None] & dim_ok[None, :], other=0.0)


def padded(n: int) -> int:
    """``n`` rounded up to a power of two that ``tl.dot`` accepts (masks cover the rest)."""
    return max(MIN_DOT, triton.next_power_of_2(n))


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors to fill: the GPU's, or a small number under the interpreter."""
    if device.type == "cuda" and not support.interpreting():
        return torch.cuda.get_device_properties(device).multi_processor_count
    return INTERPRETER_SM_COUNT


def choose_num_splits(programs: int, span: int, sms: int, min_split: int, max_splits: int = 32) -> int:
    """How many KV splits give about two waves of programs over ``sms`` without making
    a split shorter than ``min_split`` tokens of the longest ``span`` (in keys).

    Large batches already fill the GPU with one split per sequence; a few long
    sequences need splitting, or most SMs idle while one program walks the context.
    """
    if programs <= 0 or span <= min_split:
        return 1
    wanted = triton.cdiv(2 * sms, programs)
    return max(1, min(wanted, triton.cdiv(span, min_split), max_splits))


def dtype_name(dtype: torch.dtype) -> str:
    """Triton's signature name of a tensor dtype, for ahead-of-time specs."""
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]


def divisibility_attrs(fn: triton.JITFunction, signature: dict[str, str], aligned: tuple[str, ...] = ()) -> dict:
    """``ASTSource`` attrs saying that every pointer and the ``aligned`` ints are multiples
    of 16, as a runtime launch's specialisation finds them at real model widths (an
    ahead-of-time source knows only what its attrs say). Without them the compiler
    cannot prove 16-byte alignment, issues no ``cp.async`` and does not pipeline K loops."""
    return {
        (i,): [["tt.divisibility", 16]]
        for i, arg in enumerate(fn.arg_names)
        if signature[arg].startswith("*") or arg in aligned
    }


def fp32_suffix(element_size: int) -> str:
    """An AOT spec name's mark for its float32 variant."""
    return "_fp32" if element_size == 4 else ""


def typed(types: dict[str, str], element_size: int) -> dict[str, str]:
    """An AOT signature's bf16 tensors as float32 where ``element_size`` is 4."""
    return {arg: "*fp32" if kind == "*bf16" and element_size == 4 else kind for arg, kind in types.items()}


def aot_spec(name: str, fn: triton.JITFunction, types: dict[str, str], constexprs: dict, options: dict) -> dict:
    """One ahead-of-time compile spec: the signature in ``fn``'s parameter order, every
    constexpr marked as such (a parameter missing from both raises KeyError), and
    pointers marked 16-byte aligned as a launch finds the engine's tensors."""
    signature = {arg: "constexpr" if arg in constexprs else types[arg] for arg in fn.arg_names}
    return {
        "name": name,
        "fn": fn,
        "signature": signature,
        "constexprs": dict(constexprs),
        "options": dict(options),
        "attrs": divisibility_attrs(fn, signature),
    }

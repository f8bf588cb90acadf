"""What the kernel-pack benchmarks share: shapes, the check against a torch peer, the
achieved-versus-peak arithmetic, and one row per kernel.

``kernels_gpu.py`` (Triton, NVIDIA) and ``kernels_npu.py`` (torch_npu, Ascend) differ
only in which backends they build and how they time (``Bench.timer``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

import attrs
import torch

from powertrain.interfaces import (
    AttentionLayerSpec,
    AttentionMetadata,
    ExpertWeights,
)
from powertrain.layers.indexer import index_scores
from powertrain.layers.norm import RMSNorm
from powertrain.layers.paged import read_entries
from powertrain.layers.rotary import apply_rotary
from powertrain.loader.fp4 import dequantize_fp4
from powertrain.loader.fp8 import dequantize_blocks, quantize_blocks
from powertrain.testing.attention import read_tokens, write_tokens
from powertrain.testing.checkpoints import quantize_fp4
from powertrain.testing.moe import row_errors


@attrs.frozen
class Shapes:
    batch: int  # decode sequences
    context: int  # decode context length
    heads: int
    kv_heads: int
    head_size: int
    prefill_seqs: int
    prefill_new: int  # new tokens per prefill sequence (after as many cached)
    mla_heads: int
    kv_lora_rank: int
    rope: int
    tokens: int  # MoE tokens, norm rows, rotary tokens
    experts: int
    top_k: int
    hidden: int
    intermediate: int
    block_size: int = 16
    sparse_context: int = 8192  # V3.2 sparse MLA decode: context, and positions listed per token
    topk: int = 2048
    # DeepSeek-V4-Flash attention decode over sparse_context: heads of one shared K=V head,
    # the sliding window, CSA's rate and indexer top-k, HCA's rate; blocks of v4_block tokens.
    v4_heads: int = 64
    v4_head: int = 512
    v4_window: int = 128
    v4_csa_rate: int = 4
    v4_topk: int = 512
    v4_hca_rate: int = 128
    v4_block: int = 128
    # The Lightning Indexer over sparse_context per-token keys (V3.2): heads of index_dim.
    index_heads: int = 64
    index_dim: int = 128


FULL = Shapes(
    batch=64, context=4096, heads=32, kv_heads=8, head_size=128, prefill_seqs=4, prefill_new=2048,
    mla_heads=128, kv_lora_rank=512, rope=64, tokens=4096, experts=64, top_k=8, hidden=7168, intermediate=2048,
)  # fmt: skip
SMOKE = Shapes(
    batch=3, context=40, heads=4, kv_heads=2, head_size=32, prefill_seqs=2, prefill_new=20,
    mla_heads=2, kv_lora_rank=32, rope=16, tokens=6, experts=4, top_k=2, hidden=128, intermediate=128, block_size=4,
    sparse_context=40, topk=12, v4_heads=4, v4_head=32, v4_window=6, v4_csa_rate=4, v4_topk=5, v4_hca_rate=8,
    v4_block=8, index_heads=4, index_dim=32,
)  # fmt: skip


@attrs.frozen
class Row:
    kernel: str
    shape: str
    check: str  # "ok (max err ...)" or "FAIL ..."
    ms: float | None = None
    achieved: str = ""
    fraction: float | None = None
    peer_ms: float | None = None


class Bench:
    """Random inputs on ``device`` and timing through ``timer`` (fn -> median ms); a smoke
    run (tiny shapes, no accelerator) calls each function once and times nothing."""

    def __init__(self, device: torch.device, smoke: bool, timer: Callable[[Callable[[], Any]], float] | None) -> None:
        self.device, self.smoke, self.timer = device, smoke, timer
        self.gen = torch.Generator(device="cpu").manual_seed(int.from_bytes(os.urandom(4), "little"))

    def randn(self, *shape: int, dtype: torch.dtype = torch.bfloat16, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(shape, generator=self.gen) * scale).to(dtype=dtype, device=self.device)

    def time_ms(self, fn: Callable[[], Any]) -> float | None:
        if self.smoke or self.timer is None:
            fn()
            return None
        return float(self.timer(fn))

    # ------------------------------------------------------------------ device peaks

    def copy_bandwidth(self) -> float:
        """Bytes per second of a 1 GiB device-to-device copy (read + write)."""
        x = torch.empty(2**29, dtype=torch.bfloat16, device=self.device)
        y = torch.empty_like(x)
        ms = self.time_ms(lambda: y.copy_(x))
        return 2 * x.numel() * x.element_size() / (ms * 1e-3)

    def matmul_peak(self, fp8: bool) -> float:
        """FLOP/s of an 8192^3 matmul through torch (the vendor BLAS): bf16, or FP8 e4m3 with scales."""
        n = 8192
        a, b = self.randn(n, n), self.randn(n, n)
        if not fp8:
            ms = self.time_ms(lambda: a @ b)
        else:
            a8, b8 = a.to(torch.float8_e4m3fn), b.t().contiguous().to(torch.float8_e4m3fn).t()
            one = torch.ones((), device=self.device)
            ms = self.time_ms(lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
        return 2 * n**3 / (ms * 1e-3)


def _paged(bench: Bench, lengths: list[tuple[int, int]], block_size: int) -> AttentionMetadata:
    """Metadata for (cached, new) per sequence, blocks handed out in a shuffled order."""
    needed = [math.ceil((c + q) / block_size) for c, q in lengths]
    pool = torch.randperm(sum(needed), generator=bench.gen).tolist()
    tables, used = [], 0
    for count in needed:
        tables.append(pool[used : used + count])
        used += count
    return AttentionMetadata.build(
        query_lens=[q for _, q in lengths],
        seq_lens=[c + q for c, q in lengths],
        block_tables=tables,
        block_size=block_size,
        device=bench.device,
    )


def _caches(bench: Bench, ours: Any, peer: Any, layer: AttentionLayerSpec, block_size: int, num_blocks: int) -> tuple:
    """A random cache in our backend's layout and the same tokens in the peer's (the
    layouts may differ: each backend declares its own through its KVCacheSpec)."""
    spec, peer_spec = (b.kv_cache_spec(layer, block_size, torch.bfloat16) for b in (ours, peer))
    cache = {name: bench.randn(*t.shape) for name, t in spec.allocate(num_blocks, "meta").items()}
    peer_cache = {
        name: torch.empty_like(t, device=bench.device) for name, t in peer_spec.allocate(num_blocks, "meta").items()
    }
    slots = torch.arange(num_blocks * block_size, device=bench.device)
    for name in cache:
        write_tokens(peer_spec, peer_cache, name, slots, read_tokens(spec, cache, name, slots))
    return cache, peer_cache


def _check(got: torch.Tensor, want: torch.Tensor, limit: float) -> str:
    err = float(row_errors(got.double().cpu().flatten(1), want.double().cpu().flatten(1)).max())
    return f"ok (row err {err:.1e})" if err <= limit else f"FAIL (row err {err:.1e} > {limit})"


def bench_gqa(bench: Bench, shapes: Shapes, ours: Any, peer: Any, decode: bool, bandwidth: float, peak: float) -> Row:
    s = shapes
    layer = AttentionLayerSpec(
        kind="gqa", num_heads=s.heads, num_kv_heads=s.kv_heads, head_size=s.head_size, scale=s.head_size**-0.5
    )
    lengths = [(s.context - 1, 1)] * s.batch if decode else [(s.prefill_new, s.prefill_new)] * s.prefill_seqs
    meta = _paged(bench, lengths, s.block_size)
    num_blocks = int(meta.block_tables.max()) + 1
    cache, peer_cache = _caches(bench, ours, peer, layer, s.block_size, num_blocks)
    tokens = meta.num_tokens
    q, k, v = bench.randn(tokens, s.heads, s.head_size), *(bench.randn(tokens, s.kv_heads, s.head_size) for _ in "kv")
    got = ours.forward(layer, q, k, v, cache, meta)
    want = peer.forward(layer, q, k, v, peer_cache, meta)
    ms = bench.time_ms(lambda: ours.forward(layer, q, k, v, cache, meta))
    peer_ms = bench.time_ms(lambda: peer.forward(layer, q, k, v, peer_cache, meta))
    if decode:
        moved = s.batch * s.context * s.kv_heads * s.head_size * 2 * 2 + 2 * q.numel() * 2
        achieved = None if ms is None else moved / (ms * 1e-3)
        shown = "" if achieved is None else f"{achieved / 1e9:.0f} GB/s"
        fraction = None if achieved is None else achieved / bandwidth
    else:
        # Causal scores over (cached + new) keys: new * (cached + (new + 1) / 2) pairs, QK and PV.
        pairs = s.prefill_seqs * s.prefill_new * (s.prefill_new + (s.prefill_new + 1) / 2)
        flops = 4 * pairs * s.heads * s.head_size
        achieved = None if ms is None else flops / (ms * 1e-3)
        shown = "" if achieved is None else f"{achieved / 1e12:.1f} TFLOP/s"
        fraction = None if achieved is None else achieved / peak
    name = "gqa decode" if decode else "gqa chunked prefill"
    where = f"{len(lengths)} seqs x {lengths[0]}, {s.heads}/{s.kv_heads} heads x {s.head_size}, bf16"
    return Row(name, where, _check(got, want, 2e-2), ms, shown, fraction, peer_ms)


def _mla_layer(s: Shapes) -> AttentionLayerSpec:
    width = s.kv_lora_rank + s.rope
    return AttentionLayerSpec(
        kind="mla", num_heads=s.mla_heads, num_kv_heads=1, head_size=width, scale=width**-0.5,
        kv_lora_rank=s.kv_lora_rank, qk_rope_head_dim=s.rope,
    )  # fmt: skip


def bench_mla(bench: Bench, shapes: Shapes, ours: Any, peer: Any, bandwidth: float) -> Row:
    s = shapes
    width = s.kv_lora_rank + s.rope
    layer = _mla_layer(s)
    meta = _paged(bench, [(s.context - 1, 1)] * s.batch, s.block_size)
    num_blocks = int(meta.block_tables.max()) + 1
    cache, peer_cache = _caches(bench, ours, peer, layer, s.block_size, num_blocks)
    args = (
        bench.randn(s.batch, s.mla_heads, s.kv_lora_rank),
        bench.randn(s.batch, s.mla_heads, s.rope),
        bench.randn(s.batch, s.kv_lora_rank),
        bench.randn(s.batch, s.rope),
    )
    got = ours.forward_mla(layer, *args, cache, meta)
    want = peer.forward_mla(layer, *args, peer_cache, meta)
    ms = bench.time_ms(lambda: ours.forward_mla(layer, *args, cache, meta))
    peer_ms = bench.time_ms(lambda: peer.forward_mla(layer, *args, peer_cache, meta))
    moved = s.batch * s.context * width * 2
    achieved = None if ms is None else moved / (ms * 1e-3)
    return Row(
        "mla decode (absorbed)",
        f"{s.batch} seqs x {s.context}, {s.mla_heads} heads, latent {s.kv_lora_rank}+{s.rope}, bf16",
        _check(got, want, 2e-2),
        ms,
        "" if achieved is None else f"{achieved / 1e9:.0f} GB/s",
        None if achieved is None else achieved / bandwidth,
        peer_ms,
    )


def bench_sparse_mla(bench: Bench, shapes: Shapes, ours: Any, peer: Any, bandwidth: float) -> Row:
    """DeepSeek-V3.2 decode: each token attends to ``topk`` distinct random positions of its
    context (what the indexer would pick); the bytes are the listed latent/rope rows."""
    s = shapes
    width = s.kv_lora_rank + s.rope
    layer = _mla_layer(s)
    meta = _paged(bench, [(s.sparse_context - 1, 1)] * s.batch, s.block_size)
    num_blocks = int(meta.block_tables.max()) + 1
    cache, peer_cache = _caches(bench, ours, peer, layer, s.block_size, num_blocks)
    indices = torch.stack([torch.randperm(s.sparse_context, generator=bench.gen)[: s.topk] for _ in range(s.batch)]).to(
        device=bench.device, dtype=torch.int32
    )
    args = (
        bench.randn(s.batch, s.mla_heads, s.kv_lora_rank),
        bench.randn(s.batch, s.mla_heads, s.rope),
        bench.randn(s.batch, s.kv_lora_rank),
        bench.randn(s.batch, s.rope),
    )
    got = ours.forward_mla_sparse(layer, *args, cache, meta, indices)
    want = peer.forward_mla_sparse(layer, *args, peer_cache, meta, indices)
    ms = bench.time_ms(lambda: ours.forward_mla_sparse(layer, *args, cache, meta, indices))
    peer_ms = bench.time_ms(lambda: peer.forward_mla_sparse(layer, *args, peer_cache, meta, indices))
    moved = s.batch * s.topk * width * 2
    achieved = None if ms is None else moved / (ms * 1e-3)
    return Row(
        "sparse mla decode (V3.2)",
        f"{s.batch} seqs x top-{s.topk} of {s.sparse_context}, {s.mla_heads} heads, "
        f"latent {s.kv_lora_rank}+{s.rope}, bf16",
        _check(got, want, 2e-2),
        ms,
        "" if achieved is None else f"{achieved / 1e9:.0f} GB/s",
        None if achieved is None else achieved / bandwidth,
        peer_ms,
    )


def bench_v4_attention(bench: Bench, shapes: Shapes, ours: Any, peer: Any, bandwidth: float, csa: bool) -> Row:
    """DeepSeek-V4 decode: each token over its window of raw keys and its compressed entries
    (CSA: ``v4_topk`` random ones, what the indexer would pick; HCA: every closed one), with
    sinks; the bytes are the keys read, each once (shared by the heads)."""
    s = shapes
    rate = s.v4_csa_rate if csa else s.v4_hca_rate
    layer = AttentionLayerSpec(
        kind="custom", num_heads=s.v4_heads, num_kv_heads=1, head_size=s.v4_head, scale=s.v4_head**-0.5
    )
    blocks = math.ceil(s.sparse_context / s.v4_block)
    tables = torch.randperm(s.batch * blocks, generator=bench.gen).view(s.batch, blocks).tolist()
    lengths = dict(query_lens=[1] * s.batch, seq_lens=[s.sparse_context] * s.batch, block_size=s.v4_block)
    meta = AttentionMetadata.build(**lengths, block_tables={s.v4_window: tables, None: tables}, device=bench.device)
    cache = {
        "kv": bench.randn(s.batch * blocks, s.v4_block, s.v4_head),
        "compressed": bench.randn(s.batch * blocks, s.v4_block // rate, s.v4_head),
    }
    entries = s.sparse_context // rate
    indices = None
    if csa:
        picks = [torch.randperm(entries, generator=bench.gen)[: s.v4_topk] for _ in range(s.batch)]
        indices = torch.stack(picks).to(device=bench.device, dtype=torch.int32)
    query, sinks = bench.randn(s.batch, s.v4_heads, s.v4_head), bench.randn(s.v4_heads, dtype=torch.float32)
    options = dict(window=s.v4_window, compress_rate=rate, entry_indices=indices)
    got = ours.forward_v4(layer, query, cache, meta, sinks, **options)
    want = peer.forward_v4(layer, query, cache, meta, sinks, **options)
    ms = bench.time_ms(lambda: ours.forward_v4(layer, query, cache, meta, sinks, **options))
    peer_ms = bench.time_ms(lambda: peer.forward_v4(layer, query, cache, meta, sinks, **options))
    read = min(s.v4_window, s.sparse_context) + (min(s.v4_topk, entries) if csa else entries)
    moved = s.batch * read * s.v4_head * 2
    achieved = None if ms is None else moved / (ms * 1e-3)
    picked = f"top-{s.v4_topk} of {entries} entries" if csa else f"all {entries} entries"
    return Row(
        f"v4 {'csa' if csa else 'hca'} attention decode",
        f"{s.batch} seqs x ctx {s.sparse_context}: window {s.v4_window} + {picked}, "
        f"{s.v4_heads} heads of {s.v4_head}, bf16",
        _check(got, want, 2e-2),
        ms,
        "" if achieved is None else f"{achieved / 1e9:.0f} GB/s",
        None if achieved is None else achieved / bandwidth,
        peer_ms,
    )


def _index_scores_f64(query: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, meta: Any) -> torch.Tensor:
    """float64 ``[tokens, max_seq_len]`` indexer scores of decode rows, -inf past each sequence."""
    scores = torch.full((meta.num_tokens, meta.max_seq_len), float("-inf"), dtype=torch.float64)
    for row, seq_len in enumerate(meta.seq_lens_host):
        cached = read_entries(keys, meta.block_tables[row], 0, seq_len).double().cpu()
        scores[row, :seq_len] = index_scores(
            query[row : row + 1].double().cpu(), weights[row : row + 1].double().cpu(), cached
        )[0]
    return scores


def _check_picks(got: torch.Tensor, want: torch.Tensor, scores: torch.Tensor) -> str:
    """Top-k picks against the peer's: the same, or swapped near-ties (see ``bench_indexer``)."""
    got, want = got.cpu().long(), want.cpu().long()
    agree = sum(len(set(a) & set(b)) for a, b in zip(got.tolist(), want.tolist(), strict=True)) / want.numel()
    lowest = scores.gather(1, want.clamp(min=0)).masked_fill(want < 0, float("inf")).amin(1, keepdim=True)
    picked = scores.gather(1, got.clamp(min=0)).masked_fill(got < 0, float("inf"))
    tolerance = 1e-2 * scores.masked_fill(scores == float("-inf"), 0).abs().amax(1, keepdim=True)
    short = float((lowest - picked).clamp(min=0).div(tolerance).max())
    verdict = "ok" if short <= 1 else "FAIL"
    return f"{verdict} ({agree:.4f} of picks agree; the others {short:.2f} of the tolerance short of the peer's lowest)"


def bench_indexer(bench: Bench, shapes: Shapes, ours: Any, peer: Any, bandwidth: float) -> Row:
    """DeepSeek-V3.2's Lightning Indexer at decode: each token scores every cached key of
    its sequence and keeps the top ``topk``; the bytes are the keys read. The check: every
    pick the peer does not make scores, in float64, within 1% of the largest score of the
    peer's lowest pick (bf16 inputs, float32 sums: near-ties may swap; the smoke shapes
    failed the old check, 99% of picks agreeing, 2 runs in 15, on one swapped near-tie)."""
    s = shapes
    meta = _paged(bench, [(s.sparse_context - 1, 1)] * s.batch, s.block_size)
    keys = bench.randn(int(meta.block_tables.max()) + 1, s.block_size, s.index_dim)
    query = bench.randn(s.batch, s.index_heads, s.index_dim)
    # Head weights that bf16 holds exactly: a backend whose operator takes them in the query's
    # dtype (ascend-cann) then scores what the peer scores, and near-ties swap only by sum order.
    weights = bench.randn(s.batch, s.index_heads, dtype=torch.float32).bfloat16().float()
    got = ours.index_topk(query, weights, keys, meta, topk=s.topk)
    want = peer.index_topk(query, weights, keys, meta, topk=s.topk)
    check = _check_picks(got, want, _index_scores_f64(query, weights, keys, meta))
    ms = bench.time_ms(lambda: ours.index_topk(query, weights, keys, meta, topk=s.topk))
    peer_ms = bench.time_ms(lambda: peer.index_topk(query, weights, keys, meta, topk=s.topk))
    moved = s.batch * s.sparse_context * s.index_dim * 2
    achieved = None if ms is None else moved / (ms * 1e-3)
    return Row(
        "lightning indexer decode (V3.2)",
        f"{s.batch} seqs x {s.sparse_context} keys, top-{s.topk}, {s.index_heads} heads of {s.index_dim}, bf16",
        check,
        ms,
        "" if achieved is None else f"{achieved / 1e9:.0f} GB/s",
        None if achieved is None else achieved / bandwidth,
        peer_ms,
    )


def bench_row_topk(bench: Bench, shapes: Shapes, bandwidth: float) -> Row:
    """The indexer's top-k alone (``kernels/row_topk.py``) against ``torch.topk`` on the same
    float32 scores (a decode step's rows over the sparse context, the last tenth of each row
    ``-inf`` as for keys a token cannot see yet); the bytes are the scores read once."""
    from powertrain_cuda_sm100.kernels.row_topk import row_topk

    s = shapes
    scores = bench.randn(s.batch, s.sparse_context, dtype=torch.float32)
    scores[:, s.sparse_context - s.sparse_context // 10 :] = float("-inf")
    width = min(s.topk, s.sparse_context)

    def peer() -> torch.Tensor:
        values, columns = scores.topk(width, dim=-1)
        return columns.masked_fill(values == float("-inf"), -1).to(torch.int32)

    same = torch.equal(row_topk(scores, width), peer())
    ms = bench.time_ms(lambda: row_topk(scores, width))
    peer_ms = bench.time_ms(peer)
    moved = s.batch * s.sparse_context * 4
    achieved = None if ms is None else moved / (ms * 1e-3)
    return Row(
        "indexer top-k (radix select + sort)",
        f"{s.batch} rows x {s.sparse_context} float32 scores, top-{width}",
        "ok (equal to torch.topk)" if same else "FAIL (differs from torch.topk)",
        ms,
        "" if achieved is None else f"{achieved / 1e9:.0f} GB/s",
        None if achieved is None else achieved / bandwidth,
        peer_ms,
    )


def bench_moe(bench: Bench, shapes: Shapes, ours: Any, peer: Any, fp8: bool, peak: float, fp4: bool = False) -> Row:
    s = shapes
    w13 = bench.randn(s.experts, 2 * s.intermediate, s.hidden, dtype=torch.float32, scale=s.hidden**-0.5)
    w2 = bench.randn(s.experts, s.hidden, s.intermediate, dtype=torch.float32, scale=s.intermediate**-0.5)
    if fp4:  # DeepSeek-V4's packed experts: e2m1, ue8m0 scales per 32 columns
        (q13, s13), (q2, s2) = quantize_fp4(w13.cpu()), quantize_fp4(w2.cpu())
        q13, q2 = q13.view(torch.uint8), q2.view(torch.uint8)
        weights = ExpertWeights(
            w13=q13.to(bench.device), w2=q2.to(bench.device), num_experts=s.experts,
            w13_scale=s13.to(bench.device), w2_scale=s2.to(bench.device), fp4=True,
        )  # fmt: skip
        w13, w2 = dequantize_fp4(q13, s13).to(bench.device), dequantize_fp4(q2, s2).to(bench.device)
    elif fp8:
        block = (128, 128)
        (w13q, w13s), (w2q, w2s) = quantize_blocks(w13, block), quantize_blocks(w2, block)
        weights = ExpertWeights(
            w13=w13q, w2=w2q, num_experts=s.experts, w13_scale=w13s, w2_scale=w2s, block_shape=block
        )
        w13, w2 = dequantize_blocks(w13q, w13s, block), dequantize_blocks(w2q, w2s, block)
    else:
        weights = ExpertWeights(w13=w13.bfloat16(), w2=w2.bfloat16(), num_experts=s.experts)
    hidden = bench.randn(s.tokens, s.hidden)
    scores = torch.rand(s.tokens, s.experts, generator=bench.gen)
    topk_ids = scores.topk(s.top_k, dim=-1).indices.to(torch.int32).to(bench.device)
    topk_weights = (0.1 + torch.rand(s.tokens, s.top_k, generator=bench.gen)).to(bench.device)
    # The peer multiplies what it can run: the FP4 experts dequantised to bf16.
    peer_weights = ExpertWeights(w13=w13.bfloat16(), w2=w2.bfloat16(), num_experts=s.experts) if fp4 else weights
    prepared, peer_prepared = ours.prepare(weights), peer.prepare(peer_weights)
    got = ours.forward(hidden, topk_ids, topk_weights, prepared)
    # The oracle: the same (dequantized) experts in float32 through the torch backend.
    oracle = peer.prepare(ExpertWeights(w13=w13.float(), w2=w2.float(), num_experts=s.experts))
    want = peer.forward(hidden.float(), topk_ids, topk_weights, oracle)
    ms = bench.time_ms(lambda: ours.forward(hidden, topk_ids, topk_weights, prepared))
    peer_ms = bench.time_ms(lambda: peer.forward(hidden, topk_ids, topk_weights, peer_prepared))
    flops = 2 * s.tokens * s.top_k * 3 * s.hidden * s.intermediate
    achieved = None if ms is None else flops / (ms * 1e-3)
    return Row(
        f"moe grouped gemm ({'fp4 e2m1 experts' if fp4 else 'fp8 e4m3 128-block' if fp8 else 'bf16'})",
        f"{s.tokens} tokens, top-{s.top_k} of {s.experts}, hidden {s.hidden}, intermediate {s.intermediate}",
        _check(got, want, 0.1 if fp8 else 3e-2),  # FP4: the oracle has its dequantised weights
        ms,
        "" if achieved is None else f"{achieved / 1e12:.1f} TFLOP/s",
        None if achieved is None else achieved / peak,
        peer_ms,
    )


def bench_rmsnorm(bench: Bench, shapes: Shapes, ours: Any, bandwidth: float) -> Row:
    s = shapes
    norm = RMSNorm(s.hidden, eps=1e-6).to(device=bench.device, dtype=torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(bench.randn(s.hidden))
    x, residual = bench.randn(s.tokens, s.hidden), bench.randn(s.tokens, s.hidden)
    got = ours.rms_norm(x, norm.weight, norm.eps, residual)
    with torch.no_grad():
        want = norm(x, residual)
        peer_ms = bench.time_ms(lambda: norm(x, residual))
    ms = bench.time_ms(lambda: ours.rms_norm(x, norm.weight, norm.eps, residual))
    moved = 4 * x.numel() * 2
    achieved = None if ms is None else moved / (ms * 1e-3)
    checks = [_check(g, w, 2e-2) for g, w in zip(got, want, strict=True)]
    return Row(
        "rmsnorm + residual",
        f"{s.tokens} x {s.hidden}, bf16",
        next((c for c in checks if c.startswith("FAIL")), checks[0]),
        ms,
        "" if achieved is None else f"{achieved / 1e9:.0f} GB/s",
        None if achieved is None else achieved / bandwidth,
        peer_ms,
    )


def bench_rotary(bench: Bench, shapes: Shapes, ours: Any, peer: Any, bandwidth: float) -> Row:
    """forward_rotary over one-token decodes, against rotating in torch + the torch backend."""
    s = shapes
    layer = AttentionLayerSpec(
        kind="gqa", num_heads=s.heads, num_kv_heads=s.kv_heads, head_size=s.head_size, scale=s.head_size**-0.5
    )
    meta = _paged(bench, [(s.context - 1, 1)] * s.batch, s.block_size)
    num_blocks = int(meta.block_tables.max()) + 1
    cache, peer_cache = _caches(bench, ours, peer, layer, s.block_size, num_blocks)
    q, k, v = bench.randn(s.batch, s.heads, s.head_size), *(bench.randn(s.batch, s.kv_heads, s.head_size) for _ in "kv")
    angles = torch.rand(s.batch, s.head_size // 2, generator=bench.gen) * 6.28
    cos, sin = angles.cos().to(bench.device, torch.bfloat16), angles.sin().to(bench.device, torch.bfloat16)
    got = ours.forward_rotary(layer, q, k, v, cos, sin, cache, meta)
    want = peer.forward(layer, apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v, peer_cache, meta)
    ms = bench.time_ms(lambda: ours.forward_rotary(layer, q, k, v, cos, sin, cache, meta))
    peer_ms = bench.time_ms(
        lambda: peer.forward(layer, apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v, peer_cache, meta)
    )
    moved = s.batch * s.context * s.kv_heads * s.head_size * 2 * 2
    achieved = None if ms is None else moved / (ms * 1e-3)
    return Row(
        "rotary + cache write + decode",
        f"{s.batch} seqs x {s.context}, {s.heads}/{s.kv_heads} heads x {s.head_size}, bf16",
        _check(got, want, 2e-2),
        ms,
        "" if achieved is None else f"{achieved / 1e9:.0f} GB/s",
        None if achieved is None else achieved / bandwidth,
        peer_ms,
    )


def results_table(rows: list[Row]) -> dict[str, Any]:
    """One line per kernel: shape, check, and (when timed) time, achieved, fraction, peer."""
    results: dict[str, Any] = {}
    for row in rows:
        timing = ""
        if row.ms is not None:
            timing = f"; {row.ms:.3f} ms"
            if row.fraction is not None:
                timing += f", {row.achieved} = {row.fraction:.2f} of peak"
            timing += f"; torch peer {row.peer_ms:.3f} ms ({row.peer_ms / row.ms:.2f}x)"
        results[row.kernel] = f"{row.shape}: {row.check}{timing}"
    return results

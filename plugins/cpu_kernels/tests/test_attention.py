"""``cpu-paged`` (NativePagedAttention): the conformance kit against ``torch-reference`` on
both kernel paths, a float64 oracle on longer contexts and wider heads than the kit's, and
what the engine relies on beyond the kit: batch invariance, the same result on any thread
count, and a bad block table refused before anything is read."""

from __future__ import annotations

import math
from collections.abc import Iterator

import attrs
import pytest
import torch

from powertrain.engine.model_runner import torch_threads
from powertrain.interfaces import AttentionLayerSpec, AttentionMetadata
from powertrain.layers.norm import rms_norm
from powertrain.layers.rotary import apply_rotary
from powertrain.testing.attention import AttentionBackendSuite
from powertrain_cpu_kernels import _native
from powertrain_cpu_kernels.attention import NativePagedAttention
from powertrain_cpu_kernels.torch_openmp import gomp_parallel_address


class TestNativePagedAttention(AttentionBackendSuite):
    """Float32 and bfloat16 run the native kernel (AVX2+FMA where this CPU has it)."""

    component = "cpu-paged"


class TestNativePagedAttentionScalar(AttentionBackendSuite):
    """The portable scalar path, forced, through the whole kit."""

    component = "cpu-paged"

    @pytest.fixture(autouse=True)
    def _scalar(self) -> Iterator[None]:
        _native.force_scalar(True)
        yield
        _native.force_scalar(False)


BLOCK = 16


def paged_batch(
    lengths: list[tuple[int, int]],
    heads: int,
    kv_heads: int,
    dim: int,
    extra_blocks: int = 5,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], AttentionMetadata, torch.Tensor, torch.Tensor]:
    """Random queries and a filled paged cache of ``dtype`` for ``(context, new)``
    sequences, blocks shuffled among unused ones. Returns query, cache, metadata and every
    token's key and value per sequence position (for the oracle, in ``dtype``), as
    ``[seq][pos]`` lists of tensors."""
    needed = [math.ceil((c + q) / BLOCK) for c, q in lengths]
    num_blocks = sum(needed) + extra_blocks
    order = torch.randperm(num_blocks).tolist()
    tables, used = [], 0
    for count in needed:
        tables.append(tuple(order[used : used + count]))
        used += count
    # Unused slots hold NaN: anything read that should not be shows up in the output.
    cache = {
        name: torch.full((num_blocks, BLOCK, kv_heads, dim), float("nan"), dtype=dtype) for name in ("key", "value")
    }
    keys, values = [], []
    for (context, new), table in zip(lengths, tables, strict=True):
        k = torch.randn(context + new, kv_heads, dim).to(dtype)
        v = torch.randn(context + new, kv_heads, dim).to(dtype)
        for pos in range(context + new):
            cache["key"][table[pos // BLOCK], pos % BLOCK] = k[pos]
            cache["value"][table[pos // BLOCK], pos % BLOCK] = v[pos]
        keys.append(k)
        values.append(v)
    metadata = AttentionMetadata.build(
        query_lens=tuple(q for _, q in lengths),
        seq_lens=tuple(c + q for c, q in lengths),
        block_tables=tuple(tables),
        block_size=BLOCK,
        device="cpu",
    )
    query = torch.randn(sum(q for _, q in lengths), heads, dim).to(dtype)
    return query, cache, metadata, keys, values


def oracle(
    query: torch.Tensor, keys: list, values: list, lengths: list[tuple[int, int]], layer: AttentionLayerSpec
) -> torch.Tensor:
    """Causal (and windowed) softmax attention in float64, sequence by sequence."""
    group = layer.num_heads // layer.num_kv_heads
    out, start = [], 0
    for (context, new), k, v in zip(lengths, keys, values, strict=True):
        q = query[start : start + new].double()  # [new, heads, dim]
        start += new
        k = k.double().repeat_interleave(group, dim=1)  # [seq, heads, dim]
        v = v.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("thd,shd->hts", q, k) * layer.scale
        pos_q = torch.arange(context, context + new)[:, None]
        pos_k = torch.arange(context + new)[None, :]
        mask = pos_k <= pos_q
        if layer.sliding_window is not None:
            mask &= pos_k > pos_q - layer.sliding_window
        weights = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        out.append(torch.einsum("hts,shd->thd", weights, v))
    return torch.cat(out)


def short_rows_attention(
    backend: NativePagedAttention,
    layer: AttentionLayerSpec,
    query: torch.Tensor,
    cache: dict[str, torch.Tensor],
    metadata: AttentionMetadata,
) -> torch.Tensor:
    output = torch.zeros_like(query)
    backend._short(layer, query, cache["key"], cache["value"], metadata, output)
    return output


#: Beyond float32 summation (atol 2e-6), a bfloat16 output is rounded once: half an ulp,
#: 2^-8 of the value.
OUTPUT_ROUNDING = {torch.float32: 0.0, torch.bfloat16: 2.0**-8}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (8, 1, 128), (4, 4, 32), (6, 2, 80)])
@pytest.mark.parametrize("window", [None, 37])
def test_short_rows_match_a_float64_oracle(
    kernel_path: str, seed: int, heads: int, kv_heads: int, dim: int, window: int | None, dtype: torch.dtype
) -> None:
    """Decodes and verification rows over contexts of hundreds to over a thousand tokens,
    head dims that are and are not multiples of the kernel's lanes, GQA, MQA and MHA. The
    oracle reads the same (bfloat16-rounded) inputs in float64."""
    # 1300 + 2 spans six of the kernel's 256-key segments: their partial softmaxes are combined.
    lengths = [(int(torch.randint(0, 700, ())), 1) for _ in range(5)] + [(301, 4), (15, 16), (0, 7), (1300, 2)]
    layer = AttentionLayerSpec(
        kind="gqa", num_heads=heads, num_kv_heads=kv_heads, head_size=dim, scale=dim**-0.5, sliding_window=window
    )
    query, cache, metadata, keys, values = paged_batch(lengths, heads, kv_heads, dim, dtype=dtype)
    got = short_rows_attention(NativePagedAttention(threads=2), layer, query, cache, metadata)
    assert got.dtype == dtype
    want = oracle(query, keys, values, lengths, layer)
    torch.testing.assert_close(
        got.double(), want, rtol=OUTPUT_ROUNDING[dtype], atol=2e-6, msg=lambda m: f"{m} (seed={seed})"
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_a_row_gives_the_same_bits_alone_in_any_batch_and_on_any_thread_count(seed: int, dtype: torch.dtype) -> None:
    lengths = [(int(torch.randint(0, 900, ())), 1) for _ in range(40)] + [(250, 9)]
    layer = AttentionLayerSpec(kind="gqa", num_heads=9, num_kv_heads=3, head_size=64, scale=0.125)
    query, cache, metadata, _, _ = paged_batch(lengths, 9, 3, 64, dtype=dtype)
    with torch_threads(1):  # the pool runs only while torch's own ops are on one thread
        together = short_rows_attention(NativePagedAttention(threads=2), layer, query, cache, metadata)
        assert _native.threads() == 2
        serial = short_rows_attention(NativePagedAttention(threads=1), layer, query, cache, metadata)
    assert torch.equal(together, serial), f"the thread count changed the result (seed={seed})"
    for threads in (2, 3):  # torch on several threads: its OpenMP team runs the pairs
        with torch_threads(threads):
            assert NativePagedAttention._where_to_run() == (False, threads if gomp_parallel_address() else 0)
            team = short_rows_attention(NativePagedAttention(), layer, query, cache, metadata)
        assert torch.equal(team, serial), f"a team of {threads} changed the result (seed={seed})"
    for row in (0, 17, 40):
        start, end = metadata.query_start_loc_host[row : row + 2]
        alone = AttentionMetadata.build(
            query_lens=(end - start,),
            seq_lens=(metadata.seq_lens_host[row],),
            block_tables=(tuple(metadata.block_tables[row].tolist()),),
            block_size=BLOCK,
            device="cpu",
        )
        out = short_rows_attention(NativePagedAttention(threads=2), layer, query[start:end], cache, alone)
        assert torch.equal(out, together[start:end]), f"row {row} changed with its batch (seed={seed})"


@pytest.mark.parametrize("window", [None, 37, 300])
def test_a_token_gets_the_same_bits_verified_in_a_chunk_as_decoded_alone(
    kernel_path: str, seed: int, window: int | None
) -> None:
    """A speculative verification must score a draft token exactly as decoding it would.
    The chunks cross the kernel's 256-key segment boundaries (at 256 and 768), where a
    token's keys are split in two: the split follows the token's position, never its
    chunk."""
    lengths = [(250, 12), (760, 16)]
    layer = AttentionLayerSpec(
        kind="gqa", num_heads=9, num_kv_heads=3, head_size=64, scale=0.125, sliding_window=window
    )
    query, cache, metadata, _, _ = paged_batch(lengths, 9, 3, 64)
    chunks = short_rows_attention(NativePagedAttention(threads=2), layer, query, cache, metadata)
    for row, (context, new) in enumerate(lengths):
        start = metadata.query_start_loc_host[row]
        for i in range(new):
            alone = AttentionMetadata.build(
                query_lens=(1,),
                seq_lens=(context + i + 1,),
                block_tables=(tuple(metadata.block_tables[row].tolist()),),
                block_size=BLOCK,
                device="cpu",
            )
            token = start + i
            decoded = short_rows_attention(
                NativePagedAttention(threads=2), layer, query[token : token + 1], cache, alone
            )
            assert torch.equal(decoded, chunks[token : token + 1]), (
                f"position {context + i} changed with its chunk (window={window}, seed={seed})"
            )


def test_a_block_id_outside_the_cache_is_refused_before_anything_is_read(seed: int) -> None:
    layer = AttentionLayerSpec(kind="gqa", num_heads=4, num_kv_heads=2, head_size=32, scale=32**-0.5)
    query, cache, metadata, _, _ = paged_batch([(20, 1), (40, 1)], 4, 2, 32)
    tables = metadata.block_tables.clone()
    tables[1, 2] = cache["key"].shape[0]  # one past the last block
    bad = AttentionMetadata.build(
        query_lens=(1, 1),
        seq_lens=metadata.seq_lens_host,
        block_tables=tuple(tuple(row) for row in tables.tolist()),
        block_size=BLOCK,
        device="cpu",
    )
    output = torch.zeros_like(query)
    with pytest.raises(ValueError, match=r"sequence 1: block table entry 2 is \d+, not one of the cache's \d+ blocks"):
        NativePagedAttention()._short(layer, query, cache["key"], cache["value"], bad, output)
    assert not output.any(), "nothing may be written when the call is refused"


def test_an_output_the_kernel_cannot_write_in_place_takes_the_torch_path(seed: int) -> None:
    """A strided output (the kernel writes contiguous rows) gets the parent's plain-torch
    attention, with the same result to float32 rounding."""
    lengths = [(30, 1), (70, 1), (12, 3)]
    layer = AttentionLayerSpec(kind="gqa", num_heads=4, num_kv_heads=2, head_size=32, scale=32**-0.5)
    query, cache, metadata, keys, values = paged_batch(lengths, 4, 2, 32)
    strided = torch.zeros(4, query.shape[0], 32).transpose(0, 1)  # [tokens, heads, dim], not contiguous
    NativePagedAttention()._short(layer, query, cache["key"], cache["value"], metadata, strided)
    want = oracle(query, keys, values, lengths, layer)
    torch.testing.assert_close(strided.double(), want, rtol=0, atol=2e-6, msg=lambda m: f"{m} (seed={seed})")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("rotary_dim", [64, 32])
def test_fused_rotary_gives_the_bits_of_rotating_in_torch_then_attending(
    seed: int, rotary_dim: int, dtype: torch.dtype
) -> None:
    """forward_rotary against apply_rotary + forward: the same output and the same cache,
    bit for bit (decodes, a verification row and a long prefill; full and partial rotary;
    in bfloat16 every product and sum rounded as torch rounds it)."""
    lengths = [(40, 1), (7, 1), (20, 5), (0, 30)]
    layer = AttentionLayerSpec(kind="gqa", num_heads=9, num_kv_heads=3, head_size=64, scale=0.125)
    query, cache, metadata, _, _ = paged_batch(lengths, 9, 3, 64, dtype=dtype)
    tokens = query.shape[0]
    key, value = torch.randn(tokens, 3, 64).to(dtype), torch.randn(tokens, 3, 64).to(dtype)
    angles = torch.rand(tokens, rotary_dim // 2) * 6.3
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    backend = NativePagedAttention()
    fused_cache = {name: tensor.clone() for name, tensor in cache.items()}
    fused = backend.forward_rotary(layer, query, key, value, cos, sin, fused_cache, metadata)
    plain = backend.forward(layer, apply_rotary(query, cos, sin), apply_rotary(key, cos, sin), value, cache, metadata)
    assert torch.equal(fused, plain), f"outputs differ (seed={seed})"
    for name in ("key", "value"):
        same = torch.equal(fused_cache[name].nan_to_num(7.0), cache[name].nan_to_num(7.0))
        assert same, f"the {name} caches differ (seed={seed})"


@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_bfloat16_rms_norm_rounds_where_torch_rounds(seed: int, with_residual: bool) -> None:
    """The native bfloat16 norm against layers.norm's: the residual sum bit for bit, the
    normed row within two bfloat16 steps. Only the float32 order of the squares' sum differs,
    which can move the normalised value across a rounding boundary (one step); it is then
    rounded again after the weight multiplies it, as in HF, which can add a second step."""
    rows, hidden = 37, 576
    x = torch.randn(rows, hidden).to(torch.bfloat16)
    residual = torch.randn(rows, hidden).to(torch.bfloat16) if with_residual else None
    weight = (1 + 0.1 * torch.randn(hidden)).to(torch.bfloat16)
    got = NativePagedAttention().rms_norm(x, weight, 1e-5, residual)
    want = rms_norm(x, weight, 1e-5, residual)
    if residual is None:
        got, want = (got,), (want,)
    else:
        assert torch.equal(got[1], want[1]), f"the residual sums differ (seed={seed})"
    assert got[0].dtype == torch.bfloat16
    two_steps = want[0].float().abs() * 2.0**-6 + 1e-30
    assert ((got[0].float() - want[0].float()).abs() <= two_steps).all(), f"more than two bfloat16 steps (seed={seed})"
    # Most values agree exactly: a broken rounding would move about half of them.
    assert (got[0] == want[0]).float().mean() > 0.99, f"(seed={seed})"


def test_fused_rotary_refuses_a_slot_outside_the_cache_and_writes_nothing(seed: int) -> None:
    layer = AttentionLayerSpec(kind="gqa", num_heads=4, num_kv_heads=2, head_size=32, scale=32**-0.5)
    query, cache, metadata, _, _ = paged_batch([(20, 1), (40, 1)], 4, 2, 32)
    slots = metadata.slot_mapping.clone()
    slots[1] = cache["key"].shape[0] * BLOCK  # one past the last slot
    bad = attrs.evolve(metadata, slot_mapping=slots)
    before = {name: tensor.clone() for name, tensor in cache.items()}
    angles = torch.rand(2, 16)
    with pytest.raises(ValueError, match=r"token 1: slot \d+ is not one of the cache's \d+ slots"):
        NativePagedAttention().forward_rotary(
            layer, query, torch.randn(2, 2, 32), torch.randn(2, 2, 32), angles.cos(), angles.sin(), cache, bad
        )
    for name in ("key", "value"):
        assert torch.equal(cache[name].nan_to_num(7.0), before[name].nan_to_num(7.0)), f"{name} cache was written"

"""triton-sm100 attention against the torch reference, kernels run by the Triton interpreter.

What is mocked is the GPU, not the kernels: the conformance kit sees a CUDA platform
of capability 10.0 (conftest's ``interpreter_platform``) whose device is the CPU, and
the real Triton kernels execute under ``TRITON_INTERPRET=1`` on CPU tensors.
Interpreter tile sizes are small (see each kernel's config), so the kit's short
sequences cross several key tiles, query tiles and KV splits.
"""

from __future__ import annotations

import math

import attrs
import pytest
import torch

from powertrain.builtin.reference_attention import TorchReferenceAttention
from powertrain.components import PlatformInfo
from powertrain.interfaces import AttentionBackendContext, AttentionLayerSpec, AttentionMetadata
from powertrain.testing.attention import AttentionBackendSuite
from powertrain.testing.base import fresh_seed, generator, shuffled_block_tables
from powertrain_cuda_sm100.attention import TritonAttention
from powertrain_cuda_sm100.kernels.common import INTERPRETER_SM_COUNT, choose_num_splits
from powertrain_cuda_sm100.kernels.mla import mla_attention
from powertrain_cuda_sm100.kernels.paged_decode import paged_decode
from powertrain_cuda_sm100.kernels.sparse_mla import sparse_mla_attention


class TestTritonAttention(AttentionBackendSuite):
    component = "triton-sm100"

    @pytest.fixture
    def platform_info(self, interpreter_platform: PlatformInfo) -> PlatformInfo:
        # The kit would skip (no GPU here); run the kernels in the interpreter instead.
        return interpreter_platform


class TestTritonAttentionInvariant(TestTritonAttention):
    """The fixed-split variant: the kit once more (float32, one block size, to keep the
    interpreter's time down) and its declared batch invariance. triton-sm100
    itself picks its splits from the batch, and a decode row alone and among 16 then
    differs in the last bit (seen under the interpreter: 1.2e-7, GQA and MLA)."""

    component = "triton-sm100-invariant"
    dtypes = (torch.float32,)
    block_sizes = (16,)

    # Only the batches whose decode rows take the fixed-split path; the rest of the kit runs
    # the same code as triton-sm100 above (and cost a minute of interpreter time here).
    test_fused_rotary = test_head_ratios = test_sliding_window = test_sliding_window_over_released_blocks = None
    test_shuffled_block_tables = test_chunked_prefill = test_prefill_batch = test_fused_rmsnorm = None


# --------------------------------------------------------------------------- split-KV decode
#
# The kit's decode batches are short; these take the split path on purpose: long
# contexts cut into many splits, and batches where the splits a long sequence wants
# leave a short sequence's later splits empty (they must weigh nothing, not NaN).

TOLERANCES = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (2e-2, 2e-2)}
DTYPES = pytest.mark.parametrize("dtype", list(TOLERANCES), ids=lambda d: str(d).removeprefix("torch."))


@attrs.frozen
class _PagedBatch:
    """A decode batch over a shuffled paged cache that is random everywhere (the
    sequences' keys and the garbage around them alike)."""

    metadata: AttentionMetadata
    cache: dict[str, torch.Tensor]

    @classmethod
    def random(
        cls, seq_lens: list[int], block_size: int, widths: dict[str, tuple[int, ...]], dtype: torch.dtype, seed: int
    ) -> _PagedBatch:
        gen = generator(seed)
        tables, num_blocks = shuffled_block_tables([math.ceil(s / block_size) for s in seq_lens], gen)
        metadata = AttentionMetadata.build(
            query_lens=[1] * len(seq_lens), seq_lens=seq_lens, block_tables=tables, block_size=block_size
        )
        cache = {
            name: torch.randn((num_blocks, block_size, *shape), generator=gen).to(dtype)
            for name, shape in widths.items()
        }
        return cls(metadata=metadata, cache=cache)

    def new_tokens(self, name: str) -> torch.Tensor:
        """What the cache already holds at this step's slots: the reference's store then
        rewrites it unchanged."""
        rows = self.cache[name].flatten(0, 1)
        return rows[self.metadata.slot_mapping]


def _gqa_layer(window: int | None = None) -> AttentionLayerSpec:
    return AttentionLayerSpec(
        kind="gqa", num_heads=8, num_kv_heads=2, head_size=48, scale=48**-0.5, sliding_window=window
    )


def _check(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, seed: int) -> None:
    assert not got.isnan().any(), f"NaN in the output (seed={seed})"
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol, msg=lambda m: f"seed={seed}\n{m}")


def _gqa_decode(seq_lens: list[int], dtype: torch.dtype, num_splits: int, window: int | None = None) -> None:
    seed = fresh_seed()
    layer = _gqa_layer(window)
    per_token = (layer.num_kv_heads, layer.head_size)
    batch = _PagedBatch.random(seq_lens, 16, {"key": per_token, "value": per_token}, dtype, seed)
    query = torch.randn((len(seq_lens), layer.num_heads, layer.head_size), generator=generator(seed + 1)).to(dtype)
    got = torch.empty_like(query)
    meta = batch.metadata
    paged_decode(
        query,
        batch.cache["key"],
        batch.cache["value"],
        meta.block_tables,
        meta.seq_lens,
        got,
        scale=layer.scale,
        max_seq_len=meta.max_seq_len,
        sliding_window=window,
        num_splits=num_splits,
    )
    want = TorchReferenceAttention().forward(
        layer, query, batch.new_tokens("key"), batch.new_tokens("value"), batch.cache, meta
    )
    _check(got, want, dtype, seed)


@DTYPES
def test_split_kv_long_contexts(dtype: torch.dtype) -> None:
    """Hundreds of keys per sequence over 7 splits, block edges inside and between splits."""
    _gqa_decode([517, 301, 389], dtype, num_splits=7)


@DTYPES
def test_split_kv_empty_splits(dtype: torch.dtype) -> None:
    """Splits sized for a long sequence leave short ones with empty splits: no NaN, no weight."""
    _gqa_decode([600, 1, 3, 17], dtype, num_splits=8)


def test_split_kv_sliding_window() -> None:
    """With a window only its keys are split; sequences shorter than it see everything."""
    _gqa_decode([450, 40, 129], torch.float32, num_splits=5, window=100)


def test_backend_chooses_splits_for_few_long_sequences(interpreter_platform: PlatformInfo) -> None:
    """Through forward(): a small batch of long decodes takes the automatic split path."""
    seed = fresh_seed()
    layer = _gqa_layer()
    per_token = (layer.num_kv_heads, layer.head_size)
    batch = _PagedBatch.random([333, 210], 16, {"key": per_token, "value": per_token}, torch.float32, seed)
    assert choose_num_splits(2 * layer.num_kv_heads, 333, INTERPRETER_SM_COUNT, 16) > 1
    query = torch.randn((2, layer.num_heads, layer.head_size), generator=generator(seed + 1))
    backend = TritonAttention(
        AttentionBackendContext(
            platform=interpreter_platform, device=torch.device("cpu"), dtype=torch.float32, block_size=16
        )
    )
    key, value = batch.new_tokens("key"), batch.new_tokens("value")
    reference_cache = {name: t.clone() for name, t in batch.cache.items()}
    got = backend.forward(layer, query, key, value, batch.cache, batch.metadata)
    want = TorchReferenceAttention().forward(layer, query, key, value, reference_cache, batch.metadata)
    _check(got, want, torch.float32, seed)


def _split_mla_layer() -> AttentionLayerSpec:
    """20 heads: two head tiles, the second mostly padding."""
    rank, rope = 64, 16
    return AttentionLayerSpec(
        kind="mla",
        num_heads=20,
        num_kv_heads=1,
        head_size=rank + rope,
        scale=(rank + rope) ** -0.5,
        kv_lora_rank=rank,
        qk_rope_head_dim=rope,
    )


@DTYPES
def test_mla_split_decode(dtype: torch.dtype) -> None:
    """MLA decode over long latent contexts in many splits, some of them empty."""
    seed = fresh_seed()
    layer = _split_mla_layer()
    rank, rope, heads = layer.kv_lora_rank, layer.qk_rope_head_dim, layer.num_heads
    batch = _PagedBatch.random([430, 2, 260], 16, {"latent": (rank,), "rope": (rope,)}, dtype, seed)
    gen = generator(seed + 1)
    q_latent = torch.randn((3, heads, rank), generator=gen).to(dtype)
    q_rope = torch.randn((3, heads, rope), generator=gen).to(dtype)
    meta = batch.metadata
    got = torch.empty_like(q_latent)
    mla_attention(
        q_latent,
        q_rope,
        batch.cache["latent"],
        batch.cache["rope"],
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        got,
        scale=layer.scale,
        first_seq=0,
        num_seqs=3,
        max_query_len=1,
        max_seq_len=meta.max_seq_len,
        decode=True,
        num_splits=6,
    )
    want = TorchReferenceAttention().forward_mla(
        layer, q_latent, q_rope, batch.new_tokens("latent"), batch.new_tokens("rope"), batch.cache, meta
    )
    _check(got, want, dtype, seed)


@DTYPES
def test_sparse_mla_split_lists(dtype: torch.dtype) -> None:
    """Sparse MLA with each token's list cut into 5 splits: long lists over hundreds of
    positions, a short one whose later splits hold only -1 padding (they must weigh
    nothing), padding scattered inside lists, and a row that lists nothing (zeros)."""
    seed = fresh_seed()
    layer = _split_mla_layer()
    rank, rope, heads = layer.kv_lora_rank, layer.qk_rope_head_dim, layer.num_heads
    seq_lens, topk = [430, 7, 260, 50], 150
    batch = _PagedBatch.random(seq_lens, 16, {"latent": (rank,), "rope": (rope,)}, dtype, seed)
    gen = generator(seed + 1)
    indices = torch.full((len(seq_lens), topk), -1, dtype=torch.int32)
    for row, seq_len in enumerate(seq_lens[:3]):
        chosen = torch.randperm(seq_len, generator=gen)[: min(seq_len, topk)]
        indices[row, torch.randperm(topk, generator=gen)[: chosen.numel()]] = chosen.to(torch.int32)
    # the last row lists nothing
    q_latent = torch.randn((len(seq_lens), heads, rank), generator=gen).to(dtype)
    q_rope = torch.randn((len(seq_lens), heads, rope), generator=gen).to(dtype)
    meta = batch.metadata
    got = torch.empty_like(q_latent)
    token_seqs = torch.arange(len(seq_lens), dtype=torch.int32)
    sparse_mla_attention(
        q_latent,
        q_rope,
        batch.cache["latent"],
        batch.cache["rope"],
        meta.block_tables,
        token_seqs,
        indices,
        got,
        scale=layer.scale,
        num_splits=5,
    )
    # The oracle: each row's listed positions gathered by hand, float64 softmax.
    for row, table in enumerate(meta.block_tables.tolist()):
        listed = indices[row][indices[row] >= 0].long()
        if listed.numel() == 0:
            assert torch.equal(got[row], torch.zeros_like(got[row])), f"row {row} lists nothing (seed={seed})"
            continue
        slots = torch.tensor(table)[listed // 16] * 16 + listed % 16
        lat = batch.cache["latent"].flatten(0, 1)[slots].double()
        k_rope = batch.cache["rope"].flatten(0, 1)[slots].double()
        scores = (q_latent[row].double() @ lat.T + q_rope[row].double() @ k_rope.T) * layer.scale
        want = torch.softmax(scores, dim=-1) @ lat
        _check(got[row], want, dtype, seed)


# --------------------------------------------------------------------------- inputs as the engine hands them


def _backend(platform: PlatformInfo, dtype: torch.dtype, block_size: int) -> TritonAttention:
    return TritonAttention(
        AttentionBackendContext(platform=platform, device=torch.device("cpu"), dtype=dtype, block_size=block_size)
    )


def _mixed_metadata(block_size: int, gen: torch.Generator) -> tuple[AttentionMetadata, int]:
    """Two decodes, a verification (3 new tokens after a context), a chunk and a prompt."""
    lengths = [(37, 1), (5, 1), (21, 3), (2 * block_size - 1, block_size + 2), (0, 23)]
    tables, used = [], 0
    for context, new in lengths:
        count = math.ceil((context + new) / block_size)
        tables.append(list(range(used, used + count)))
        used += count
    perm = torch.randperm(used + 2, generator=gen).tolist()
    tables = [[perm[b] for b in table] for table in tables]
    metadata = AttentionMetadata.build(
        query_lens=[q for _, q in lengths],
        seq_lens=[c + q for c, q in lengths],
        block_tables=tables,
        block_size=block_size,
    )
    return metadata, used + 2


def test_strided_views_padding_rows_and_odd_head_size(interpreter_platform: PlatformInfo) -> None:
    """Query/key/value as views of one fused qkv projection (not contiguous), a head size
    of 40 (padded to 64 inside the kernels), and two padding rows past num_tokens (no
    slot, zero output)."""
    seed = fresh_seed()
    gen = generator(seed)
    heads, kv_heads, head_size, block_size = 6, 2, 40, 4
    layer = AttentionLayerSpec(kind="gqa", num_heads=heads, num_kv_heads=kv_heads, head_size=head_size, scale=0.15)
    metadata, num_blocks = _mixed_metadata(block_size, gen)
    tokens = metadata.num_tokens
    qkv = torch.randn((tokens + 2, heads + 2 * kv_heads, head_size), generator=gen)
    query, key, value = qkv[:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
    assert not query.is_contiguous()
    cache = {
        name: torch.randn((num_blocks, block_size, kv_heads, head_size), generator=gen) for name in ("key", "value")
    }
    reference_cache = {name: t.clone() for name, t in cache.items()}
    got = _backend(interpreter_platform, torch.float32, block_size).forward(layer, query, key, value, cache, metadata)
    want = TorchReferenceAttention().forward(
        layer, query.contiguous(), key.contiguous(), value.contiguous(), reference_cache, metadata
    )
    assert got.shape == query.shape
    _check(got[:tokens], want[:tokens], torch.float32, seed)
    assert (got[tokens:] == 0).all(), "padding rows must not hold garbage"
    for name in cache:
        assert torch.equal(cache[name], reference_cache[name]), f"{name} cache written differently (seed={seed})"


@pytest.mark.parametrize("capability", [(10, 0), (9, 0)], ids=["sm100", "sm90"])
def test_compiled_tile_sizes(monkeypatch: pytest.MonkeyPatch, interpreter_platform: PlatformInfo, capability) -> None:
    """The tiles the GPU launches use (not the interpreter's small ones), run in the
    interpreter on a mixed batch: 128-row prefill tiles, 64-key tiles, 64-head MLA."""
    from powertrain_cuda_sm100.kernels import mla, paged_decode, prefill

    for module, name in ((paged_decode, "decode_config"), (prefill, "prefill_config"), (mla, "mla_config")):
        compiled = getattr(module, name)
        monkeypatch.setattr(
            module,
            name,
            lambda *args, _compiled=compiled, **kwargs: _compiled(*args, **{**kwargs, "interpreting": False}),
        )
    seed = fresh_seed()
    gen = generator(seed)
    block_size = 16
    metadata, num_blocks = _mixed_metadata(block_size, gen)
    tokens = metadata.num_tokens
    backend = _backend(interpreter_platform, torch.bfloat16, block_size)
    backend.capability = capability

    layer = AttentionLayerSpec(kind="gqa", num_heads=8, num_kv_heads=1, head_size=64, scale=0.125, sliding_window=20)
    qkv = torch.randn((tokens, 10, 64), generator=gen).to(torch.bfloat16)
    query, key, value = qkv[:, :8], qkv[:, 8:9], qkv[:, 9:]
    cache = {name: torch.randn((num_blocks, block_size, 1, 64), generator=gen).to(torch.bfloat16) for name in "kv"}
    cache = {"key": cache["k"], "value": cache["v"]}
    reference_cache = {name: t.clone() for name, t in cache.items()}
    got = backend.forward(layer, query, key, value, cache, metadata)
    want = TorchReferenceAttention().forward(layer, query, key, value, reference_cache, metadata)
    _check(got, want, torch.bfloat16, seed)

    rank, rope, heads = 32, 16, 64
    mla_layer = AttentionLayerSpec(
        kind="mla",
        num_heads=heads,
        num_kv_heads=1,
        head_size=rank + rope,
        scale=(rank + rope) ** -0.5,
        kv_lora_rank=rank,
        qk_rope_head_dim=rope,
    )
    q_latent = torch.randn((tokens, heads, rank), generator=gen).to(torch.bfloat16)
    q_rope = torch.randn((tokens, heads, rope), generator=gen).to(torch.bfloat16)
    latent = torch.randn((tokens, rank), generator=gen).to(torch.bfloat16)
    k_rope = torch.randn((tokens, rope), generator=gen).to(torch.bfloat16)
    mla_cache = {
        "latent": torch.randn((num_blocks, block_size, rank), generator=gen).to(torch.bfloat16),
        "rope": torch.randn((num_blocks, block_size, rope), generator=gen).to(torch.bfloat16),
    }
    reference_mla_cache = {name: t.clone() for name, t in mla_cache.items()}
    got = backend.forward_mla(mla_layer, q_latent, q_rope, latent, k_rope, mla_cache, metadata)
    want = TorchReferenceAttention().forward_mla(
        mla_layer, q_latent, q_rope, latent, k_rope, reference_mla_cache, metadata
    )
    _check(got, want, torch.bfloat16, seed)


def test_unsupported_inputs_are_named(interpreter_platform: PlatformInfo) -> None:
    backend = _backend(interpreter_platform, torch.float32, 4)
    layer = AttentionLayerSpec(kind="gqa", num_heads=4, num_kv_heads=2, head_size=32, scale=0.2)
    with pytest.raises(ValueError, match="float64"):
        backend.kv_cache_spec(layer, 4, torch.float64)
    metadata = AttentionMetadata.build(query_lens=[1], seq_lens=[3], block_tables=[[0]], block_size=4)
    query, key = torch.randn((1, 4, 32)), torch.randn((1, 2, 32))
    wrong_layout = torch.randn((2, 2, 4, 32))  # block-head-major: not what the spec declared
    with pytest.raises(ValueError, match="block-token-major"):
        backend.forward(layer, query, key, key, {"key": wrong_layout, "value": wrong_layout}, metadata)
    windowless = AttentionLayerSpec(kind="gqa", num_heads=4, num_kv_heads=2, head_size=32, scale=0.2, sliding_window=0)
    cache = torch.randn((2, 4, 2, 32))
    with pytest.raises(ValueError, match="sliding_window=0"):
        backend.forward(windowless, query, key, key, {"key": cache, "value": cache.clone()}, metadata)
    cos = torch.randn((1, 17))  # rotary_dim 34 > head_size 32
    with pytest.raises(ValueError, match=r"cos/sin of \(1, 17\) do not fit"):
        backend.forward_rotary(layer, query, key, key, cos, cos, {"key": cache, "value": cache.clone()}, metadata)
    with pytest.raises(ValueError, match="cannot hold keys of 4 heads"):
        wide_key = torch.randn((1, 4, 32))
        backend.forward(layer, query, wide_key, wide_key, {"key": cache, "value": cache.clone()}, metadata)


def _small_layers() -> tuple[AttentionLayerSpec, AttentionLayerSpec]:
    gqa = AttentionLayerSpec(kind="gqa", num_heads=2, num_kv_heads=1, head_size=16, scale=0.25)
    mla = AttentionLayerSpec(
        kind="mla", num_heads=2, num_kv_heads=1, head_size=24, scale=24**-0.5, kv_lora_rank=16, qk_rope_head_dim=8
    )
    return gqa, mla


def test_bad_mla_cache_is_refused_before_anything_is_written(interpreter_platform: PlatformInfo) -> None:
    """forward_mla checks up front: a wrong rope cache leaves the latent cache as it was."""
    _, layer = _small_layers()
    metadata = AttentionMetadata.build(query_lens=[1], seq_lens=[3], block_tables=[[0]], block_size=4)
    latent_cache = torch.randn((2, 4, 16))
    before = latent_cache.clone()
    cache = {"latent": latent_cache, "rope": torch.randn((2, 4, 6))}  # rope width 6, the layer's is 8
    with pytest.raises(ValueError, match=r"MLA rope cache of shape \(2, 4, 6\)"):
        _backend(interpreter_platform, torch.float32, 4).forward_mla(
            layer,
            torch.randn((1, 2, 16)),
            torch.randn((1, 2, 8)),
            torch.randn((1, 16)),
            torch.randn((1, 8)),
            cache,
            metadata,
        )
    assert torch.equal(latent_cache, before)


def test_each_entry_point_checks_its_inputs_once(
    monkeypatch: pytest.MonkeyPatch, interpreter_platform: PlatformInfo
) -> None:
    """A batch of a decode and a prefill (both kernels run) is checked once per call, not
    again by the helpers and kernel wrappers behind the entry point."""
    from powertrain_cuda_sm100 import attention

    calls: dict[str, int] = {}
    for name in ("_check_gqa", "_check_cache_write", "_check_mla"):
        check = getattr(attention, name)

        def counted(*args, _name=name, _check=check, **kwargs):
            calls[_name] = calls.get(_name, 0) + 1
            return _check(*args, **kwargs)

        monkeypatch.setattr(attention, name, counted)
    gqa, mla = _small_layers()
    metadata = AttentionMetadata.build(query_lens=[1, 3], seq_lens=[5, 3], block_tables=[[0, 1], [2]], block_size=4)
    assert metadata.num_decodes == 1 and metadata.batch_size == 2
    backend, tokens = _backend(interpreter_platform, torch.float32, 4), metadata.num_tokens
    gqa_cache = {name: torch.zeros((3, 4, 1, 16)) for name in ("key", "value")}
    key = torch.randn((tokens, 1, 16))
    backend.forward(gqa, torch.randn((tokens, 2, 16)), key, key, gqa_cache, metadata)
    assert calls == {"_check_gqa": 1, "_check_cache_write": 1}
    cos = torch.randn((tokens, 4))
    backend.forward_rotary(gqa, torch.randn((tokens, 2, 16)), key, key, cos, cos, gqa_cache, metadata)
    assert calls == {"_check_gqa": 2, "_check_cache_write": 2}
    mla_cache = {"latent": torch.zeros((3, 4, 16)), "rope": torch.zeros((3, 4, 8))}
    q_latent, q_rope = torch.randn((tokens, 2, 16)), torch.randn((tokens, 2, 8))
    backend.forward_mla(mla, q_latent, q_rope, torch.randn((tokens, 16)), torch.randn((tokens, 8)), mla_cache, metadata)
    assert calls == {"_check_gqa": 2, "_check_cache_write": 2, "_check_mla": 1}


# --------------------------------------------------------------------------- Lightning Indexer


@pytest.mark.parametrize("tokens_per_entry", [1, 4])
def test_index_topk_in_row_slices(
    monkeypatch: pytest.MonkeyPatch, interpreter_platform: PlatformInfo, tokens_per_entry: int
) -> None:
    """A long prefill at long context is scored a slice of rows at a time (``SCORE_BYTES``):
    forced here down to 3 rows a slice, slices start mid-sequence and the picks stay the
    oracle's."""
    from powertrain.interfaces import attention as contract
    from powertrain.testing.indexer import check_index_topk

    lengths = [(5, 1), (3, 1), (0, 23), (9, 8)]
    columns = max(c + q for c, q in lengths) // tokens_per_entry
    monkeypatch.setattr(contract, "SCORE_BYTES", 3 * 4 * columns)
    assert contract.score_rows(columns) == 3
    seed = fresh_seed()
    for backend in (_backend(interpreter_platform, torch.float32, 8), TorchReferenceAttention()):
        check_index_topk(
            backend, lengths=lengths, block_size=8, dtype=torch.float32, seed=seed, tokens_per_entry=tokens_per_entry
        )

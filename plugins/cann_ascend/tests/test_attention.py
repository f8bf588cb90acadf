"""ascend-cann attention: the metadata -> operator mapping, and the conformance kit.

What is mocked is the Ascend NPU and torch_npu: ``powertrain_cann_ascend.ops.npu_ops``
returns ``AttentionOpsStandIn`` (``powertrain_cann_ascend.testing.standins``), plain-torch
versions of ``npu_fused_infer_attention_score``, ``npu_scatter_nd_update_``,
``npu_sparse_flash_attention`` and ``npu_lightning_indexer`` written from their
documentation that check their arguments as the documentation constrains them.
Everything around the operators -- cache layout, cache writes, argument mapping,
padding, MLA pieces, one batch per token for the V3.2 operators -- runs for real.
"""

from __future__ import annotations

import pytest
import torch

import powertrain_cann_ascend.ops as ops_module
from powertrain.builtin.reference_attention import TorchReferenceAttention
from powertrain.components import Availability, PlatformInfo
from powertrain.interfaces import AttentionBackendContext, AttentionLayerSpec, AttentionMetadata
from powertrain.testing.attention import AttentionBackendSuite
from powertrain_cann_ascend.attention import (
    AscendAttention,
    MLAPieces,
    PaddedRows,
    causal_mask,
    decode_args,
    mla_args,
    mla_padded_heads,
    mla_pieces,
    prefill_args,
    prefill_rows,
)
from powertrain_cann_ascend.sparse import (
    TokenBatches,
    compact_indices,
    indexer_args,
    sparse_padded_heads,
    visible_keys,
    visible_picks,
)
from powertrain_cann_ascend.testing.standins import AttentionOpsStandIn, FusedInferAttentionStandIn

#: The NPU is mocked: an ``npu`` platform whose tensors live on the CPU.
STANDIN_PLATFORM = PlatformInfo(
    name="npu",
    device_type="cpu",
    availability=Availability.yes("stand-in ops: no Ascend NPU here"),
    device_count=1,
    device_name="stand-in",
    dist_backend="gloo",
)

GQA = AttentionLayerSpec(kind="gqa", num_heads=8, num_kv_heads=2, head_size=64, scale=0.125)
MLA = AttentionLayerSpec(
    kind="mla", num_heads=16, num_kv_heads=1, head_size=576, scale=576**-0.5, kv_lora_rank=512, qk_rope_head_dim=64
)


def _meta(query_lens, seq_lens, block_tables, block_size=128):
    return AttentionMetadata.build(
        query_lens=query_lens, seq_lens=seq_lens, block_tables=block_tables, block_size=block_size
    )


# --------------------------------------------------------------------------- mapping: GQA


def test_decode_batch_args() -> None:
    meta = _meta([1, 1, 1, 3], [5, 130, 1, 3], [[3], [0, 7], [2], [4]])
    args = decode_args(GQA, meta)
    table = args.pop("block_table")
    assert torch.equal(table, meta.block_tables[:3]) and table.dtype == torch.int32
    assert args == {
        "num_heads": 8,
        "num_key_value_heads": 2,
        "scale": 0.125,
        "input_layout": "BSH",
        "block_size": 128,
        "actual_seq_lengths_kv": [5, 130, 1],  # per sequence; Q_S = 1 takes no query lengths
        "sparse_mode": 0,
    }


def test_ragged_prefill_args_and_padding() -> None:
    meta = _meta([5, 2, 9], [5, 2, 9], [[0], [1], [2]])
    mask = causal_mask("cpu")
    args = prefill_args(GQA, meta, mask)
    assert args.pop("atten_mask") is mask
    assert torch.equal(args.pop("block_table"), meta.block_tables)
    assert args == {
        "num_heads": 8,
        "num_key_value_heads": 2,
        "scale": 0.125,
        "input_layout": "BSH",
        "block_size": 128,
        "actual_seq_lengths": [5, 2, 9],  # BSH: per sequence, not cumulative
        "actual_seq_lengths_kv": [5, 2, 9],
        "sparse_mode": 3,
    }
    assert prefill_rows(meta) == PaddedRows(batch=3, max_len=9, rows=(0, 1, 2, 3, 4, 9, 10, *range(18, 27)))


def test_chunked_prefill_with_cached_prefix_args() -> None:
    # One decode, then a 3-token chunk after 128 cached tokens, then a fresh 4-token prompt.
    meta = _meta([1, 3, 4], [10, 131, 4], [[5], [1, 6], [2]])
    args = prefill_args(GQA, meta, causal_mask("cpu"))
    assert torch.equal(args["block_table"], meta.block_tables[1:])
    assert args["actual_seq_lengths"] == [3, 4]
    assert args["actual_seq_lengths_kv"] == [131, 4]  # rightDownCausal puts the 3 rows at keys 128..130
    assert decode_args(GQA, meta)["actual_seq_lengths_kv"] == [10]
    assert prefill_rows(meta) == PaddedRows(batch=2, max_len=4, rows=(0, 1, 2, 4, 5, 6, 7))


def test_causal_mask_is_the_optimised_2048_mask() -> None:
    mask = causal_mask("cpu")
    assert mask.shape == (2048, 2048) and mask.dtype == torch.bool
    assert not mask[5, 5] and not mask[5, 0] and mask[5, 6]


# --------------------------------------------------------------------------- mapping: MLA


def test_mla_pieces_and_args() -> None:
    meta = _meta([1, 1, 20, 3], [7, 300, 150, 3], [[0], [1, 2, 3], [4, 5], [6]])
    decodes = mla_pieces(meta, 0, 2)
    assert decodes == MLAPieces(sequences=(0, 1), query_lens=(1, 1), kv_lens=(7, 300))
    args = mla_args(MLA, decodes, meta.block_tables[:2], 128, None)
    args.pop("block_table")
    assert args == {
        "num_heads": 32,  # 16 heads padded to the rope path's smallest head count
        "num_key_value_heads": 1,
        "scale": MLA.scale,
        "input_layout": "TND",
        "block_size": 128,
        "actual_seq_lengths": [1, 2],  # TND: cumulative
        "actual_seq_lengths_kv": [7, 300],  # paged TND: per sequence
        "sparse_mode": 0,
        "atten_mask": None,
    }
    # 20 new tokens after 130 cached: pieces of 16 and 4, each ending its kv where its queries end.
    prefills = mla_pieces(meta, 2, 4)
    assert prefills == MLAPieces(sequences=(2, 2, 3), query_lens=(16, 4, 3), kv_lens=(146, 150, 3))
    mask = causal_mask("cpu")
    args = mla_args(MLA, prefills, meta.block_tables[[2, 2, 3]], 128, mask)
    assert args["actual_seq_lengths"] == [16, 20, 23]
    assert args["actual_seq_lengths_kv"] == [146, 150, 3]
    assert args["sparse_mode"] == 3 and args["atten_mask"] is mask


@pytest.mark.parametrize(("heads", "padded"), [(1, 32), (16, 32), (32, 32), (33, 64), (128, 128)])
def test_mla_padded_heads(heads: int, padded: int) -> None:
    assert mla_padded_heads(heads) == padded


def test_mla_too_many_heads() -> None:
    with pytest.raises(ValueError, match="at most 128 query heads"):
        mla_padded_heads(129)


# --------------------------------------------------------------------------- the backend around the op


def _backend(dtype: torch.dtype = torch.bfloat16) -> tuple[AscendAttention, FusedInferAttentionStandIn]:
    ops = FusedInferAttentionStandIn()
    context = AttentionBackendContext(
        platform=STANDIN_PLATFORM, device=torch.device("cpu"), dtype=dtype, block_size=128
    )
    return AscendAttention(context, ops), ops


def test_refuses_float32_and_unsupported_block_sizes() -> None:
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        _backend(torch.float32)
    backend, _ = _backend()
    with pytest.raises(ValueError, match=r"block sizes \[128, 256, 384, 512\].*block_size=16"):
        backend.kv_cache_spec(GQA, 16, torch.bfloat16)
    with pytest.raises(ValueError, match="kv_lora_rank=512"):
        backend.kv_cache_spec(
            AttentionLayerSpec(
                kind="mla", num_heads=4, num_kv_heads=1, head_size=48, scale=1.0, kv_lora_rank=32, qk_rope_head_dim=16
            ),
            128,
            torch.bfloat16,
        )


def test_cache_is_the_ops_bsh_layout() -> None:
    backend, _ = _backend()
    cache = backend.kv_cache_spec(GQA, 128, torch.bfloat16).allocate(3, "cpu")
    assert {name: tuple(t.shape) for name, t in cache.items()} == {"key": (3, 128, 128), "value": (3, 128, 128)}
    mla_cache = backend.kv_cache_spec(MLA, 128, torch.bfloat16).allocate(3, "cpu")
    assert {name: tuple(t.shape) for name, t in mla_cache.items()} == {"latent": (3, 128, 512), "rope": (3, 128, 64)}


def test_mixed_batch_from_strided_views_makes_two_calls() -> None:
    """Decode rows go in one BSH call with S = 1, prefill rows in one padded causal call;
    query/key/value sliced out of a fused qkv projection (not contiguous) still work."""
    backend, ops = _backend()
    meta = _meta([1, 1, 5, 130], [9, 200, 5, 140], [[3], [0, 7], [2], [4, 5]])
    gen = torch.Generator().manual_seed(0)
    tokens, heads, kv, dim = meta.num_tokens, GQA.num_heads, GQA.num_kv_heads, GQA.head_size
    qkv = torch.randn((tokens, (heads + 2 * kv) * dim), generator=gen).to(torch.bfloat16)
    query = qkv[:, : heads * dim].view(tokens, heads, dim)
    key = qkv[:, heads * dim : (heads + kv) * dim].view(tokens, kv, dim)
    value = qkv[:, (heads + kv) * dim :].view(tokens, kv, dim)
    spec = backend.kv_cache_spec(GQA, 128, torch.bfloat16)
    cache = spec.allocate(8, "cpu")
    for t in cache.values():
        t.copy_(torch.randn(t.shape, generator=gen))
    reference_cache = {
        "key": cache["key"].view(8, 128, kv, dim).clone(),
        "value": cache["value"].view(8, 128, kv, dim).clone(),
    }

    got = backend.forward(GQA, query, key, value, cache, meta)

    assert [(c["input_layout"], c["query_shape"], c["sparse_mode"]) for c in ops.attention_calls] == [
        ("BSH", (2, 1, heads * dim), 0),
        ("BSH", (2, 130, heads * dim), 3),
    ]
    want = TorchReferenceAttention().forward(GQA, query, key, value, reference_cache, meta)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(cache["key"].view(8, 128, kv, dim), reference_cache["key"])


def test_decode_only_batch_makes_one_call() -> None:
    backend, ops = _backend()
    meta = _meta([1, 1], [3, 129], [[0], [1, 2]])
    spec = backend.kv_cache_spec(GQA, 128, torch.bfloat16)
    cache = spec.allocate(3, "cpu")
    for t in cache.values():
        t.normal_()
    q = torch.randn((2, 8, 64), dtype=torch.bfloat16)
    kv = torch.randn((2, 2, 64), dtype=torch.bfloat16)
    backend.forward(GQA, q, kv, kv, cache, meta)
    assert len(ops.attention_calls) == 1 and ops.attention_calls[0]["query_shape"] == (2, 1, 512)


def test_mla_long_prefill_is_cut_into_pieces() -> None:
    backend, ops = _backend()
    meta = _meta([1, 40], [50, 40], [[0], [1]])
    spec = backend.kv_cache_spec(MLA, 128, torch.bfloat16)
    cache = spec.allocate(2, "cpu")
    for t in cache.values():
        t.normal_()
    gen = torch.Generator().manual_seed(1)
    q_latent = torch.randn((41, 16, 512), generator=gen).to(torch.bfloat16)
    q_rope = torch.randn((41, 16, 64), generator=gen).to(torch.bfloat16)
    latent = torch.randn((41, 512), generator=gen).to(torch.bfloat16)
    k_rope = torch.randn((41, 64), generator=gen).to(torch.bfloat16)
    reference_cache = {name: t.clone() for name, t in cache.items()}
    got = backend.forward_mla(MLA, q_latent, q_rope, latent, k_rope, cache, meta)
    assert [(c["query_shape"], c["actual_seq_lengths"], c["actual_seq_lengths_kv"]) for c in ops.attention_calls] == [
        ((1, 32, 512), [1], [50]),
        ((40, 32, 512), [16, 32, 40], [16, 32, 40]),
    ]
    want = TorchReferenceAttention().forward_mla(MLA, q_latent, q_rope, latent, k_rope, reference_cache, meta)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


# --------------------------------------------------------------------------- the stand-in is strict


def _paged(block_size: int = 128):
    key = torch.zeros((2, block_size, 128), dtype=torch.float16)
    table = torch.tensor([[0], [1]], dtype=torch.int32)
    return key, table


def test_standin_rejects_what_the_op_rejects() -> None:
    ops = FusedInferAttentionStandIn()
    key, table = _paged()
    q = torch.zeros((2, 4, 512), dtype=torch.float16)
    common = {"num_heads": 8, "num_key_value_heads": 2, "block_table": table, "block_size": 128, "input_layout": "BSH"}
    with pytest.raises(TypeError):  # the pre-7.0 name of scale
        ops.npu_fused_infer_attention_score(q, key, key, scale_value=0.1, **common)
    with pytest.raises(ValueError, match="needs atten_mask"):
        ops.npu_fused_infer_attention_score(q, key, key, actual_seq_lengths_kv=[4, 4], sparse_mode=3, **common)
    with pytest.raises(ValueError, match="non-contiguous"):
        ops.npu_fused_infer_attention_score(q.transpose(0, 1).contiguous().transpose(0, 1), key, key, **common)
    with pytest.raises(ValueError, match="actual_seq_lengths_kv"):
        ops.npu_fused_infer_attention_score(q, key, key, **common)
    small_key, _ = _paged(16)
    with pytest.raises(ValueError, match="multiple of 128"):
        ops.npu_fused_infer_attention_score(
            q, small_key, small_key, actual_seq_lengths_kv=[4, 4], **{**common, "block_size": 16}
        )
    tnd = {**common, "input_layout": "TND"}
    # TND query lengths are cumulative: per-sequence lengths end short of T, or decrease.
    with pytest.raises(ValueError, match="end at 4, the query has T=8"):
        ops.npu_fused_infer_attention_score(
            q.view(8, 8, 64), key, key, actual_seq_lengths=[4, 4], actual_seq_lengths_kv=[4, 4], **tnd
        )
    with pytest.raises(ValueError, match="cumulative"):
        ops.npu_fused_infer_attention_score(
            q.view(8, 8, 64), key, key, actual_seq_lengths=[6, 2], actual_seq_lengths_kv=[6, 2], **tnd
        )
    with pytest.raises(NotImplementedError, match="pse_shift"):
        ops.npu_fused_infer_attention_score(q, key, key, pse_shift=q, actual_seq_lengths_kv=[4, 4], **common)


def test_standin_scatter_checks_shapes() -> None:
    ops = FusedInferAttentionStandIn()
    cache = torch.zeros((6, 4))
    ops.npu_scatter_nd_update_(cache, torch.tensor([[5], [0]]), torch.ones((2, 4)))
    assert cache.sum() == 8 and cache[5].sum() == 4
    with pytest.raises(ValueError, match="updates must be"):
        ops.npu_scatter_nd_update_(cache, torch.tensor([[5]]), torch.ones((2, 4)))
    with pytest.raises(IndexError):
        ops.npu_scatter_nd_update_(cache, torch.tensor([[-1]]), torch.ones((1, 4)))


# --------------------------------------------------------------------------- DeepSeek-V3.2 mapping


def test_token_batches_give_every_token_its_own_batch() -> None:
    # A decode (context 5), a chunk of 3 after 128 cached tokens, a fresh prompt of 2.
    metadata = _meta([1, 3, 2], [6, 131, 2], [[4], [0, 7], [2]])
    batches = TokenBatches.of(metadata)
    assert batches.query_ends.tolist() == [1, 2, 3, 4, 5, 6]
    assert batches.positions.tolist() == [5, 128, 129, 130, 0, 1]
    assert batches.seq_lens.tolist() == [6, 131, 131, 131, 2, 2]
    assert batches.block_table[:, 0].tolist() == [4, 0, 0, 0, 2, 2]
    assert batches.block_table.dtype == torch.int32
    # V4's CSA: one key per 4 tokens, clamped to one for the call, picks past it dropped.
    visible = visible_keys(batches, 4)
    assert visible.tolist() == [1, 32, 32, 32, 0, 0]
    args = indexer_args(batches, visible, width=8)
    assert args["actual_seq_lengths_key"].tolist() == [1, 32, 32, 32, 1, 1]
    assert (args["layout_query"], args["layout_key"], args["sparse_mode"], args["sparse_count"]) == (
        "TND", "PA_BSND", 3, 8
    )  # fmt: skip
    picked = torch.tensor([[0, -1], [31, 32], [3, 5], [7, 1], [0, -1], [0, -1]], dtype=torch.int32)[:, None]
    assert visible_picks(picked, visible).tolist() == [[0, -1], [31, -1], [3, 5], [7, 1], [-1, -1], [-1, -1]]
    with pytest.raises(ValueError, match="at most 2048 keys"):
        indexer_args(batches, visible, width=4096)


def test_sparse_indices_are_compacted_for_the_operator() -> None:
    indices = torch.tensor([[-1, 7, -1, 2], [3, 1, 0, 5], [-1, -1, -1, -1], [4, -1, -1, -1]], dtype=torch.int32)
    compact, empty = compact_indices(indices)
    assert compact.tolist() == [[7, 2, -1, -1], [3, 1, 0, 5], [0, -1, -1, -1], [4, -1, -1, -1]]
    assert empty.tolist() == [False, False, True, False]
    assert sparse_padded_heads(3) == 4 and sparse_padded_heads(128) == 128
    with pytest.raises(ValueError, match="at most 128 query heads"):
        sparse_padded_heads(129)


def test_indexer_refuses_widths_the_operator_does_not_take() -> None:
    attention = AscendAttention(
        AttentionBackendContext(
            platform=STANDIN_PLATFORM, device=torch.device("cpu"), dtype=torch.bfloat16, block_size=128
        ),
        AttentionOpsStandIn(),
    )
    metadata = _meta([2], [2], [[0]])
    query = torch.randn(2, 16, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="64 index heads of 128"):
        attention.index_topk(query, torch.randn(2, 16), torch.randn(1, 128, 64, dtype=torch.bfloat16), metadata, topk=4)


def test_sparse_standin_refuses_what_the_documentation_leaves_open() -> None:
    ops = AttentionOpsStandIn()
    latent = torch.randn(2, 128, 1, 512, dtype=torch.bfloat16)
    rope = torch.randn(2, 128, 1, 64, dtype=torch.bfloat16)
    query, query_rope = torch.randn(1, 4, 512, dtype=torch.bfloat16), torch.randn(1, 4, 64, dtype=torch.bfloat16)
    one = torch.tensor([1], dtype=torch.int32)
    common = {
        "block_table": torch.tensor([[0]], dtype=torch.int32), "actual_seq_lengths_query": one,
        "actual_seq_lengths_kv": torch.tensor([10], dtype=torch.int32), "query_rope": query_rope, "key_rope": rope,
        "layout_query": "TND", "layout_kv": "PA_BSND", "attention_mode": 2,
    }  # fmt: skip

    def attend(row: list[int], **overrides: object) -> torch.Tensor:
        indices = torch.tensor(row, dtype=torch.int32).view(1, 1, -1)
        return ops.npu_sparse_flash_attention(query, latent, latent, indices, 0.1, **{**common, **overrides})[0]

    assert attend([3, 0, -1]).dtype == torch.bfloat16  # documented: the output is bfloat16
    with pytest.raises(ValueError, match="valid values must come first"):
        attend([-1, 3])
    with pytest.raises(NotImplementedError, match="no valid index"):
        attend([-1, -1])
    with pytest.raises(NotImplementedError, match="beyond kv length 10"):
        attend([10])
    with pytest.raises(ValueError, match="attention_mode=2"):
        attend([3], attention_mode=0)
    keys = torch.randn(1, 128, 1, 128, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="every input must be"):  # query, key and weights: one dtype
        ops.npu_lightning_indexer(
            torch.randn(1, 64, 128, dtype=torch.bfloat16), keys, torch.randn(1, 64), actual_seq_lengths_query=one,
            actual_seq_lengths_key=one, block_table=torch.tensor([[0]], dtype=torch.int32), layout_query="TND",
            layout_key="PA_BSND", sparse_count=4,
        )  # fmt: skip


# --------------------------------------------------------------------------- the conformance kit


class TestAscendAttention(AttentionBackendSuite):
    component = "ascend-cann"
    # The op computes in float16/bfloat16 (the stand-in in float32, then rounds).
    dtypes = (torch.float16, torch.bfloat16)
    # Paged prompt attention takes block sizes that are multiples of 128; MLA 16 or 128.
    block_sizes = (128,)
    # The rope (MLA) path takes DeepSeek's widths only.
    kv_lora_rank = 512
    qk_rope_head_dim = 64
    # npu_lightning_indexer takes 64 heads of 128, and query, key and weights in one dtype:
    # the float32 head weights are rounded to it, so a pick's score may be off by about
    # 2^-8 of the terms (64 of them, of either sign) rather than float32's sums.
    index_heads = 64
    index_head_dim = 128
    index_tolerance = 2e-2

    @pytest.fixture
    def platform_info(self) -> PlatformInfo:
        # The kit would skip (no NPU here); the NPU is mocked by a CPU-backed npu platform.
        return STANDIN_PLATFORM

    @pytest.fixture(autouse=True)
    def _standin_ops(self, monkeypatch: pytest.MonkeyPatch) -> None:
        # Mocked: torch_npu (and the NPU under it). The factory asks ops.npu_ops() for
        # torch_npu's operators and gets the documented-semantics stand-ins instead.
        monkeypatch.setattr(ops_module, "npu_ops", AttentionOpsStandIn)

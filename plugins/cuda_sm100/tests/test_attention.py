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
from powertrain.testing.base import fresh_seed, generator
from powertrain_cuda_sm100.attention import TritonAttention
from powertrain_cuda_sm100.kernels.common import INTERPRETER_SM_COUNT, choose_num_splits
from powertrain_cuda_sm100.kernels.mla import mla_attention
from powertrain_cuda_sm100.kernels.paged_decode import paged_decode


class TestTritonAttention(AttentionBackendSuite):
    component = "triton-sm100"

    @pytest.fixture
    def platform_info(self, interpreter_platform: PlatformInfo) -> PlatformInfo:
        # The kit would skip (no GPU here); run the kernels in the interpreter instead.
        return interpreter_platform


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
        needed = [math.ceil(s / block_size) for s in seq_lens]
        num_blocks = 2 * sum(needed) + 1
        pool = torch.randperm(num_blocks, generator=gen).tolist()
        tables, used = [], 0
        for count in needed:
            tables.append(pool[used : used + count])
            used += count
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


@DTYPES
def test_mla_split_decode(dtype: torch.dtype) -> None:
    """MLA decode over long latent contexts in many splits, some of them empty."""
    seed = fresh_seed()
    rank, rope, heads = 64, 16, 20  # 20 heads: two head tiles, the second mostly padding
    layer = AttentionLayerSpec(
        kind="mla",
        num_heads=heads,
        num_kv_heads=1,
        head_size=rank + rope,
        scale=(rank + rope) ** -0.5,
        kv_lora_rank=rank,
        qk_rope_head_dim=rope,
    )
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

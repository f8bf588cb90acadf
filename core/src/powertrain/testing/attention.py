"""Conformance suite for attention backends: a candidate against ``torch-reference``.

Subclass it in your plugin's tests::

    class TestMyAttention(AttentionBackendSuite):
        component = "my-attention"          # the record name
        dtypes = (torch.bfloat16,)          # optional: what the kernel supports

Both backends are built through their records' factories, each gets its own cache
allocated from its own ``KVCacheSpec`` (so any declared layout is exercised), the
already-cached (context) tokens are written identically into both, and the two
outputs are compared on fresh random inputs. After each forward the candidate's
cache must hold exactly the new tokens at ``slot_mapping`` and nothing else changed.
The reference always runs on the CPU, where it is exact and always available.

Sparse MLA (``sparse-mla``) is checked differently: against a float64 oracle in this
module (dense MLA over each sequence's whole history with a mask built from the
indices), since the indices, not causality, decide what is attended.
``check_sparse_mla`` and ``check_sparse_mla_refuses`` run one such check on any
backend object; the suite's ``test_sparse_mla*`` tests call them.

The helpers ``token_major``, ``write_tokens`` and ``read_tokens`` address a cache
per token whatever its layout; plugin authors may use them in their own tests.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import attrs
import pytest
import torch

from powertrain.interfaces import (
    AttentionBackend,
    AttentionBackendContext,
    AttentionLayerSpec,
    AttentionMetadata,
    KVCacheSpec,
    KVStoreAttentionBackend,
    LightningIndexerBackend,
    MLAAttentionBackend,
    QuantizedLinearContext,
    QuantizedLinearKernel,
    RMSNormKernel,
    RotaryAttentionBackend,
    SparseMLAAttentionBackend,
    V4AttentionBackend,
)
from powertrain.layers.norm import RMSNorm
from powertrain.layers.rotary import apply_rotary
from powertrain.plugins import Provided
from powertrain.testing.base import (
    ComponentSuite,
    Subject,
    assert_names_numbers,
    find_component,
    generator,
    random_index_rows,
)
from powertrain.testing.fused_decoder import check_fused_decoder
from powertrain.testing.graphs import check_captured_attention
from powertrain.testing.indexer import check_index_topk
from powertrain.testing.invariance import check_batch_invariant
from powertrain.testing.kv_access import read_tokens, token_major, write_tokens
from powertrain.testing.v4_attention import (
    V4_LAYER_KINDS,
    check_v4_attention,
    check_v4_attention_refuses,
    check_v4_attention_shared_entries,
)

__all__ = [
    "AttentionBackendSuite",
    "check_sparse_mla",
    "check_sparse_mla_refuses",
    "read_tokens",
    "token_major",
    "write_tokens",
]

REFERENCE = "torch-reference"

# --------------------------------------------------------------------------- batches


@attrs.frozen(kw_only=True)
class _Batch:
    """Per-sequence lengths (decodes first) and where each sequence's blocks live."""

    context_lens: tuple[int, ...]
    query_lens: tuple[int, ...]
    block_tables: tuple[tuple[int, ...], ...]
    num_blocks: int

    @property
    def seq_lens(self) -> tuple[int, ...]:
        return tuple(c + q for c, q in zip(self.context_lens, self.query_lens, strict=True))

    def metadata(self, block_size: int, device: torch.device | str) -> AttentionMetadata:
        return AttentionMetadata.build(
            query_lens=self.query_lens,
            seq_lens=self.seq_lens,
            block_tables=self.block_tables,
            block_size=block_size,
            device=device,
        )

    def context_slots(self, block_size: int) -> torch.Tensor:
        """Slots of every already-cached token, sequence by sequence."""
        slots = [
            blocks[pos // block_size] * block_size + pos % block_size
            for blocks, context in zip(self.block_tables, self.context_lens, strict=True)
            for pos in range(context)
        ]
        return torch.tensor(slots, dtype=torch.long)


def _randint(gen: torch.Generator, low: int, high: int) -> int:
    """Uniform in [low, high]."""
    return int(torch.randint(low, high + 1, (1,), generator=gen).item())


def _make_batch(
    lengths: Sequence[tuple[int, int]], block_size: int, gen: torch.Generator, *, shuffle: bool = False
) -> _Batch:
    """Blocks for ``(context_len, query_len)`` sequences.

    In order they are handed out 0, 1, 2, ...; shuffled they are drawn at random
    from a pool twice the size, so tables are non-contiguous, out of order and leave
    unused blocks (full of garbage) between them.
    """
    needed = [math.ceil((c + q) / block_size) for c, q in lengths]
    total = sum(needed)
    if shuffle:
        num_blocks = 2 * total + 3
        pool = torch.randperm(num_blocks, generator=gen)[:total].tolist()
    else:
        num_blocks = total + 1
        pool = list(range(total))
    tables, used = [], 0
    for count in needed:
        tables.append(tuple(pool[used : used + count]))
        used += count
    return _Batch(
        context_lens=tuple(c for c, _ in lengths),
        query_lens=tuple(q for _, q in lengths),
        block_tables=tuple(tables),
        num_blocks=num_blocks,
    )


def _released(batch: _Batch, window: int, block_size: int) -> tuple[_Batch, int]:
    """``batch`` as a sliding-window pool holds it: each sequence's blocks wholly before
    its first query's window point at a null block (one past the others, the engine's
    rule), which the caller zeroes. Returns the batch and the null block's id."""
    null = batch.num_blocks
    tables = []
    for blocks, context in zip(batch.block_tables, batch.context_lens, strict=True):
        first = max(0, (context - window + 1) // block_size)
        tables.append((null,) * first + tuple(blocks[first:]))
    return attrs.evolve(batch, block_tables=tuple(tables), num_blocks=batch.num_blocks + 1), null


# Each scenario returns (context_len, query_len) per sequence, decodes first.


def _decode_lengths(bs: int, gen: torch.Generator) -> list[tuple[int, int]]:
    # seq_len 1, exactly one block, one past a block, and random longer ones.
    return [(0, 1), (bs - 1, 1), (bs, 1), (2 * bs + _randint(gen, 0, bs - 1), 1), (_randint(gen, 1, 60), 1)]


def _prefill_lengths(bs: int, gen: torch.Generator) -> list[tuple[int, int]]:
    return [(0, bs), (0, bs + 1), (0, _randint(gen, 2, 40)), (0, 2), (0, _randint(gen, 2, 40))]


def _mixed_lengths(bs: int, gen: torch.Generator) -> list[tuple[int, int]]:
    decodes = [(_randint(gen, 1, 40), 1) for _ in range(3)]
    prefills = [(0, _randint(gen, 2, 30)) for _ in range(3)]
    return decodes + prefills


def _chunked_lengths(bs: int, gen: torch.Generator) -> list[tuple[int, int]]:
    # Contexts and totals ending exactly on and one past block boundaries.
    return [
        (bs, bs),
        (bs - 1, 2),
        (bs + 1, bs - 1),
        (2 * bs, bs + 1),
        (_randint(gen, 1, 20), _randint(gen, 2, 20)),
    ]


def _long_block_lengths(bs: int, gen: torch.Generator) -> list[tuple[int, int]]:
    # Several blocks per sequence, so a wrong block-table walk cannot go unnoticed.
    return [(3 * bs + 2, 1), (2 * bs - 1, 1), (0, 2 * bs + 3), (0, bs + 5)]


def _verify_lengths(bs: int, gen: torch.Generator) -> list[tuple[int, int]]:
    # Speculative verification: decodes, then a few new tokens after a cached context
    # (some ending on or one past a block edge), between them a long prefill.
    return [
        (_randint(gen, 1, 40), 1),
        (bs - 2, 2),
        (_randint(gen, 1, 3 * bs), _randint(gen, 2, 6)),
        (0, 2 * bs + 20),
        (2 * bs - 3, 3),
        (_randint(gen, 1, 3 * bs), _randint(gen, 5, 9)),
    ]


def _block_lengths(bs: int, gen: torch.Generator) -> list[tuple[int, int]]:
    # A block drafter's step: blocks of a few tokens after cached contexts (one from
    # nothing, one ending on a block edge), and a long catch-up row.
    return [
        (_randint(gen, 1, 3 * bs), _randint(gen, 2, 8)),
        (0, _randint(gen, 2, 8)),
        (2 * bs - 4, 4),
        (_randint(gen, 1, 2 * bs), 2 * bs + 5),
    ]


_SCENARIOS: dict[str, tuple[Callable[[int, torch.Generator], list[tuple[int, int]]], tuple[str, ...]]] = {
    "decode": (_decode_lengths, ("decode",)),
    "prefill": (_prefill_lengths, ("prefill",)),
    "mixed": (_mixed_lengths, ("decode", "prefill")),
    "chunked": (_chunked_lengths, ("prefill", "chunked-prefill")),
    "verify": (_verify_lengths, ("decode", "prefill", "chunked-prefill")),
    "block": (_block_lengths, ("prefill", "chunked-prefill")),
}


def _random(shape: Sequence[int], gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    # Generated in float32 on the CPU and then rounded, so both backends see the same values.
    return torch.randn(tuple(shape), generator=gen, dtype=torch.float32).to(dtype)


def _dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# --------------------------------------------------------------------------- the suite


@attrs.frozen(kw_only=True)
class _Pair:
    """The candidate and the reference, each with its device and cache spec."""

    candidate: Any
    reference: Any
    device: torch.device
    candidate_spec: KVCacheSpec
    reference_spec: KVCacheSpec


class AttentionBackendSuite(ComponentSuite):
    """Compares an attention backend with ``torch-reference`` on random paged batches.

    Class attributes a subclass may set:

    * ``dtypes``: the dtypes to test (default float32 and bfloat16);
    * ``block_sizes``: the cache block sizes to test;
    * ``head_size``, ``kv_lora_rank``, ``qk_rope_head_dim``: layer widths, for kernels
      that only support some;
    * ``tolerances``: dtype -> (atol, rtol). Loosen only with a reason you can state
      (e.g. TF32 matmuls), since this is what "conformant" means.
    * ``index_heads``, ``index_head_dim``: the Lightning Indexer's widths, for kernels that
      only support some; ``index_tolerance``: how far (relative to a row's largest score)
      a pick's score may be from the oracle's, the same rule.
    * ``fused_decoder_quantized_linear``: the quantised-linear kernel the ``fused-decoder``
      case keeps its projections for.
    """

    kind: ClassVar[str] = "attention"
    dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32, torch.bfloat16)
    block_sizes: ClassVar[tuple[int, ...]] = (4, 16)
    head_size: ClassVar[int] = 32
    kv_lora_rank: ClassVar[int] = 32
    qk_rope_head_dim: ClassVar[int] = 16
    index_heads: ClassVar[int] = 12
    index_head_dim: ClassVar[int] = 40
    index_tolerance: ClassVar[float] = 1e-3
    #: The quantised-linear component whose kept weights the ``fused-decoder`` case hands
    #: over (None: the highest-priority one available here; dense weights where none is).
    fused_decoder_quantized_linear: ClassVar[str | None] = None
    tolerances: ClassVar[Mapping[torch.dtype, tuple[float, float]]] = {
        torch.float32: (1e-4, 1e-4),
        torch.float16: (5e-3, 5e-3),
        torch.bfloat16: (2e-2, 2e-2),
    }

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        # Parametrised here rather than with marks so a subclass's ClassVars take effect.
        if "dtype" in metafunc.fixturenames:
            metafunc.parametrize("dtype", self.dtypes, ids=_dtype_id)
        if "block_size" in metafunc.fixturenames:
            metafunc.parametrize("block_size", self.block_sizes, ids=lambda b: f"block{b}")

    # ----------------------------------------------------------------------- building

    def _build(
        self,
        subject: Subject,
        dtype: torch.dtype,
        block_size: int,
    ) -> tuple[Any, Any, torch.device]:
        device = torch.device(subject.platform.device_type)
        candidate = subject.provided.record.factory(
            AttentionBackendContext(platform=subject.platform, device=device, dtype=dtype, block_size=block_size)
        )
        host = next(info for info in subject.plugins.platforms().values() if info.host)
        reference = find_component(subject.plugins, "attention", REFERENCE).record.factory(
            AttentionBackendContext(platform=host, device=torch.device("cpu"), dtype=dtype, block_size=block_size)
        )
        return candidate, reference, device

    def _pair(
        self,
        subject: Subject,
        layer: AttentionLayerSpec,
        dtype: torch.dtype,
        block_size: int,
    ) -> _Pair:
        candidate, reference, device = self._build(subject, dtype, block_size)
        protocol = MLAAttentionBackend if layer.kind == "mla" else AttentionBackend
        assert isinstance(candidate, protocol), (
            f"{subject.provided.record.name}'s factory returned {candidate!r}, "
            f"which does not satisfy {protocol.__name__}"
        )
        candidate_spec = candidate.kv_cache_spec(layer, block_size, dtype)
        _check_spec(candidate_spec, layer, block_size, dtype, subject.provided.record.name)
        return _Pair(
            candidate=candidate,
            reference=reference,
            device=device,
            candidate_spec=candidate_spec,
            reference_spec=reference.kv_cache_spec(layer, block_size, dtype),
        )

    def _gqa_heads(self, provided: Provided) -> tuple[int, int]:
        """4 query heads over 2 kv heads where GQA is declared, else plain MHA."""
        capabilities = provided.record.capabilities
        if "gqa" in capabilities:
            return 4, 2
        if "mha" in capabilities:
            return 4, 4
        # An MLA-only backend: the GQA tests do not apply; test_mla covers it.
        pytest.skip(f"{provided.record.name} declares neither 'gqa' nor 'mha'")

    # ----------------------------------------------------------------------- running

    def _run_gqa(
        self,
        pair: _Pair,
        layer: AttentionLayerSpec,
        batch: _Batch,
        dtype: torch.dtype,
        block_size: int,
        seed: int,
        what: str,
        *,
        rotary_dim: int | None = None,
        release: bool = False,
    ) -> None:
        """Both backends on one random batch; with ``rotary_dim`` the candidate rotates
        (``forward_rotary``) and the reference is given query and key rotated in torch;
        with ``release`` the blocks before each window point at a zeroed null block."""
        gen = generator(seed)
        num_tokens = sum(batch.query_lens)
        kv_shape = (layer.num_kv_heads, layer.head_size)
        query = _random((num_tokens, layer.num_heads, layer.head_size), gen, dtype)
        key = _random((num_tokens, *kv_shape), gen, dtype)
        value = _random((num_tokens, *kv_shape), gen, dtype)
        context_slots = batch.context_slots(block_size)
        context = {
            "key": _random((len(context_slots), *kv_shape), gen, dtype),
            "value": _random((len(context_slots), *kv_shape), gen, dtype),
        }
        where = f"{what}; context_lens={batch.context_lens} query_lens={batch.query_lens} (seed={seed})"

        if release:
            assert layer.sliding_window is not None
            batch, null = _released(batch, layer.sliding_window, block_size)
            where += f"; blocks before each window point at null block {null}: {batch.block_tables}"
        candidate_cache, reference_cache = _prepared_caches(pair, batch, context_slots, context, gen)
        if release:
            for tensor in (*candidate_cache.values(), *reference_cache.values()):
                tensor[null].zero_()
        before = {name: t.clone() for name, t in candidate_cache.items()}
        candidate_meta = batch.metadata(block_size, pair.device)
        reference_meta = batch.metadata(block_size, "cpu")

        inputs = (query.to(pair.device), key.to(pair.device), value.to(pair.device))
        written_tolerance = None
        if rotary_dim is None:
            got = pair.candidate.forward(layer, *inputs, candidate_cache, candidate_meta)
        else:
            angles = torch.rand((num_tokens, rotary_dim // 2), generator=gen, dtype=torch.float64) * 2 * math.pi
            cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
            got = pair.candidate.forward_rotary(
                layer, *inputs, cos.to(pair.device), sin.to(pair.device), candidate_cache, candidate_meta
            )
            query, key = apply_rotary(query, cos, sin), apply_rotary(key, cos, sin)
            # A fused kernel rotates in its own arithmetic: the written keys match to rounding.
            written_tolerance = self.tolerances[dtype]
        want = pair.reference.forward(layer, query, key, value, reference_cache, reference_meta)

        self._compare(got, want, (num_tokens, layer.num_heads, layer.head_size), dtype, where)
        new = {"key": key, "value": value}
        _check_cache_writes(
            pair.candidate_spec,
            before,
            candidate_cache,
            reference_meta.slot_mapping,
            new,
            where,
            tolerance=written_tolerance,
        )

    def _run_mla(
        self,
        pair: _Pair,
        layer: AttentionLayerSpec,
        batch: _Batch,
        dtype: torch.dtype,
        block_size: int,
        seed: int,
        what: str,
    ) -> None:
        gen = generator(seed)
        num_tokens = sum(batch.query_lens)
        rank, rope = layer.kv_lora_rank, layer.qk_rope_head_dim
        q_latent = _random((num_tokens, layer.num_heads, rank), gen, dtype)
        q_rope = _random((num_tokens, layer.num_heads, rope), gen, dtype)
        latent = _random((num_tokens, rank), gen, dtype)
        k_rope = _random((num_tokens, rope), gen, dtype)
        context_slots = batch.context_slots(block_size)
        context = {
            "latent": _random((len(context_slots), rank), gen, dtype),
            "rope": _random((len(context_slots), rope), gen, dtype),
        }
        where = f"{what}; context_lens={batch.context_lens} query_lens={batch.query_lens} (seed={seed})"

        candidate_cache, reference_cache = _prepared_caches(pair, batch, context_slots, context, gen)
        before = {name: t.clone() for name, t in candidate_cache.items()}
        reference_meta = batch.metadata(block_size, "cpu")

        got = pair.candidate.forward_mla(
            layer,
            q_latent.to(pair.device),
            q_rope.to(pair.device),
            latent.to(pair.device),
            k_rope.to(pair.device),
            candidate_cache,
            batch.metadata(block_size, pair.device),
        )
        want = pair.reference.forward_mla(layer, q_latent, q_rope, latent, k_rope, reference_cache, reference_meta)

        self._compare(got, want, (num_tokens, layer.num_heads, rank), dtype, where)
        _check_cache_writes(
            pair.candidate_spec,
            before,
            candidate_cache,
            reference_meta.slot_mapping,
            {"latent": latent, "rope": k_rope},
            where,
        )

    def _compare(
        self, got: torch.Tensor, want: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, where: str
    ) -> None:
        assert isinstance(got, torch.Tensor), f"forward returned {type(got).__name__}, not a tensor: {where}"
        assert tuple(got.shape) == shape, f"output shape {tuple(got.shape)}, expected {shape}: {where}"
        assert got.dtype == dtype, f"output dtype {got.dtype}, expected the query's {dtype}: {where}"
        atol, rtol = self.tolerances[dtype]
        torch.testing.assert_close(
            got.detach().cpu().float(),
            want.float(),
            atol=atol,
            rtol=rtol,
            msg=lambda detail: f"output differs from {REFERENCE}: {where}\n{detail}",
        )

    def _gqa_layer(
        self, num_heads: int, num_kv_heads: int, sliding_window: int | None = None, causal: bool = True
    ) -> AttentionLayerSpec:
        return AttentionLayerSpec(
            kind="gqa",
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_size=self.head_size,
            scale=self.head_size**-0.5,
            sliding_window=sliding_window,
            causal=causal,
        )

    def _mla_layer(self) -> AttentionLayerSpec:
        width = self.kv_lora_rank + self.qk_rope_head_dim
        return AttentionLayerSpec(
            kind="mla",
            num_heads=4,
            num_kv_heads=1,
            head_size=width,
            scale=width**-0.5,
            kv_lora_rank=self.kv_lora_rank,
            qk_rope_head_dim=self.qk_rope_head_dim,
        )

    def _gqa_scenario(
        self,
        subject: Subject,
        scenario: str,
        dtype: torch.dtype,
        block_size: int,
        seed: int,
    ) -> None:
        lengths_of, capabilities = _SCENARIOS[scenario]
        self.require(subject.provided, "paged", *capabilities)
        layer = self._gqa_layer(*self._gqa_heads(subject.provided))
        pair = self._pair(subject, layer, dtype, block_size)
        gen = generator(seed)
        batch = _make_batch(lengths_of(block_size, gen), block_size, gen)
        self._run_gqa(pair, layer, batch, dtype, block_size, seed, f"{scenario} batch, {_dtype_id(dtype)}")

    # ----------------------------------------------------------------------- tests

    def test_kv_cache_spec(self, subject: Subject, dtype: torch.dtype) -> None:
        """The cache the engine will allocate is the one the backend described, and sized."""
        layer = self._gqa_layer(*self._gqa_heads(subject.provided))
        block_size = self.block_sizes[-1]
        candidate, _, _ = self._build(subject, dtype, block_size)
        spec = candidate.kv_cache_spec(layer, block_size, dtype)
        _check_spec(spec, layer, block_size, dtype, subject.provided.record.name)
        assert spec.bytes_per_token > 0, f"{subject.provided.record.name}: bytes_per_token is {spec.bytes_per_token}"

    def test_mla_kv_cache_spec(self, subject: Subject, dtype: torch.dtype) -> None:
        """MLA's memory saving is real only if the cache holds latent + rope and nothing else."""
        self.require(subject.provided, "mla")
        layer = self._mla_layer()
        block_size = self.block_sizes[-1]
        candidate, _, _ = self._build(subject, dtype, block_size)
        spec = candidate.kv_cache_spec(layer, block_size, dtype)
        _check_spec(spec, layer, block_size, dtype, subject.provided.record.name)
        itemsize = torch.empty((), dtype=dtype).element_size()
        expected = (layer.kv_lora_rank + layer.qk_rope_head_dim) * itemsize
        assert spec.bytes_per_token == expected, (
            f"{subject.provided.record.name}: an MLA cache should take "
            f"(kv_lora_rank + qk_rope_head_dim) * {itemsize} = "
            f"{expected} bytes per token, the spec says {spec.bytes_per_token}"
        )

    def test_decode_batch(
        self,
        subject: Subject,
        dtype: torch.dtype,
        block_size: int,
        seed: int,
    ) -> None:
        self._gqa_scenario(subject, "decode", dtype, block_size, seed)

    def test_prefill_batch(
        self,
        subject: Subject,
        dtype: torch.dtype,
        block_size: int,
        seed: int,
    ) -> None:
        """Ragged prompts with nothing cached yet."""
        self._gqa_scenario(subject, "prefill", dtype, block_size, seed)

    def test_mixed_batch(
        self,
        subject: Subject,
        dtype: torch.dtype,
        block_size: int,
        seed: int,
    ) -> None:
        """Decodes first, then prefills, as continuous batching forms them."""
        self._gqa_scenario(subject, "mixed", dtype, block_size, seed)

    def test_chunked_prefill(
        self,
        subject: Subject,
        dtype: torch.dtype,
        block_size: int,
        seed: int,
    ) -> None:
        """New tokens after cached ones (an earlier chunk or a prefix-cache hit)."""
        self._gqa_scenario(subject, "chunked", dtype, block_size, seed)

    def test_verify_batch(
        self,
        subject: Subject,
        dtype: torch.dtype,
        block_size: int,
        seed: int,
    ) -> None:
        """A few new tokens per sequence after its cached ones (speculative verification),
        next to decodes and a long prefill."""
        self._gqa_scenario(subject, "verify", dtype, block_size, seed)

    def test_shuffled_block_tables(
        self,
        subject: Subject,
        dtype: torch.dtype,
        block_size: int,
        seed: int,
    ) -> None:
        """Blocks scattered over a larger pool, out of order, several per sequence."""
        self.require(subject.provided, "paged", "decode", "prefill")
        layer = self._gqa_layer(*self._gqa_heads(subject.provided))
        pair = self._pair(subject, layer, dtype, block_size)
        gen = generator(seed)
        batch = _make_batch(_long_block_lengths(block_size, gen), block_size, gen, shuffle=True)
        self._run_gqa(pair, layer, batch, dtype, block_size, seed, f"shuffled block tables, {_dtype_id(dtype)}")

    @pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (4, 2), (8, 2)], ids=["mha", "gqa2", "gqa4"])
    def test_head_ratios(
        self,
        subject: Subject,
        dtype: torch.dtype,
        num_heads: int,
        num_kv_heads: int,
        seed: int,
    ) -> None:
        """Query head h must read kv head h // (heads / kv_heads)."""
        self.require(subject.provided, "paged", "decode", "prefill", "mha" if num_heads == num_kv_heads else "gqa")
        block_size = self.block_sizes[-1]
        layer = self._gqa_layer(num_heads, num_kv_heads)
        pair = self._pair(subject, layer, dtype, block_size)
        gen = generator(seed)
        batch = _make_batch(_mixed_lengths(block_size, gen), block_size, gen, shuffle=True)
        what = f"{num_heads} heads over {num_kv_heads} kv heads, {_dtype_id(dtype)}"
        self._run_gqa(pair, layer, batch, dtype, block_size, seed, what)

    @pytest.mark.parametrize("scenario", ["mixed", "chunked", "verify"])
    def test_sliding_window(
        self,
        subject: Subject,
        scenario: str,
        dtype: torch.dtype,
        block_size: int,
        seed: int,
    ) -> None:
        """Each token sees itself and the window - 1 tokens before it, across block edges."""
        lengths_of, capabilities = _SCENARIOS[scenario]
        self.require(subject.provided, "sliding-window", "paged", *capabilities)
        gen = generator(seed)
        window = _randint(gen, 1, block_size + 3)
        layer = self._gqa_layer(*self._gqa_heads(subject.provided), sliding_window=window)
        pair = self._pair(subject, layer, dtype, block_size)
        batch = _make_batch(lengths_of(block_size, gen), block_size, gen, shuffle=True)
        what = f"sliding window {window}, {scenario} batch, {_dtype_id(dtype)}"
        self._run_gqa(pair, layer, batch, dtype, block_size, seed, what)

    @pytest.mark.parametrize("scenario", ["block", "verify"])
    @pytest.mark.parametrize("windowed", [False, True], ids=["full", "window"])
    def test_non_causal(
        self, subject: Subject, scenario: str, windowed: bool, dtype: torch.dtype, block_size: int, seed: int
    ) -> None:
        """A block drafter's layer (``causal`` False): each new token sees every key of its
        sequence, this step's later tokens too; with a window, the window before the step's
        first new token and every new token."""
        lengths_of, capabilities = _SCENARIOS[scenario]
        needed = ("non-causal", "paged", *capabilities, *(("sliding-window",) if windowed else ()))
        self.require(subject.provided, *needed)
        gen = generator(seed)
        window = _randint(gen, 2, block_size + 3) if windowed else None
        layer = self._gqa_layer(*self._gqa_heads(subject.provided), sliding_window=window, causal=False)
        pair = self._pair(subject, layer, dtype, block_size)
        batch = _make_batch(lengths_of(block_size, gen), block_size, gen, shuffle=True)
        what = f"non-causal, window {window}, {scenario} batch, {_dtype_id(dtype)}"
        self._run_gqa(pair, layer, batch, dtype, block_size, seed, what)

    @pytest.mark.parametrize("scenario", ["mixed", "chunked"])
    def test_sliding_window_over_released_blocks(
        self, subject: Subject, scenario: str, dtype: torch.dtype, block_size: int, seed: int
    ) -> None:
        """The engine gives back the blocks a sliding window has left: their table entries
        then point at a zeroed null block, which the backend may read only under its mask.
        The context tokens in them are gone from the tables; the answer must not change."""
        lengths_of, capabilities = _SCENARIOS[scenario]
        self.require(subject.provided, "sliding-window", "paged", *capabilities)
        gen = generator(seed)
        window = _randint(gen, 1, 2 * block_size)
        layer = self._gqa_layer(*self._gqa_heads(subject.provided), sliding_window=window)
        pair = self._pair(subject, layer, dtype, block_size)
        batch = _make_batch(lengths_of(block_size, gen), block_size, gen, shuffle=True)
        what = f"sliding window {window} over released blocks, {scenario} batch, {_dtype_id(dtype)}"
        self._run_gqa(pair, layer, batch, dtype, block_size, seed, what, release=True)

    @pytest.mark.parametrize("scenario", ["mixed", "verify"])
    @pytest.mark.parametrize("partial", [False, True], ids=["full-rotary", "partial-rotary"])
    def test_fused_rotary(
        self,
        subject: Subject,
        scenario: str,
        partial: bool,
        dtype: torch.dtype,
        block_size: int,
        seed: int,
    ) -> None:
        """forward_rotary equals rotating query and key in torch and then attending; the
        cache holds the rotated keys."""
        lengths_of, capabilities = _SCENARIOS[scenario]
        self.require(subject.provided, "fused-rotary", "paged", *capabilities)
        layer = self._gqa_layer(*self._gqa_heads(subject.provided))
        pair = self._pair(subject, layer, dtype, block_size)
        assert isinstance(pair.candidate, RotaryAttentionBackend), (
            f"{subject.provided.record.name} declares fused-rotary but has no forward_rotary"
        )
        gen = generator(seed)
        batch = _make_batch(lengths_of(block_size, gen), block_size, gen, shuffle=True)
        rotary_dim = layer.head_size // 2 if partial else layer.head_size
        what = f"fused rotary over {rotary_dim} of {layer.head_size} dims, {scenario} batch, {_dtype_id(dtype)}"
        self._run_gqa(pair, layer, batch, dtype, block_size, seed, what, rotary_dim=rotary_dim)

    @pytest.mark.parametrize("scenario", ["mixed", "verify"])
    def test_kv_store(self, subject: Subject, scenario: str, dtype: torch.dtype, block_size: int, seed: int) -> None:
        """store_kv leaves the cache exactly as forward leaves it (the step's keys and values
        at their slots, every other slot untouched), and attends nothing."""
        lengths_of, capabilities = _SCENARIOS[scenario]
        self.require(subject.provided, "kv-store", "paged", *capabilities)
        layer = self._gqa_layer(*self._gqa_heads(subject.provided))
        pair = self._pair(subject, layer, dtype, block_size)
        assert isinstance(pair.candidate, KVStoreAttentionBackend), (
            f"{subject.provided.record.name} declares kv-store but has no store_kv"
        )
        gen = generator(seed)
        batch = _make_batch(lengths_of(block_size, gen), block_size, gen, shuffle=True)
        num_tokens = sum(batch.query_lens)
        kv_shape = (layer.num_kv_heads, layer.head_size)
        query = _random((num_tokens, layer.num_heads, layer.head_size), gen, dtype).to(pair.device)
        key = _random((num_tokens, *kv_shape), gen, dtype)
        value = _random((num_tokens, *kv_shape), gen, dtype)
        context_slots = batch.context_slots(block_size)
        context = {name: _random((len(context_slots), *kv_shape), gen, dtype) for name in ("key", "value")}
        stored, _ = _prepared_caches(pair, batch, context_slots, context, gen)
        before = {name: t.clone() for name, t in stored.items()}
        attended = {name: t.clone() for name, t in stored.items()}
        meta = batch.metadata(block_size, pair.device)
        where = f"store_kv, {scenario} batch, {_dtype_id(dtype)}; query_lens={batch.query_lens} (seed={seed})"
        assert pair.candidate.store_kv(layer, key.to(pair.device), value.to(pair.device), stored, meta) is None, where
        pair.candidate.forward(layer, query, key.to(pair.device), value.to(pair.device), attended, meta)
        for name in stored:
            assert torch.equal(stored[name].cpu(), attended[name].cpu()), (
                f"cache {name!r} differs from forward's: {where}"
            )
        _check_cache_writes(
            pair.candidate_spec,
            before,
            stored,
            batch.metadata(block_size, "cpu").slot_mapping,
            {"key": key, "value": value},
            where,
        )

    @pytest.mark.parametrize("hidden", [96, 200])
    @pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
    def test_fused_rmsnorm(
        self, subject: Subject, hidden: int, with_residual: bool, dtype: torch.dtype, seed: int
    ) -> None:
        """rms_norm equals layers.norm.RMSNorm, with and without the residual add."""
        self.require(subject.provided, "fused-rmsnorm")
        candidate, _, device = self._build(subject, dtype, self.block_sizes[-1])
        assert isinstance(candidate, RMSNormKernel), f"{subject.provided.record.name} declares fused-rmsnorm"
        gen = generator(seed)
        tokens = _randint(gen, 1, 37)
        x = _random((tokens, hidden), gen, dtype)
        residual = _random((tokens, hidden), gen, dtype) if with_residual else None
        reference = RMSNorm(hidden, eps=1e-5).to(dtype)
        with torch.no_grad():
            reference.weight.copy_(_random((hidden,), gen, dtype))
        where = f"rms_norm of {tokens}x{hidden} {_dtype_id(dtype)}, residual={with_residual} (seed={seed})"
        got = candidate.rms_norm(
            x.to(device),
            reference.weight.detach().to(device),
            reference.eps,
            None if residual is None else residual.to(device),
        )
        with torch.no_grad():
            want = reference(x, residual)
        if residual is None:
            got, want = (got,), (want,)
        assert isinstance(got, tuple) and len(got) == len(want), f"rms_norm returned {type(got).__name__}: {where}"
        atol, rtol = self.tolerances[dtype]
        for name, g, w in zip(("normed", "sum"), got, want, strict=False):
            assert g.dtype == dtype and tuple(g.shape) == (tokens, hidden), (
                f"{name}: {g.dtype} {tuple(g.shape)}: {where}"
            )
            torch.testing.assert_close(
                g.detach().cpu().float(),
                w.float(),
                atol=atol,
                rtol=rtol,
                msg=lambda detail, name=name: f"{name} differs from RMSNorm: {where}\n{detail}",
            )

    def test_fused_decoder(self, subject: Subject, seed: int) -> None:
        """fuse_decoder's stack equals the model's layers one by one (``testing.fused_decoder``),
        with projections kept quantised where a quantised-linear kernel runs here."""
        self.require(subject.provided, "fused-decoder")
        candidate, _, _ = self._build(subject, torch.float32, self.block_sizes[0])
        name = subject.provided.record.name
        why = check_fused_decoder(candidate, self._quantized_linear(subject), seed, name)
        if why is not None:
            # Not a failure: a pack may fuse only weights kept for its own quantised-linear
            # kernel, and none may be available on this machine (check_fused_decoder has
            # already checked that the decline gives a reason). The skip names it.
            pytest.skip(f"{name} declined the kit's model: {why}")

    def _quantized_linear(self, subject: Subject) -> QuantizedLinearKernel | None:
        """``fused_decoder_quantized_linear``, else the highest-priority quantised-linear
        kernel available on the subject's platform, else None."""
        records = sorted(subject.plugins.records("quantized_linear"), key=lambda p: -p.record.priority)
        for provided in records:
            record = provided.record
            if self.fused_decoder_quantized_linear not in (None, record.name):
                continue
            if record.availability(subject.platform).available:
                context = QuantizedLinearContext(
                    platform=subject.platform, device=torch.device(subject.platform.device_type), dtype=torch.float32
                )
                return record.factory(context)
        return None

    @pytest.mark.parametrize("scenario", ["mixed", "chunked"])
    def test_mla(
        self,
        subject: Subject,
        scenario: str,
        dtype: torch.dtype,
        block_size: int,
        seed: int,
    ) -> None:
        """forward_mla over the latent cache: decodes + prefills, and chunks after cached tokens."""
        lengths_of, capabilities = _SCENARIOS[scenario]
        self.require(subject.provided, "mla", "paged", *capabilities)
        layer = self._mla_layer()
        pair = self._pair(subject, layer, dtype, block_size)
        gen = generator(seed)
        batch = _make_batch(lengths_of(block_size, gen), block_size, gen, shuffle=True)
        self._run_mla(pair, layer, batch, dtype, block_size, seed, f"MLA {scenario} batch, {_dtype_id(dtype)}")

    @pytest.mark.parametrize("kind", ["gqa", "mla"])
    def test_cuda_graphs(self, subject: Subject, kind: str, seed: int) -> None:
        """A declared 'cuda-graphs' backend serves a decode step shaped as a captured one
        (padded with one-token sequences over a reserved block, host lengths at a bound):
        the real rows as the step's own metadata gives them, the cache written alike; where
        the platform captures CUDA graphs, also captured, replayed with another step, equal
        to eager bit for bit
        (``powertrain.testing.graphs``). First dtype and largest block size only."""
        self.require(subject.provided, "cuda-graphs", "paged", "decode", *(("mla",) if kind == "mla" else ()))
        dtype, block_size = self.dtypes[0], max(self.block_sizes)
        layer = self._mla_layer() if kind == "mla" else self._gqa_layer(*self._gqa_heads(subject.provided))
        candidate, _, device = self._build(subject, dtype, block_size)
        check_captured_attention(
            candidate,
            layer,
            candidate.kv_cache_spec(layer, block_size, dtype),
            block_size=block_size,
            dtype=dtype,
            device=device,
            seed=seed,
            tolerance=self.tolerances[dtype],
            capture=subject.platform.cuda_graphs,
            what=f"{subject.provided.record.name} {kind} captured decode, {_dtype_id(dtype)}",
        )

    @pytest.mark.parametrize("target", ["decode", "chunk"])
    @pytest.mark.parametrize("kind", ["gqa", "mla", "sparse-mla"])
    def test_batch_invariant(
        self, subject: Subject, kind: str, target: str, dtype: torch.dtype, block_size: int, seed: int
    ) -> None:
        """A declared 'batch-invariant' backend gives a sequence's rows the same bits alone
        and at a random place in a batch of 16 (other blocks, other neighbours): a decode
        row, or a chunk of new tokens after a cached context; sparse MLA over random index
        rows (-1 padded, some empty)."""
        capabilities = {"gqa": (), "mla": ("mla",), "sparse-mla": ("sparse-mla",)}[kind]
        self.require(subject.provided, "batch-invariant", "paged", "decode", "prefill", *capabilities)
        mla = kind != "gqa"
        layer = self._mla_layer() if mla else self._gqa_layer(*self._gqa_heads(subject.provided))
        pair = self._pair(subject, layer, dtype, block_size)
        gen = generator(seed)
        context = int(torch.randint(1, 3 * block_size + 2, (1,), generator=gen))
        lengths = (context, 1) if target == "decode" else (context, int(torch.randint(2, 12, (1,), generator=gen)))
        check_batch_invariant(
            pair.candidate,
            layer,
            pair.candidate_spec,
            target=lengths,
            block_size=block_size,
            dtype=dtype,
            seed=seed,
            device=pair.device,
            sparse_topk=9 if kind == "sparse-mla" else None,
            what=f"{kind.upper()} {target}, {_dtype_id(dtype)}",
        )

    def _sparse_candidate(self, subject: Subject, dtype: torch.dtype, block_size: int) -> tuple[Any, torch.device]:
        candidate, _, device = self._build(subject, dtype, block_size)
        assert isinstance(candidate, SparseMLAAttentionBackend), (
            f"{subject.provided.record.name} declares sparse-mla, but its factory returned {candidate!r}, "
            "which has no forward_mla_sparse (SparseMLAAttentionBackend)"
        )
        return candidate, device

    @pytest.mark.parametrize("scenario", ["decode", "mixed", "verify"])
    def test_sparse_mla(
        self,
        subject: Subject,
        scenario: str,
        dtype: torch.dtype,
        block_size: int,
        seed: int,
    ) -> None:
        """forward_mla_sparse against the float64 oracle: ragged batches (decodes first,
        prefills, tokens after a cached context, block edges), random duplicate-free
        index sets with -1 padding, rows all -1 and rows with every position."""
        lengths_of, capabilities = _SCENARIOS[scenario]
        self.require(subject.provided, "sparse-mla", "paged", *capabilities)
        candidate, device = self._sparse_candidate(subject, dtype, block_size)
        gen = generator(seed)
        check_sparse_mla(
            candidate,
            layer=self._mla_layer(),
            lengths=lengths_of(block_size, gen),
            block_size=block_size,
            dtype=dtype,
            seed=seed,
            device=device,
            tolerance=self.tolerances[dtype],
            what=f"sparse MLA {scenario} batch, {_dtype_id(dtype)}",
        )

    @pytest.mark.parametrize("where", ["decode", "prefill", "below-minus-one"])
    def test_sparse_mla_refuses_out_of_range(self, subject: Subject, where: str, dtype: torch.dtype, seed: int) -> None:
        """An index past its sequence's length (or below -1) is a ValueError naming the row,
        the index and the length, raised before any output; the cache keeps its
        context (only this step's slots may have been written)."""
        self.require(subject.provided, "sparse-mla", "paged", "decode", "prefill")
        block_size = self.block_sizes[0]
        candidate, device = self._sparse_candidate(subject, dtype, block_size)
        gen = generator(seed)
        check_sparse_mla_refuses(
            candidate,
            layer=self._mla_layer(),
            lengths=_mixed_lengths(block_size, gen),
            block_size=block_size,
            dtype=dtype,
            seed=seed,
            device=device,
            bad_row=where,
        )

    def _v4_candidate(self, subject: Subject, dtype: torch.dtype, block_size: int) -> tuple[Any, torch.device]:
        candidate, _, device = self._build(subject, dtype, block_size)
        assert isinstance(candidate, V4AttentionBackend), (
            f"{subject.provided.record.name} declares v4-attention, but its factory returned {candidate!r}, "
            "which has no forward_v4 (V4AttentionBackend)"
        )
        return candidate, device

    @pytest.mark.parametrize("kind", V4_LAYER_KINDS)
    @pytest.mark.parametrize("scenario", ["decode", "mixed", "verify"])
    def test_v4_attention(
        self, subject: Subject, kind: str, scenario: str, dtype: torch.dtype, block_size: int, seed: int
    ) -> None:
        """forward_v4 against the float64 oracle: a sliding window across block edges over
        garbage-filled pages, sinks, and every closed (HCA) or listed (CSA, -1 padding,
        rows of none and of all) compressed entry. The mixed and verify batches also ask
        for the output de-rotated on 16 trailing dims (``derotate``), as V4's layer does;
        the decode batch for it as it is."""
        lengths_of, capabilities = _SCENARIOS[scenario]
        self.require(subject.provided, "v4-attention", *capabilities)
        candidate, device = self._v4_candidate(subject, dtype, block_size)
        check_v4_attention(
            candidate,
            kind=kind,
            lengths=lengths_of(block_size, generator(seed)),
            block_size=block_size,
            dtype=dtype,
            seed=seed,
            device=device,
            tolerance=self.tolerances[dtype],
            rope_pairs=0 if scenario == "decode" else 8,
            what=f"{scenario} batch, {_dtype_id(dtype)}",
        )

    @pytest.mark.parametrize("kind", ["hca", "csa"])
    def test_v4_attention_over_entries_another_layer_owns(
        self, subject: Subject, kind: str, dtype: torch.dtype, seed: int
    ) -> None:
        """Cache sharing (DeepSeek-V4.1: ``CacheGroupSpec.read_from``): two layers of a mixed
        step read one compressed cache tensor, each through its own window, queries and picks;
        both match the oracle and neither writes the shared entries."""
        self.require(subject.provided, "v4-attention", "decode", "prefill")
        block_size = self.block_sizes[0]
        candidate, device = self._v4_candidate(subject, dtype, block_size)
        check_v4_attention_shared_entries(
            candidate,
            kind=kind,
            lengths=_mixed_lengths(block_size, generator(seed)),
            block_size=block_size,
            dtype=dtype,
            seed=seed,
            device=device,
            tolerance=self.tolerances[dtype],
        )

    @pytest.mark.parametrize("where", ["decode", "prefill", "below-minus-one"])
    def test_v4_attention_refuses_out_of_range(
        self, subject: Subject, where: str, dtype: torch.dtype, seed: int
    ) -> None:
        """A CSA entry past its sequence's closed entries (or below -1) is a ValueError
        naming the row, the entry and the length."""
        self.require(subject.provided, "v4-attention", "decode", "prefill")
        block_size = self.block_sizes[0]
        candidate, device = self._v4_candidate(subject, dtype, block_size)
        check_v4_attention_refuses(
            candidate,
            lengths=_mixed_lengths(block_size, generator(seed)),
            block_size=block_size,
            dtype=dtype,
            seed=seed,
            device=device,
            bad_row=where,
        )

    @pytest.mark.parametrize("tokens_per_entry", [1, 4], ids=["per-token", "per-4-tokens"])
    @pytest.mark.parametrize("scenario", ["decode", "mixed", "verify"])
    def test_index_topk(
        self, subject: Subject, scenario: str, tokens_per_entry: int, dtype: torch.dtype, block_size: int, seed: int
    ) -> None:
        """index_topk against the float64 oracle: per-token keys (V3.2) and one per 4 tokens
        (V4's CSA) over a garbage-filled paged cache, rows with fewer visible keys than topk."""
        lengths_of, capabilities = _SCENARIOS[scenario]
        self.require(subject.provided, "lightning-indexer", *capabilities)
        candidate, _, device = self._build(subject, dtype, block_size)
        assert isinstance(candidate, LightningIndexerBackend), (
            f"{subject.provided.record.name} declares lightning-indexer, but its factory returned {candidate!r}, "
            "which has no index_topk (LightningIndexerBackend)"
        )
        check_index_topk(
            candidate,
            lengths=lengths_of(block_size, generator(seed)),
            block_size=block_size,
            dtype=dtype,
            seed=seed,
            device=device,
            tokens_per_entry=tokens_per_entry,
            num_heads=self.index_heads,
            head_dim=self.index_head_dim,
            relative_tolerance=self.index_tolerance,
            what=f"{scenario} batch, {_dtype_id(dtype)}",
        )


# --------------------------------------------------------------------------- checks


def _check_spec(spec: KVCacheSpec, layer: AttentionLayerSpec, block_size: int, dtype: torch.dtype, who: str) -> None:
    """The spec must describe the cache the suite (and the engine) will hand back."""
    assert isinstance(spec, KVCacheSpec), f"{who}.kv_cache_spec returned {spec!r}, not a KVCacheSpec"
    assert spec.block_size == block_size, f"{who}: spec block_size {spec.block_size}, asked for {block_size}"
    assert spec.dtype == dtype, f"{who}: spec dtype {spec.dtype}, asked for {dtype}"
    if layer.kind == "mla":
        expected = {"latent": layer.kv_lora_rank, "rope": layer.qk_rope_head_dim}
    else:
        expected = {"key": layer.num_kv_heads * layer.head_size, "value": layer.num_kv_heads * layer.head_size}
    declared = {t.name: math.prod(t.shape) for t in spec.tensors}
    assert declared == expected, (
        f"{who}: a {layer.kind} cache must hold tensors (name: elements per token) {expected}, "
        f"the spec declares {declared}"
    )


def _prepared_caches(
    pair: _Pair,
    batch: _Batch,
    context_slots: torch.Tensor,
    context: Mapping[str, torch.Tensor],
    gen: torch.Generator,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Both caches, full of unrelated random garbage except the identical context tokens.

    The garbage differs between the two, so a backend reading a slot it should not
    (past a sequence's end, an unused block) gives a different answer.
    """
    caches = []
    for spec, device in ((pair.candidate_spec, pair.device), (pair.reference_spec, torch.device("cpu"))):
        cache = spec.allocate(batch.num_blocks, device)
        for tensor in cache.values():
            tensor.copy_(_random(tensor.shape, gen, spec.dtype))
        for name, values in context.items():
            write_tokens(spec, cache, name, context_slots, values)
        caches.append(cache)
    return caches[0], caches[1]


def _check_cache_writes(
    spec: KVCacheSpec,
    before: Mapping[str, torch.Tensor],
    after: Mapping[str, torch.Tensor],
    slots: torch.Tensor,
    new: Mapping[str, torch.Tensor],
    where: str,
    tolerance: tuple[float, float] | None = None,
) -> None:
    """``after`` must be ``before`` with exactly the new tokens written at ``slots``
    (the new tokens to ``(atol, rtol)`` where a ``tolerance`` is given)."""
    for name, values in new.items():
        expected = {name: before[name].clone()}
        write_tokens(spec, expected, name, slots, values)
        want = token_major(spec, expected[name]).cpu()
        got = token_major(spec, after[name]).detach().cpu()
        if tolerance is None:
            differs = got != want
        else:
            atol, rtol = tolerance
            differs = (got.float() - want.float()).abs() > atol + rtol * want.float().abs()
        wrong = differs.flatten(2).any(-1).nonzero().tolist()
        if wrong:
            bad_slots = [block * spec.block_size + offset for block, offset in wrong]
            new_slots = set(slots.tolist())
            misplaced = [s for s in bad_slots if s not in new_slots]
            pytest.fail(
                f"cache tensor {name!r} is wrong at {len(bad_slots)} slots after forward "
                f"(first: {bad_slots[:8]}; {len(misplaced)} of them are not this step's slots, so were "
                f"overwritten): {where}"
            )


# --------------------------------------------------------------------------- sparse MLA


@attrs.frozen(kw_only=True)
class _SparseCase:
    """One sparse-MLA step: the batch, its inputs, the dense histories the oracle reads
    and the candidate's cache prepared with the context tokens."""

    batch: _Batch
    spec: KVCacheSpec
    cache: dict[str, torch.Tensor]
    q_latent: torch.Tensor
    q_rope: torch.Tensor
    new: dict[str, torch.Tensor]
    #: per sequence, name -> [seq_len, width]: context then new tokens
    history: list[dict[str, torch.Tensor]]
    indices: torch.Tensor  # int32 [num_tokens, topk], on the CPU


def _sparse_case(
    backend: Any,
    layer: AttentionLayerSpec,
    lengths: Sequence[tuple[int, int]],
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    gen: torch.Generator,
    topk: int,
) -> _SparseCase:
    batch = _make_batch(lengths, block_size, gen, shuffle=True)
    spec = backend.kv_cache_spec(layer, block_size, dtype)
    _check_spec(spec, layer, block_size, dtype, getattr(backend, "name", type(backend).__name__))
    num_tokens = sum(batch.query_lens)
    widths = {"latent": layer.kv_lora_rank, "rope": layer.qk_rope_head_dim}
    context_slots = batch.context_slots(block_size)
    context = {name: _random((len(context_slots), w), gen, dtype) for name, w in widths.items()}
    new = {name: _random((num_tokens, w), gen, dtype) for name, w in widths.items()}
    cache = spec.allocate(batch.num_blocks, device)
    for tensor in cache.values():
        # Random garbage, not zeros: a read of the wrong slot changes the answer.
        tensor.copy_(_random(tensor.shape, gen, spec.dtype))
    for name, values in context.items():
        write_tokens(spec, cache, name, context_slots, values)
    contexts = {name: values.split(batch.context_lens) for name, values in context.items()}
    news = {name: values.split(batch.query_lens) for name, values in new.items()}
    history = [
        {name: torch.cat([contexts[name][i], news[name][i]]) for name in widths} for i in range(len(batch.query_lens))
    ]
    return _SparseCase(
        batch=batch,
        spec=spec,
        cache=cache,
        q_latent=_random((num_tokens, layer.num_heads, layer.kv_lora_rank), gen, dtype),
        q_rope=_random((num_tokens, layer.num_heads, layer.qk_rope_head_dim), gen, dtype),
        new=new,
        history=history,
        indices=random_index_rows(batch.seq_lens, batch.query_lens, topk, gen),
    )


def _sparse_oracle(layer: AttentionLayerSpec, case: _SparseCase) -> torch.Tensor:
    """Dense MLA per sequence in float64, each query row masked to the positions its
    indices list (a row listing none gives zeros). Knows nothing of paging."""
    out = torch.zeros(case.q_latent.shape, dtype=torch.float64)
    starts = [0, *itertools.accumulate(case.batch.query_lens)]
    for i, seq in enumerate(case.history):
        start, end = starts[i], starts[i + 1]
        seq_len = seq["latent"].shape[0]
        rows = case.indices[start:end].long()
        mask = torch.zeros((end - start, seq_len + 1), dtype=torch.bool)
        mask.scatter_(1, torch.where(rows < 0, seq_len, rows), True)  # -1 lands in a spare column
        mask = mask[:, :seq_len]
        latent, rope = seq["latent"].double(), seq["rope"].double()
        q_latent = case.q_latent[start:end].double().transpose(0, 1)  # [heads, q, rank]
        q_rope = case.q_rope[start:end].double().transpose(0, 1)
        scores = layer.scale * (q_latent @ latent.T + q_rope @ rope.T)  # [heads, q, seq_len]
        scores = scores.masked_fill(~mask, float("-inf"))
        exp = torch.where(mask, torch.exp(scores - scores.amax(-1, keepdim=True).nan_to_num(0.0)), 0.0)
        total = exp.sum(-1, keepdim=True)
        probs = torch.where(total > 0, exp / total.clamp(min=1e-300), 0.0)
        out[start:end] = (probs @ latent).transpose(0, 1)
    return out


def check_sparse_mla(
    backend: Any,
    *,
    layer: AttentionLayerSpec,
    lengths: Sequence[tuple[int, int]],
    block_size: int,
    dtype: torch.dtype,
    seed: int,
    tolerance: tuple[float, float],
    device: torch.device | str = "cpu",
    topk: int | None = None,
    what: str = "sparse MLA",
) -> None:
    """Run ``backend.forward_mla_sparse`` on one random step and assert it matches the
    float64 oracle and wrote exactly the new tokens (AssertionError otherwise).

    ``lengths`` are ``(context_len, query_len)`` per sequence, decodes first; ``topk``
    defaults to ``2 * block_size + 3``, so short sequences pad their rows and long ones
    pick a subset spread over several blocks.
    """
    gen = generator(seed)
    topk = 2 * block_size + 3 if topk is None else topk
    case = _sparse_case(backend, layer, lengths, block_size, dtype, device, gen, topk)
    batch = case.batch
    where = (
        f"{what}; context_lens={batch.context_lens} query_lens={batch.query_lens} topk={topk} "
        f"block_size={block_size} (seed={seed})"
    )
    before = {name: t.clone() for name, t in case.cache.items()}
    metadata = batch.metadata(block_size, device)
    got = backend.forward_mla_sparse(
        layer,
        case.q_latent.to(device),
        case.q_rope.to(device),
        case.new["latent"].to(device),
        case.new["rope"].to(device),
        case.cache,
        metadata,
        case.indices.to(device),
    )
    metadata.raise_refused()  # nothing in range is refused (a backend may refuse on the device)
    shape = tuple(case.q_latent.shape)
    assert isinstance(got, torch.Tensor), f"forward_mla_sparse returned {type(got).__name__}, not a tensor: {where}"
    assert tuple(got.shape) == shape, f"output shape {tuple(got.shape)}, expected {shape}: {where}"
    assert got.dtype == dtype, f"output dtype {got.dtype}, expected the query's {dtype}: {where}"
    want = _sparse_oracle(layer, case)
    atol, rtol = tolerance
    torch.testing.assert_close(
        got.detach().cpu().double(),
        want,
        atol=atol,
        rtol=rtol,
        msg=lambda detail: f"sparse MLA output differs from the float64 oracle: {where}\n{detail}",
    )
    slots = batch.metadata(block_size, "cpu").slot_mapping
    _check_cache_writes(case.spec, before, case.cache, slots, case.new, where)


def check_sparse_mla_refuses(
    backend: Any,
    *,
    layer: AttentionLayerSpec,
    lengths: Sequence[tuple[int, int]],
    block_size: int,
    dtype: torch.dtype,
    seed: int,
    device: torch.device | str = "cpu",
    bad_row: str = "prefill",
) -> None:
    """Plant one bad index (past its sequence's length in a ``decode`` or ``prefill`` row,
    or ``below-minus-one``) and assert ``forward_mla_sparse`` raises a ValueError naming
    the row, the index and the length (or refuses it on the device, raised by
    ``metadata.raise_refused()`` as the runner does), with no cached token but this
    step's changed.

    ``lengths`` must hold a decode (first) and a prefill (last) sequence.
    """
    gen = generator(seed)
    case = _sparse_case(backend, layer, lengths, block_size, dtype, device, gen, 2 * block_size + 3)
    batch = case.batch
    assert batch.query_lens[0] == 1 and batch.query_lens[-1] > 1, f"need a decode first and a prefill last: {lengths}"
    starts = [0, *itertools.accumulate(batch.query_lens)]
    if bad_row == "decode":
        sequence, row = 0, 0
    else:
        sequence = len(batch.query_lens) - 1
        row = _randint(gen, starts[sequence], starts[sequence + 1] - 1)
    seq_len = batch.seq_lens[sequence]
    bad = -2 - _randint(gen, 0, 5) if bad_row == "below-minus-one" else seq_len + _randint(gen, 0, 3)
    indices = case.indices.clone()
    indices[row, _randint(gen, 0, indices.shape[1] - 1)] = bad
    where = (
        f"index {bad} in query row {row} of a sequence of {seq_len} tokens ({bad_row}); "
        f"context_lens={batch.context_lens} query_lens={batch.query_lens} (seed={seed})"
    )
    before = {name: t.clone() for name, t in case.cache.items()}
    metadata = batch.metadata(block_size, device)
    with pytest.raises(ValueError) as refused:
        backend.forward_mla_sparse(
            layer,
            case.q_latent.to(device),
            case.q_rope.to(device),
            case.new["latent"].to(device),
            case.new["rope"].to(device),
            case.cache,
            metadata,
            indices.to(device),
        )
        metadata.raise_refused()  # a backend that refuses on the device: raised once the step ran
    assert_names_numbers(str(refused.value), ((row, "row"), (bad, "index"), (seq_len, "length")), where)
    # Only this step's own slots may have been written (a fused kernel writes them first).
    slots = set(batch.metadata(block_size, "cpu").slot_mapping.tolist())
    for name, tensor in case.cache.items():
        changed = (token_major(case.spec, tensor).cpu() != token_major(case.spec, before[name]).cpu()).flatten(2)
        touched = [b * block_size + o for b, o in changed.any(-1).nonzero().tolist()]
        stray = [slot for slot in touched if slot not in slots]
        assert not stray, f"refused step still changed {name!r} at slots {stray[:8]}: {where}"

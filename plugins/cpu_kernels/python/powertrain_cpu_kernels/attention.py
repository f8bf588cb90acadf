"""``NativePagedAttention`` (``cpu-paged``): ``torch-bucketed`` with its short rows, and the
rotary embedding with the cache write, in Rust.

Decodes, verifications and short chunks (at most ``SHORT_QUERY`` new tokens) attend in one
native call per layer: each (sequence, kv head) pair reads its keys and values straight
from the paged cache, with no gathered copy, padding bucket or mask (``src/attention.rs``).
Long prefill rows keep ``scaled_dot_product_attention`` per sequence, which is matmul-bound
and which a hand-written loop would not beat. The kernels take float32 and bfloat16
(widened as they read, computed in float32, rounded where torch rounds); other dtypes, or a
cache on another device, take the plain-torch path of the parent class.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

import powertrain_cpu_kernels._native as _native
from powertrain.builtin.bucketed_attention import SHORT_QUERY, BucketedAttention
from powertrain.interfaces import AttentionLayerSpec, AttentionMetadata, DecoderLayerParts, FusedDecoder, LayerKVCache
from powertrain.layers.norm import rms_norm
from powertrain.layers.rotary import apply_rotary
from powertrain_cpu_kernels.threads import openmp_team, use_threads

#: What the kernels read and write.
KERNEL_DTYPES = (torch.float32, torch.bfloat16)


class NativePagedAttention(BucketedAttention):
    """``threads``: the native kernels' threads, the calling one included (default: torch's
    thread count when built); the pool is shared with ``NativeQuantizedLinear``."""

    name = "cpu-paged"

    def __init__(self, threads: int | None = None) -> None:
        super().__init__()
        self.threads = torch.get_num_threads() if threads is None else max(1, threads)
        # The step being run and its tensors as the kernel takes them (see _step_tensors).
        self._rows: tuple[AttentionMetadata | None, tuple[torch.Tensor, ...]] = (None, ())

    def _short(
        self,
        layer: AttentionLayerSpec,
        query: torch.Tensor,  # [tokens, heads, dim]
        key_cache: torch.Tensor,  # [blocks, block_size, kv_heads, dim]
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
        output: torch.Tensor,  # [tokens, heads, dim]: the short rows' tokens are written
    ) -> None:
        dtype = query.dtype
        native = dtype in KERNEL_DTYPES and all(t.dtype == dtype and t.is_cpu for t in (key_cache, value_cache, output))
        # The kernel masks causally: a non-causal layer (a block drafter's) takes plain torch.
        if not (native and layer.causal and output.is_contiguous() and output.shape == query.shape):
            super()._short(layer, query, key_cache, value_cache, metadata, output)
            return
        rows, tables, starts, seq_lens = self._step_tensors(metadata)
        if not rows.numel():
            return
        query = query.contiguous()
        key_cache, value_cache = key_cache.contiguous(), value_cache.contiguous()
        tokens, heads, dim = query.shape
        use_threads(self.threads)
        _native.paged_attention(
            query.data_ptr(),
            key_cache.data_ptr(),
            value_cache.data_ptr(),
            tables.data_ptr(),
            starts.data_ptr(),
            seq_lens.data_ptr(),
            rows.data_ptr(),
            output.data_ptr(),
            tokens,
            heads,
            layer.num_kv_heads,
            dim,
            key_cache.shape[0],
            key_cache.shape[1],
            tables.shape[0],
            tables.shape[1],
            rows.numel(),
            layer.scale,
            layer.sliding_window or 0,
            *self._where_to_run(),
            dtype == torch.bfloat16,
        )

    @staticmethod
    def _where_to_run() -> tuple[bool, int]:
        """(whether the package's pool may run the pairs, the OpenMP team to run them on
        instead): see ``openmp_team``. Where torch runs on several threads and its runtime
        cannot be reached, the pairs stay on the calling thread."""
        return torch.get_num_threads() == 1, openmp_team()

    def forward_rotary(
        self,
        layer: AttentionLayerSpec,
        query: torch.Tensor,  # [tokens, heads, dim], not yet rotated
        key: torch.Tensor,  # [tokens, kv_heads, dim], not yet rotated
        value: torch.Tensor,
        cos: torch.Tensor,  # [tokens, rotary_dim // 2]
        sin: torch.Tensor,
        kv_cache: LayerKVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Rotary, the cache write and the short rows' attention in two native calls, instead
        of about a dozen small torch ops per layer (``src/rotary.rs``)."""
        key_cache, value_cache = kv_cache["key"], kv_cache["value"]
        tensors = (query, key, value, cos, sin, key_cache, value_cache)
        tokens, heads, dim = query.shape
        per_token = (layer.num_kv_heads, dim)
        if not (
            query.dtype in KERNEL_DTYPES
            and all(t.dtype == query.dtype and t.is_cpu for t in tensors)
            and key.shape == value.shape == (tokens, *per_token)
            and cos.shape == sin.shape == (tokens, cos.shape[-1])
            and key_cache.is_contiguous()
            and value_cache.is_contiguous()
            and key_cache.shape == value_cache.shape
            and key_cache.shape[1:] == (metadata.block_size, *per_token)
            and metadata.slot_mapping.dtype == torch.int64
        ):  # plain torch, which also raises the contract's errors
            query, key = apply_rotary(query, cos, sin), apply_rotary(key, cos, sin)
            return self.forward(layer, query, key, value, kv_cache, metadata)
        query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
        cos, sin = cos.contiguous(), sin.contiguous()
        slots = metadata.slot_mapping.contiguous()
        rotated = torch.empty_like(query)
        _native.rotary_store(
            query.data_ptr(),
            key.data_ptr(),
            value.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            slots.data_ptr(),
            rotated.data_ptr(),
            key_cache.data_ptr(),
            value_cache.data_ptr(),
            tokens,
            metadata.num_tokens,
            heads,
            layer.num_kv_heads,
            dim,
            cos.shape[-1],
            key_cache.shape[0] * key_cache.shape[1],
            query.dtype == torch.bfloat16,
        )
        return self._attend(layer, rotated, key_cache, value_cache, metadata)

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``layers.norm.RMSNorm`` (the ``fused-rmsnorm`` capability) in one native pass per
        row, with the residual add (``src/norm.rs``): about eight small torch ops per norm
        otherwise, two norms per layer. Inputs it does not take (neither float32 nor bfloat16, not on the CPU,
        not ``[rows, hidden]``) go through the plain-torch reference."""
        tensors = (x, weight) if residual is None else (x, weight, residual)
        if not (
            x.dtype in KERNEL_DTYPES
            and all(t.dtype == x.dtype and t.is_cpu for t in tensors)
            and x.dim() == 2
            and weight.shape == x.shape[1:]
            and (residual is None or residual.shape == x.shape)
        ):
            return rms_norm(x, weight, eps, residual)
        x, weight = x.contiguous(), weight.contiguous()
        normed, bf16 = torch.empty_like(x), x.dtype == torch.bfloat16
        if residual is None:
            _native.rms_norm(x.data_ptr(), 0, weight.data_ptr(), normed.data_ptr(), 0, *x.shape, eps, bf16)
            return normed
        residual, total = residual.contiguous(), torch.empty_like(x)
        _native.rms_norm(
            x.data_ptr(),
            residual.data_ptr(),
            weight.data_ptr(),
            normed.data_ptr(),
            total.data_ptr(),
            *x.shape,
            eps,
            bf16,
        )
        return normed, total

    def fuse_decoder(self, layers: Sequence[DecoderLayerParts]) -> FusedDecoder | str:
        """The ``fused-decoder`` capability: Llama-shaped layers whose projections are kept
        quantised for ``cpu-native`` run a whole small step in one native call
        (``decoder.NativeDecoderStack``); otherwise, the reason they cannot."""
        from powertrain_cpu_kernels.decoder import fuse_decoder

        return fuse_decoder(self, layers)

    def _step_tensors(
        self, metadata: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The sequences with at most ``SHORT_QUERY`` new tokens, and the block tables, query
        starts and sequence lengths checked and made contiguous: the same for every layer of
        a step, so done once per step."""
        if self._rows[0] is not metadata:
            short = [i for i, n in enumerate(metadata.query_lens_host) if n <= SHORT_QUERY]
            tables = metadata.block_tables.contiguous()
            starts, seq_lens = metadata.query_start_loc.contiguous(), metadata.seq_lens.contiguous()
            if not all(t.dtype == torch.int32 for t in (tables, starts, seq_lens)):
                raise TypeError(
                    "cpu-paged: block_tables, query_start_loc and seq_lens must be int32 (AttentionMetadata)"
                )
            self._rows = (metadata, (torch.tensor(short, dtype=torch.int64), tables, starts, seq_lens))
        return self._rows[1]

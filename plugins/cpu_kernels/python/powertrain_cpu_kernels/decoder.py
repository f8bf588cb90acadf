"""``NativeDecoderStack``: a Llama-shaped decoder stack run in one native call per step.

At batch-1 decode the native kernels take tens of microseconds each and the Python and
torch glue between them (module calls, views, splits, the SiLU: about forty calls a layer)
about as long again. ``cpu-paged`` therefore also runs whole stacks (``fused-decoder``):
``src/decoder.rs`` calls the same kernels with the same settings back to back, so a fused
step equals the layers one by one except for the SiLU, computed there instead of by torch
(float32 rounding of that one activation).

It takes layers whose four projections are kept quantised for ``cpu-native`` (``q4``/``q8``)
and whose norm weights and biases are float32, and steps of float32 rows that all attend
natively (at most ``SHORT_QUERY`` new tokens per sequence, one cache retention class, no
padding rows); other steps return None and run layer by layer.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

import powertrain_cpu_kernels._native as _native
from powertrain.builtin.bucketed_attention import SHORT_QUERY
from powertrain.interfaces import AttentionMetadata, DecoderLayerParts, LayerKVCache
from powertrain_cpu_kernels.quantized_linear import NativeQuantizedLinear, PreparedWeight
from powertrain_cpu_kernels.threads import use_threads

if TYPE_CHECKING:
    from powertrain_cpu_kernels.attention import NativePagedAttention

#: Rows up to which a step runs fused. The glue it removes is a fixed cost per layer, large
#: at a few rows; its norms, rotary and SiLU run on one thread, which at many rows torch's
#: multi-threaded ops would not. SmolLM2-135M kept Q4_1, greedy decode of 48 tokens per
#: chat, tok/s fused vs layer by layer (2-core AVX2 EPYC): 1 chat 89.8 vs 50.4, 4: 147 vs
#: 111, 16: 244 vs 232, 64: 313 vs 277, 128: 293 vs 278. Never slower in that range.
FUSED_MAX_ROWS = 256


def _float_bits(value: float) -> int:
    return struct.unpack("<I", struct.pack("<f", value))[0]


def _projection_entries(name: str, linear: object, rows: int, cols: int) -> list[int] | str:
    """The table entries of one projection (``src/decoder.rs``), or why it cannot be fused."""
    kernel, prepared = getattr(linear, "kernel", None), getattr(linear, "quantized", None)
    if not isinstance(kernel, NativeQuantizedLinear) or type(prepared) is not PreparedWeight:
        return f"{name} is not kept quantised for cpu-native"
    if getattr(linear, "row_tile", None) is not None:
        return f"{name} multiplies in row tiles (batch invariance)"
    if (prepared.rows, prepared.cols) != (rows, cols):
        return f"{name} is {prepared.rows} x {prepared.cols}, the layer needs {rows} x {cols}"
    bias = getattr(linear, "bias", None)
    if bias is not None and not (bias.dtype == torch.float32 and bias.is_cpu and bias.is_contiguous()):
        return f"{name}'s bias is not a contiguous float32 CPU tensor"
    codes, scales, offsets = prepared.pointers
    return [
        4 if prepared.format == "q4" else 8,
        prepared.group,
        rows,
        cols,
        codes,
        scales,
        offsets,
        0 if bias is None else bias.data_ptr(),
        kernel.gemm_min_rows,
        int(kernel.activation_bits == 16),
        int(prepared.half_scales),
    ]


def _layer_entries(index: int, layer: DecoderLayerParts, hidden: int) -> tuple[list[int], int] | str:
    """A layer's table entries without its caches (filled per cache list), and the most rows
    its kernels multiply natively; or why it cannot be fused."""
    spec = layer.attention
    if spec.kind not in ("gqa", "mha"):
        return f"layer {index} has {spec.kind} attention"
    for name, norm in (("input norm", layer.input_norm), ("post-attention norm", layer.post_attention_norm)):
        if not (norm.dtype == torch.float32 and norm.is_cpu and norm.is_contiguous() and norm.shape == (hidden,)):
            return f"layer {index}'s {name} is not a contiguous float32 CPU [{hidden}]"
    q_size, kv_size = spec.num_heads * spec.head_size, spec.num_kv_heads * spec.head_size
    width = layer.down.in_features
    projections = (
        ("qkv", layer.qkv, q_size + 2 * kv_size, hidden),
        ("o", layer.o, hidden, q_size),
        ("gate_up", layer.gate_up, 2 * width, hidden),
        ("down", layer.down, hidden, width),
    )
    entries = [layer.input_norm.data_ptr(), layer.post_attention_norm.data_ptr(), 0, 0]
    for name, linear, rows, cols in projections:
        projection = _projection_entries(f"layer {index}'s {name} projection", linear, rows, cols)
        if isinstance(projection, str):
            return projection
        entries += projection
    entries += [spec.num_heads, spec.num_kv_heads, spec.head_size, spec.sliding_window or 0]
    entries += [_float_bits(layer.eps), _float_bits(spec.scale)]
    max_rows = min(linear.kernel.gemv_max_rows for _, linear, _, _ in projections)
    return entries, max_rows


class NativeDecoderStack:
    """Implements ``interfaces.FusedDecoder`` for ``NativePagedAttention.fuse_decoder``."""

    def __init__(self, backend: NativePagedAttention, layers: Sequence[DecoderLayerParts], hidden: int) -> None:
        self._backend = backend
        self._layers = tuple(layers)
        # The tensors the table points at, held here too: a module given another weight later
        # must not free memory the table still names.
        self._alive = [
            (getattr(linear, "quantized", None), getattr(linear, "bias", None))
            for layer in layers
            for linear in (layer.qkv, layer.o, layer.gate_up, layer.down)
        ]
        self._hidden = hidden
        self._entries: list[list[int]] = []
        self.max_rows = FUSED_MAX_ROWS
        for index, layer in enumerate(layers):
            built = _layer_entries(index, layer, hidden)
            if isinstance(built, str):
                raise ValueError(built)
            entries, max_rows = built
            assert len(entries) == _native.decoder_layer_entries(), "decoder.rs reads another table layout"
            self._entries.append(entries)
            self.max_rows = min(self.max_rows, max_rows)
        # The table with the cache addresses of the last cache list seen, and its cache shape.
        self._caches: tuple[Sequence[LayerKVCache] | None, torch.Tensor | None, tuple[int, ...]] = (None, None, ())

    def _table(self, kv_caches: Sequence[LayerKVCache]) -> tuple[torch.Tensor, tuple[int, ...]] | None:
        """The layer table for ``kv_caches`` (built once per cache list), and the caches' shape;
        None where the caches are not all float32, contiguous and alike."""
        if self._caches[0] is not kv_caches:
            table, shape = None, ()
            if len(kv_caches) == len(self._entries):
                table, shape = self._build_table(kv_caches)
            self._caches = (kv_caches, table, shape)
        _, table, shape = self._caches
        return None if table is None else (table, shape)

    def _build_table(self, kv_caches: Sequence[LayerKVCache]) -> tuple[torch.Tensor | None, tuple[int, ...]]:
        rows: list[int] = []
        shape: tuple[int, ...] = ()
        for entries, layer, cache in zip(self._entries, self._layers, kv_caches, strict=True):
            key, value = cache.get("key"), cache.get("value")
            spec = layer.attention
            if key is None or value is None:
                return None, ()
            expected = (spec.num_kv_heads, spec.head_size)
            if (
                not all(
                    t.dtype == torch.float32
                    and t.is_cpu
                    and t.is_contiguous()
                    and t.dim() == 4
                    and t.shape[2:] == expected
                    for t in (key, value)
                )
                or key.shape != value.shape
            ):
                return None, ()
            if shape and key.shape[:2] != shape:
                return None, ()
            shape = tuple(key.shape[:2])
            rows += entries[:2] + [key.data_ptr(), value.data_ptr()] + entries[4:]
        return torch.tensor(rows, dtype=torch.int64), shape  # addresses fit in int64

    def __call__(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_caches: Sequence[LayerKVCache],
        metadata: AttentionMetadata,
        layers: range | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        count = len(self._entries)
        span = range(count) if layers is None else layers
        if not (len(span) and span.step == 1 and span.start >= 0 and span.stop <= count):
            raise ValueError(f"the fused stack runs consecutive layers of 0..{count - 1}, not {layers}")
        tokens = hidden.shape[0]
        if not (
            0 < tokens <= self.max_rows
            and tokens == metadata.num_tokens
            and metadata.max_query_len <= SHORT_QUERY
            and not metadata.window_tables
            and hidden.dtype is torch.float32
            and hidden.is_cpu
            and hidden.shape == (tokens, self._hidden)
            and cos.dtype is sin.dtype is torch.float32
            and cos.shape == sin.shape == (tokens, cos.shape[-1])
            and metadata.slot_mapping.dtype == torch.int64
            and metadata.slot_mapping.shape == (tokens,)
        ):
            return None
        found = self._table(kv_caches)
        if found is None:
            return None
        table, (num_blocks, block_size) = found
        if block_size != metadata.block_size:
            return None
        per_layer = _native.decoder_layer_entries()
        table = table[span.start * per_layer : span.stop * per_layer]  # the segment's rows (a view)
        rows, tables, starts, seq_lens = self._backend._step_tensors(metadata)
        hidden, cos, sin = hidden.contiguous(), cos.contiguous(), sin.contiguous()
        slots = metadata.slot_mapping.contiguous()
        out, residual = torch.empty_like(hidden), torch.empty_like(hidden)
        use_threads(self._backend.threads)
        _native.decoder_stack(
            table.data_ptr(),
            len(span),
            hidden.data_ptr(),
            out.data_ptr(),
            residual.data_ptr(),
            tokens,
            self._hidden,
            cos.data_ptr(),
            sin.data_ptr(),
            cos.shape[-1],
            slots.data_ptr(),
            tables.data_ptr(),
            starts.data_ptr(),
            seq_lens.data_ptr(),
            rows.data_ptr(),
            tables.shape[0],
            tables.shape[1],
            rows.numel(),
            num_blocks,
            block_size,
            *self._backend._where_to_run(),
        )
        return out, residual


def fuse_decoder(backend: NativePagedAttention, layers: Sequence[DecoderLayerParts]) -> NativeDecoderStack | str:
    """``backend``'s ``fuse_decoder``: the stack, or why these layers cannot be fused."""
    if not layers:
        return "the model has no decoder layers"
    hidden = layers[0].input_norm.shape[0]
    try:
        return NativeDecoderStack(backend, layers, hidden)
    except ValueError as why:
        return str(why)

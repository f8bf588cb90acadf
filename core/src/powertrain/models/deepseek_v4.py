"""DeepSeek-V4 (Flash, Pro): hybrid sliding-window + compressed attention, mHC, hash MoE.

Read docs/deepseek_v4_notes.md first; this follows transformers 5.24's
``DeepseekV4ForCausalLM`` (the oracle), with DeepSeek's native parameter names.

- **Attention, per layer type.** Every layer attends over a sliding window of raw keys: one
  512-wide head used as key and value (shared-KV MQA), with per-head sinks, partial
  interleaved RoPE on the trailing dims and the output de-rotated. ``compressed_sparse_attention``
  (CSA) layers add one compressed entry per ``m`` tokens, of which the Lightning Indexer picks
  ``index_topk`` per query; ``heavily_compressed_attention`` (HCA) layers one per ``m'`` tokens,
  all read. Sliding layers rotate with the "main" RoPE table, CSA/HCA layers (compressors and
  indexer included) with the "compress" one (YaRN). The attention and the indexer's top-k go
  through the backend's ``forward_v4`` and ``index_topk`` where it declares ``v4-attention``
  and ``lightning-indexer`` (the Triton pack, the reference), else through the same torch code.
- **Caches are declarations** (``AttentionLayerSpec.cache_groups``, kind ``custom``): the raw
  window (``kv``, sliding ``W``), each compressor's per-token rows (sliding over the rows an
  entry reads: ``2m`` for CSA, ``m'`` for HCA; float32), and the compressed entries and
  indexer keys (one per ``m`` tokens, full history). An entry is a function of its window's
  rows only, so chunked prefill, prefix caching, preemption and speculative rollback move
  block ids and lengths and nothing else (docs/deepseek_v4_notes.md §3).
- **mHC**: ``hc_mult`` residual streams, collapsed before and expanded after each block
  (``layers/hyper_connections.py``); the hyper head collapses them before the final norm.
- **MoE** on every layer: sqrtsoftplus scores, learned (correction bias picks) or hash
  (``tid2eid[token]``) routing, clamped SwiGLU experts (``swiglu_limit``) and a shared expert.
- **MTP.** ``num_nextn_predict_layers`` layers stored as ``mtp.{k}.*`` (DeepSeek's ``MTPBlock``
  in its V4 ``inference/model.py``, vLLM's ``deepseek_v4_mtp.py``): a V4 block fed the target's
  streams before the hyper head plus the next token's embedding, with its own hyper head and
  norm before the model's head. ``DeepseekV4MTP`` runs them as a drafter; a checkpoint without
  ``mtp.*`` tensors loads without it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs
import structlog
import torch
from torch import nn

from powertrain.interfaces import (
    AttentionLayerSpec,
    AttentionMetadata,
    CacheGroupSpec,
    HiddenTap,
    KVTensorSpec,
    LayerKVCache,
    LightningIndexerBackend,
    ModelContext,
    TapRecorder,
    V4AttentionBackend,
)
from powertrain.interfaces.moe import RoutingConfig
from powertrain.layers.compressed_attention import (
    CompressedIndexer,
    Compressor,
    GroupedLinear,
    V4RMSNorm,
    attend_window_and_entries,
    rotate_trailing,
    unweighted_rms_norm,
)
from powertrain.layers.hyper_connections import HyperConnection, HyperHead
from powertrain.layers.indexer import index_topk_reference
from powertrain.layers.linear import Linear
from powertrain.layers.moe import MoE, SharedExpertMoE
from powertrain.layers.paged import entry_slots, read_entries, write_entries
from powertrain.layers.rotary import RopeParameters, RotaryEmbedding, deepseek_rope_tables
from powertrain.models.config_reading import required_reader
from powertrain.models.weights import ROUTED_EXPERT, check_complete, copy_checked, held_here

log = structlog.get_logger(__name__)

ARCHITECTURES = frozenset({"DeepseekV4ForCausalLM"})
SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
#: DeepSeek's per-layer ``compress_ratios`` (older configs) -> layer type.
_RATIO_TYPES = {0: SLIDING, 4: CSA, 128: HCA}


@attrs.frozen(kw_only=True)
class V4Args:
    """The config.json fields this model reads (transformers' ``DeepseekV4Config`` meaning)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    #: MTP layers after the decoder's (``num_nextn_predict_layers``); ``layer_types`` and
    #: ``mlp_layer_types`` hold theirs after the decoder layers'.
    num_mtp_layers: int
    num_heads: int
    head_dim: int
    rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    compress_rates: Mapping[str, int]
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    num_experts: int
    top_k: int
    n_shared_experts: int
    moe_intermediate_size: int
    routed_scaling_factor: float
    swiglu_limit: float | None
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_norm_eps: float
    max_position_embeddings: int
    main_rope: RopeParameters
    compress_rope: RopeParameters
    tie_word_embeddings: bool

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> V4Args:
        required = required_reader(config, "DeepSeek-V4")

        layers = int(required("num_hidden_layers"))
        mtp = int(config.get("num_nextn_predict_layers") or 0)
        head_dim = int(required("head_dim"))
        partial = config.get("partial_rotary_factor")
        if partial is None and config.get("qk_rope_head_dim") is not None:
            partial = int(config["qk_rope_head_dim"]) / head_dim
        if partial is None:
            raise ValueError("DeepSeek-V4 config lacks partial_rotary_factor (or qk_rope_head_dim)")
        rates = dict(required("compress_rates"))
        layer_types = config.get("layer_types")
        if layer_types is None and config.get("compress_ratios") is not None:
            layer_types = [_RATIO_TYPES.get(int(r), f"compress_ratio={r}") for r in config["compress_ratios"]]
        layer_types = tuple(required("layer_types") if layer_types is None else layer_types)
        mlp_types = config.get("mlp_layer_types")
        if mlp_types is None:
            hashed = int(config.get("num_hash_layers") or 0)
            mlp_types = ["hash_moe"] * hashed + ["moe"] * (layers - hashed)
        mlp_types = tuple(mlp_types)
        _check_kinds("layer_types", layer_types[:layers], (SLIDING, CSA, HCA), layers)
        _check_kinds("mlp_layer_types", mlp_types[:layers], ("hash_moe", "moe"), layers)
        layer_types = _with_mtp_kinds(layer_types, layers, mtp, SLIDING)
        mlp_types = _with_mtp_kinds(mlp_types, layers, mtp, "moe")
        _check_kinds("MTP layer_types", layer_types[layers:], (SLIDING, CSA, HCA), mtp)
        _check_kinds("MTP mlp_layer_types", mlp_types[layers:], ("hash_moe", "moe"), mtp)
        for kind in {CSA, HCA} & set(layer_types):
            if not isinstance(rates.get(kind), int) or rates[kind] < 1:
                raise ValueError(f"DeepSeek-V4 config: compress_rates[{kind!r}] must be a positive int, got {rates}")
        if config.get("scoring_func", "sqrtsoftplus") != "sqrtsoftplus":
            raise ValueError(f"DeepSeek-V4 routes with sqrtsoftplus scores, config says {config['scoring_func']!r}")
        main, compress = deepseek_rope_tables(config, float(partial))
        rope_dim = int(head_dim * float(partial))
        limit = config.get("swiglu_limit")
        return cls(
            vocab_size=int(required("vocab_size")),
            hidden_size=int(required("hidden_size")),
            num_layers=layers,
            num_mtp_layers=mtp,
            num_heads=int(required("num_attention_heads")),
            head_dim=head_dim,
            rope_head_dim=rope_dim,
            q_lora_rank=int(required("q_lora_rank")),
            o_groups=int(required("o_groups")),
            o_lora_rank=int(required("o_lora_rank")),
            sliding_window=int(required("sliding_window")),
            layer_types=layer_types,
            mlp_layer_types=mlp_types,
            compress_rates=rates,
            index_n_heads=int(config.get("index_n_heads") or 0),
            index_head_dim=int(config.get("index_head_dim") or 0),
            index_topk=int(config.get("index_topk") or 0),
            num_experts=int(required("n_routed_experts")),
            top_k=int(required("num_experts_per_tok")),
            n_shared_experts=int(config.get("n_shared_experts") or 0),
            moe_intermediate_size=int(required("moe_intermediate_size")),
            routed_scaling_factor=float(config.get("routed_scaling_factor") or 1.0),
            swiglu_limit=None if limit is None else float(limit),
            hc_mult=int(required("hc_mult")),
            hc_sinkhorn_iters=int(required("hc_sinkhorn_iters")),
            hc_eps=float(required("hc_eps")),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(config.get("max_position_embeddings") or 4096),
            main_rope=main,
            compress_rope=compress,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        )

    def routing(self, layer: int) -> RoutingConfig:
        return RoutingConfig(
            num_experts=self.num_experts,
            top_k=self.top_k,
            scoring="sqrtsoftplus",
            topk_method="hash" if self.mlp_layer_types[layer] == "hash_moe" else "noaux_tc",
            norm_topk_prob=True,
            routed_scaling_factor=self.routed_scaling_factor,
        )


def _with_mtp_kinds(kinds: Sequence[str], layers: int, mtp: int, default: str) -> tuple[str, ...]:
    """The decoder layers' kinds, then the MTP layers': listed after the decoder's where the
    config lists them (DeepSeek's ``compress_ratios`` counts the MTP layers), else ``default``,
    what the release's MTP layer is (sliding attention, learned routing)."""
    listed = kinds[layers : layers + mtp]
    return (*kinds[:layers], *listed, *(default,) * (mtp - len(listed)))


def _check_kinds(key: str, kinds: Sequence[str], known: Sequence[str], layers: int) -> None:
    if len(kinds) != layers or any(kind not in known for kind in kinds):
        raise ValueError(f"DeepSeek-V4 config {key}={list(kinds)}: need {layers} entries, each one of {list(known)}")


# --------------------------------------------------------------------------- attention


def _compress_decodes(
    compressor: Compressor,
    rows_cache: torch.Tensor,
    entries_cache: torch.Tensor,
    rows_view: AttentionMetadata,
    full: AttentionMetadata,
    table: RotaryEmbedding,
    dtype: torch.dtype,
) -> None:
    """``_compress`` for a step of one token per sequence, on the device, from the lengths
    on the device (a captured step holds the host ones only as bounds): each sequence's
    entry for the window its token closed, written there; where its token closed none,
    the entry of its open window, written to that window's slot, which nothing reads
    before the window closes and is written again (its block holds this token)."""
    rate, span = compressor.rate, compressor.window_tokens
    seq_lens = full.seq_lens.long()
    closed = seq_lens % rate == 0
    entry = torch.where(closed, seq_lens // rate - 1, seq_lens // rate)
    positions = ((entry + 1) * rate - span)[:, None] + torch.arange(span, device=seq_lens.device)
    present = positions >= 0  # with overlap, window 0 has no window before it
    slots = entry_slots(rows_view.block_tables, positions.clamp(min=0), rows_cache.shape[1])
    made = compressor.window_entries(rows_cache.view(-1, rows_cache.shape[-1])[slots], present, dtype)
    cos, sin = table(entry * rate, full.max_seq_len, dtype)
    store = entries_cache.view(-1, *entries_cache.shape[2:])
    targets = entry_slots(full.block_tables, entry[:, None], entries_cache.shape[1])[:, 0]
    store.index_copy_(0, targets, rotate_trailing(made, cos, sin).to(store.dtype))


class V4Attention(nn.Module):
    """One V4 attention layer (see the module docstring), over its own cache groups."""

    def __init__(self, args: V4Args, layer: int, backend: object) -> None:
        super().__init__()
        self.args, self.kind = args, args.layer_types[layer]
        # The backend's kernel where it declares ``v4-attention``; the same computation in
        # torch where it does not (any other backend still serves the rest of the engine).
        self.attend = backend.forward_v4 if isinstance(backend, V4AttentionBackend) else attend_window_and_entries
        self.index_topk = backend.index_topk if isinstance(backend, LightningIndexerBackend) else index_topk_reference
        h, heads, d = args.hidden_size, args.num_heads, args.head_dim
        self.wq_a = Linear(h, args.q_lora_rank, bias=False)
        self.q_norm = V4RMSNorm(args.q_lora_rank, args.rms_norm_eps)
        self.wq_b = Linear(args.q_lora_rank, heads * d, bias=False)
        self.wkv = Linear(h, d, bias=False)
        self.norm = V4RMSNorm(d, args.rms_norm_eps)
        self.wo_a = GroupedLinear(heads * d // args.o_groups, args.o_groups * args.o_lora_rank, args.o_groups)
        self.wo_b = Linear(args.o_groups * args.o_lora_rank, h, bias=False)
        self.attn_sink = nn.Parameter(torch.empty(heads, dtype=torch.float32))
        self.rope = "main" if self.kind == SLIDING else "compress"
        self.compressor: Compressor | None = None
        self.indexer: CompressedIndexer | None = None
        groups = [
            CacheGroupSpec(
                name="window", tensors=(KVTensorSpec(name="kv", shape=(d,)),), sliding_window=args.sliding_window
            )
        ]
        if self.kind != SLIDING:
            rate = args.compress_rates[self.kind]
            self.compressor = Compressor(h, d, rate, overlap=self.kind == CSA, eps=args.rms_norm_eps)
            groups += self._compressor_groups("compressor", self.compressor, "compressed")
        if self.kind == CSA:
            self.indexer = CompressedIndexer(
                hidden_size=h,
                q_lora_rank=args.q_lora_rank,
                n_heads=args.index_n_heads,
                head_dim=args.index_head_dim,
                rate=args.compress_rates[CSA],
                topk=args.index_topk,
                eps=args.rms_norm_eps,
            )
            groups += self._compressor_groups("indexer", self.indexer.compressor, "index_keys")
        self.spec = AttentionLayerSpec(
            kind="custom", num_heads=heads, num_kv_heads=1, head_size=d, scale=d**-0.5, cache_groups=groups
        )

    @staticmethod
    def _compressor_groups(name: str, compressor: Compressor, entries: str) -> list[CacheGroupSpec]:
        rows = KVTensorSpec(name=f"{name}_rows", shape=(compressor.row_width,))
        return [
            CacheGroupSpec(
                name=f"{name}_rows", tensors=(rows,), sliding_window=compressor.window_tokens, dtype=torch.float32
            ),
            CacheGroupSpec(
                name=entries,
                tensors=(KVTensorSpec(name=entries, shape=(compressor.head_dim,)),),
                tokens_per_entry=compressor.rate,
            ),
        ]

    def forward(
        self,
        hidden: torch.Tensor,  # [n, hidden]: the normed, collapsed streams
        positions: torch.Tensor,  # [n]
        rope: Mapping[str, RotaryEmbedding],
        kv_cache: LayerKVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        a = self.args
        table = rope[self.rope]
        cos, sin = table(positions, metadata.max_seq_len, hidden.dtype)
        q_resid = self.q_norm(self.wq_a(hidden))
        q = unweighted_rms_norm(self.wq_b(q_resid).view(-1, a.num_heads, a.head_dim), a.rms_norm_eps)
        q = rotate_trailing(q, cos.unsqueeze(1), sin.unsqueeze(1))
        kv = rotate_trailing(self.norm(self.wkv(hidden)), cos, sin)
        metadata.for_window(a.sliding_window).store(kv_cache["kv"], kv)
        if self.compressor is not None:
            self._compress(self.compressor, "compressor", "compressed", hidden, positions, table, kv_cache, metadata)
        if self.indexer is not None:
            self._compress(
                self.indexer.compressor, "indexer", "index_keys", hidden, positions, table, kv_cache, metadata
            )
        entry_indices = None
        if self.indexer is not None:  # CSA: the indexer picks which closed entries each query reads
            entry_indices = self.index_topk(
                self.indexer.queries(q_resid, cos, sin),
                self.indexer.head_weights(hidden),
                kv_cache["index_keys"],
                metadata.for_window(None),
                topk=self.indexer.topk,
                tokens_per_entry=self.indexer.compressor.rate,
            )
        out = self.attend(
            self.spec,
            q,
            kv_cache,
            metadata,
            self.attn_sink,
            window=a.sliding_window,
            compress_rate=None if self.compressor is None else self.compressor.rate,
            entry_indices=entry_indices,
            derotate=(cos, sin),  # the output comes back de-rotated: the backend may fuse it
        )
        return self.wo_b(self.wo_a(out.flatten(1)))

    def _compress(
        self,
        compressor: Compressor,
        name: str,
        entries: str,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        table: RotaryEmbedding,
        kv_cache: LayerKVCache,
        metadata: AttentionMetadata,
    ) -> None:
        """Store this step's rows, then compute and store the entries of the windows that
        closed in it (from the rows of their windows, this step's or cached)."""
        rows_view = metadata.for_window(compressor.window_tokens)
        rows_view.store(kv_cache[f"{name}_rows"], compressor.rows(hidden, positions))
        full = metadata.for_window(None)
        if metadata.num_decodes == metadata.batch_size:
            _compress_decodes(
                compressor, kv_cache[f"{name}_rows"], kv_cache[entries], rows_view, full, table, hidden.dtype
            )
            return
        rate = compressor.rate
        for seq, (context, seq_len) in enumerate(zip(metadata.context_lens_host, metadata.seq_lens_host, strict=True)):
            first, last = context // rate, seq_len // rate  # windows closing in this step: [first, last)
            if first >= last:
                continue
            start = max(first - 1, 0) * rate if compressor.overlap else first * rate
            rows = read_entries(kv_cache[f"{name}_rows"], rows_view.block_tables[seq], start, last * rate)
            made = compressor.entries(rows, first, hidden.dtype)
            window_starts = torch.arange(first, last, device=hidden.device) * rate
            cos, sin = table(window_starts, metadata.max_seq_len, hidden.dtype)
            write_entries(kv_cache[entries], full.block_tables[seq], first, rotate_trailing(made, cos, sin))


# --------------------------------------------------------------------------- MoE and blocks


class V4Block(nn.Module):
    """Attention then MoE, each between an mHC collapse and expand of the streams."""

    def __init__(self, args: V4Args, layer: int, ctx: ModelContext) -> None:
        super().__init__()
        hc = (args.hidden_size, args.hc_mult, args.hc_sinkhorn_iters, args.hc_eps, args.rms_norm_eps)
        self.attn_hc, self.ffn_hc = HyperConnection(*hc), HyperConnection(*hc)
        self.attn_norm = V4RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.ffn_norm = V4RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.attn = V4Attention(args, layer, ctx.attention)
        routing = args.routing(layer)
        self.ffn = SharedExpertMoE(
            ctx,
            routing,
            args.hidden_size,
            args.moe_intermediate_size,
            n_shared=args.n_shared_experts,
            swiglu_limit=args.swiglu_limit,
            vocab_size=args.vocab_size if routing.topk_method == "hash" else None,
        )

    def forward(
        self,
        streams: torch.Tensor,  # [n, hc_mult, hidden]
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        rope: Mapping[str, RotaryEmbedding],
        kv_cache: LayerKVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        collapsed, post, comb = self.attn_hc.collapse(streams)
        out = self.attn(self.attn_norm(collapsed), positions, rope, kv_cache, metadata)
        streams = HyperConnection.expand(streams, out, post, comb)
        collapsed, post, comb = self.ffn_hc.collapse(streams)
        out = self.ffn(self.ffn_norm(collapsed), input_ids)
        return HyperConnection.expand(streams, out, post, comb)


class V4MTPLayer(V4Block):
    """``mtp.{k}``: a V4 block (layer ``num_layers + k`` of the config's kinds) whose input
    streams are the target's streams before the hyper head, each normed (``hnorm``) and
    projected (``h_proj``), plus the next token's normed embedding projected (``e_proj``)
    and added to every stream; its output streams go through its own hyper head and norm
    before the model's head (DeepSeek's ``MTPBlock``)."""

    def __init__(self, args: V4Args, depth: int, ctx: ModelContext) -> None:
        super().__init__(args, args.num_layers + depth, ctx)
        h = args.hidden_size
        self.enorm = V4RMSNorm(h, args.rms_norm_eps)
        self.hnorm = V4RMSNorm(h, args.rms_norm_eps)
        self.e_proj = Linear(h, h, bias=False)
        self.h_proj = Linear(h, h, bias=False)
        self.hc_head = HyperHead(h, args.hc_mult, args.hc_eps, args.rms_norm_eps)
        self.norm = V4RMSNorm(h, args.rms_norm_eps)


class DeepseekV4MTP(nn.Module):
    """The checkpoint's MTP layers as a drafter, with ``deepseek_v3.DeepseekMTP``'s interface.

    Its hidden state is a position's streams flattened, ``[num_tokens, hc_mult * hidden]``:
    what it reads of the target is the streams before the hyper head (``reads``, a hidden
    tap), and what a depth returns is its block's output streams, which the next draft
    reads in their place (vLLM's V4 MTP feeds them back so). Logits come from them through
    the layer's own hyper head and norm (``collapse``, ``compute_logits``).
    """

    def __init__(self, model: DeepseekV4ForCausalLM, layers: Sequence[V4MTPLayer]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self._model = [model]  # the shared embedding, rotary tables and head; not a submodule
        self.attention_layers: tuple[AttentionLayerSpec, ...] = tuple(layer.attn.spec for layer in self.layers)
        #: The target's hidden state a depth-0 position reads in place of the final one.
        self.reads = HiddenTap(model.args.num_layers, "head_streams")

    @property
    def embed_tokens(self) -> nn.Embedding:
        """The target's token embedding (the MTP layers share it)."""
        return self._model[0].embed

    def forward(
        self,
        depth: int,
        input_ids: torch.Tensor,  # [num_tokens]: the token after each position
        positions: torch.Tensor,  # [num_tokens]
        previous_hidden: torch.Tensor,  # [num_tokens, hc_mult * hidden]: the target's (or a depth's) streams
        kv_cache: LayerKVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Depth ``depth``'s output streams, flattened (before its hyper head)."""
        model, layer = self._model[0], self.layers[depth]
        streams = previous_hidden.view(-1, model.args.hc_mult, model.args.hidden_size)
        projected = layer.h_proj(layer.hnorm(streams).flatten(0, 1)).view_as(streams)
        embedded = layer.e_proj(layer.enorm(model.embed(input_ids)))
        streams = layer(projected + embedded.unsqueeze(1), input_ids, positions, model.rope, kv_cache, metadata)
        return streams.flatten(1)

    def collapse(self, depth: int, hidden: torch.Tensor) -> torch.Tensor:
        """``[num_tokens, hidden]``: depth ``depth``'s streams through its hyper head (before its norm)."""
        args = self._model[0].args
        return self.layers[depth].hc_head(hidden.view(-1, args.hc_mult, args.hidden_size))

    def compute_logits(self, depth: int, hidden: torch.Tensor) -> torch.Tensor:
        return self._model[0].compute_logits(self.layers[depth].norm(self.collapse(depth, hidden)))

    def routed_expert_layers(self, depth: int) -> list[MoE]:
        """The MoE layers depth ``depth``'s forward runs."""
        return [self.layers[depth].ffn.experts]


class DeepseekV4ForCausalLM(nn.Module):
    """Implements ``interfaces.CausalLM`` for DeepSeek-V4 (parameters under native names),
    and carries ``mtp``, the drafter, when the checkpoint has MTP layers."""

    #: Nothing outside the backends syncs: in a step of decodes the compressors find the
    #: windows it closes from the lengths on the device (``_compress_decodes``).
    captures_decode = True
    #: V4's MTP layer reads the streams before the hyper head collapses them.
    tap_forms = frozenset({"head_streams"})
    taps: TapRecorder | None = None

    def __init__(self, ctx: ModelContext) -> None:
        super().__init__()
        self.args = args = V4Args.from_config(ctx.config)
        if ctx.moe is None:
            raise ValueError("DeepSeek-V4 needs a MoE backend (ModelContext.moe)")
        self._expert_slice = None if ctx.expert_parallel_size == 1 else ctx.local_experts(args.num_experts)
        self._fp4_experts = ctx.fp4_experts
        with torch.device(ctx.device):
            previous = torch.get_default_dtype()
            torch.set_default_dtype(ctx.dtype)
            try:
                self.embed = nn.Embedding(
                    args.vocab_size, args.hidden_size, _weight=torch.empty(args.vocab_size, args.hidden_size)
                )
                self.layers = nn.ModuleList(V4Block(args, i, ctx) for i in range(args.num_layers))
                self.hc_head = HyperHead(args.hidden_size, args.hc_mult, args.hc_eps, args.rms_norm_eps)
                self.norm = V4RMSNorm(args.hidden_size, args.rms_norm_eps)
                self.head = Linear(args.hidden_size, args.vocab_size, bias=False)
                if args.tie_word_embeddings:
                    self.head.weight = self.embed.weight
                mtp_layers = [V4MTPLayer(args, depth, ctx) for depth in range(args.num_mtp_layers)]
            finally:
                torch.set_default_dtype(previous)
        self.rope = {
            "main": RotaryEmbedding(args.head_dim, args.main_rope, args.max_position_embeddings),
            "compress": RotaryEmbedding(args.head_dim, args.compress_rope, args.max_position_embeddings),
        }
        self.mtp: DeepseekV4MTP | None = DeepseekV4MTP(self, mtp_layers) if mtp_layers else None
        self.requires_grad_(False)
        self.attention_layers: tuple[AttentionLayerSpec, ...] = tuple(layer.attn.spec for layer in self.layers)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[LayerKVCache],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Final-normed hidden states ``[num_tokens, hidden]`` of the flat batch."""
        hidden = self.embed(input_ids)
        streams = hidden.unsqueeze(1).expand(-1, self.args.hc_mult, -1).contiguous()
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            streams = layer(streams, input_ids, positions, self.rope, kv_cache, metadata)
        if self.taps is not None and self.taps.wants(len(self.layers), "head_streams"):
            self.taps.record(len(self.layers), "head_streams", streams.flatten(1))  # the MTP layer's input
        return self.norm(self.hc_head(streams))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden).float()

    def naive_kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """A dense cache of every layer's shared 512-wide key (= value) per token: what
        full attention without a window or compression would keep."""
        a = self.args
        return a.head_dim * a.num_layers * torch.empty((), dtype=dtype).element_size()

    # ----------------------------------------------------------------------- loading

    def routed_expert_layers(self) -> list[MoE]:
        """The MoE layers ``forward`` runs, in order (the MTP's run in the drafter's forward)."""
        return [layer.ffn.experts for layer in self.layers]

    def keep_fp4(self, name: str) -> bool:
        """Which FP4 checkpoint tensors to receive packed (with their scales): routed experts,
        when the MoE backend multiplies FP4 itself (``ModelContext.fp4_experts``)."""
        return self._fp4_experts and ROUTED_EXPERT.search(name) is not None

    def wants_weight(self, name: str) -> bool:
        """False for another expert-parallel rank's routed experts: they are not read."""
        return held_here(name, self._expert_slice)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy tensors in under DeepSeek's native names (bare or ``model.``-prefixed, as
        transformers' ``save_pretrained`` writes them) or transformers' own; routed experts
        and routers go through their MoE layer, MTP layers (``mtp.{k}.*``) into ``mtp``. A
        checkpoint with no ``mtp.*`` tensor at all loads without ``mtp`` (transformers writes
        none, yet its config counts the layer). Raises ValueError naming unexpected and
        missing tensors."""
        targets = {name: param.data for name, param in self.named_parameters() if ".ffn.experts." not in name}
        loaded: set[str] = set()
        unexpected: list[str] = []
        with torch.no_grad():
            for stored, tensor in weights:
                name = native_name(stored)
                if name in targets:
                    copy_checked(stored, targets[name], tensor)
                    loaded.add(name)
                elif self._load_routed(name, tensor):
                    loaded.add(name)
                else:
                    unexpected.append(stored)
            if self.mtp is not None and not any(name.startswith("mtp.") for name in loaded):
                log.info("deepseek_v4.no_mtp_layers", num_nextn_predict_layers=self.args.num_mtp_layers)
                self.mtp = None
                targets = {name: target for name, target in targets.items() if not name.startswith("mtp.")}
            for moe in self._moe_layers():
                moe.finish_loading()
        missing = sorted(targets.keys() - loaded)
        if self.args.tie_word_embeddings:
            missing = [m for m in missing if m != "head.weight"]
        check_complete(type(self).__name__, unexpected, missing)

    def _moe_layers(self) -> list[MoE]:
        return self.routed_expert_layers() + [layer.ffn.experts for layer in (self.mtp.layers if self.mtp else ())]

    def _load_routed(self, name: str, tensor: torch.Tensor) -> bool:
        match = _ROUTED.match(name)
        if match is None:
            return False
        blocks = self.layers if match.group(1) == "layers" else self.mtp.layers if self.mtp else ()
        index = int(match.group(2))
        return index < len(blocks) and blocks[index].ffn.experts.load_weight(match.group(3), tensor)


_ROUTED = re.compile(r"^(layers|mtp\.layers)\.(\d+)\.ffn\.((?:gate|experts)\..*)$")
#: transformers' in-memory names -> native ones (its conversion_mapping's "deepseek_v4" read
#: forwards), applied to name parts; the ``model.`` prefix is dropped first.
_HF_PARTS = {
    "self_attn": "attn",
    "mlp": "ffn",
    "q_a_proj": "wq_a",
    "q_a_norm": "q_norm",
    "q_b_proj": "wq_b",
    "kv_proj": "wkv",
    "kv_norm": "norm",
    "o_a_proj": "wo_a",
    "o_b_proj": "wo_b",
    "sinks": "attn_sink",
    "gate_proj": "wgate",
    "position_bias": "ape",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "embed_tokens": "embed",
    "lm_head": "head",
}
_HF_SHARED = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def native_name(name: str) -> str:
    """The native (bare) name of a stored V4 tensor, whichever of the three forms it is in,
    mapped onto this module's parameter names (mHC and the hyper head live in submodules)."""
    name = name.removeprefix("model.")
    if name.startswith("hc_head."):  # save_pretrained's spelling of the hyper head
        name = name.replace("hc_head.hc_", "hc_head_")
    parts = name.split(".")
    if "shared_experts" in parts:
        parts = [_HF_SHARED.get(part, part) for part in parts]
    parts = [_HF_PARTS.get(part, part) for part in parts]
    if "scorer" in parts:  # transformers: compressor.indexer.scorer.weights_proj
        parts.remove("scorer")
    if "indexer" in parts and "compressor" in parts:
        parts = _indexer_parts(parts)
    name = re.sub(r"^mtp\.(\d+)\.", r"mtp.layers.\1.", ".".join(parts))  # the drafter's ModuleList
    for which in ("attn", "ffn"):  # hc_attn_fn -> attn_hc.fn
        name = re.sub(
            rf"^((?:mtp\.)?layers\.\d+\.)(?:hc_{which}_|{which}_hc\.)(fn|base|scale)$", rf"\g<1>{which}_hc.\2", name
        )
    name = re.sub(r"^((?:mtp\.layers\.\d+\.)?)hc_head_(fn|base|scale)$", r"\g<1>hc_head.hc_\2", name)
    return name


def _indexer_parts(parts: list[str]) -> list[str]:
    """transformers nests the indexer in the compressor (``attn.compressor.indexer.X``),
    DeepSeek beside it (``attn.indexer.compressor.X`` for its compressor's tensors,
    ``attn.indexer.X`` for its queries and weights)."""
    text = ".".join(parts)
    match = re.match(r"^(layers\.\d+\.attn\.)compressor\.indexer\.(.*)$", text)
    if match is None:
        return parts
    prefix, rest = match.groups()
    leaf_module = rest.split(".")[0]
    if leaf_module in ("wq_b", "weights_proj"):
        return f"{prefix}indexer.{rest}".split(".")
    return f"{prefix}indexer.compressor.{rest}".split(".")


__all__: Sequence[str] = ["ARCHITECTURES", "DeepseekV4ForCausalLM", "DeepseekV4MTP", "V4Args", "native_name"]

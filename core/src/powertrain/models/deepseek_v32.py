"""DeepSeek-V3.2: DeepSeek-V3 with DeepSeek Sparse Attention (DSA).

Everything but attention is ``deepseek_v3.py``'s. Each MLA layer gains a Lightning
Indexer (``layers/indexer.py``) that picks, per query token, the ``index_topk`` cached
tokens its attention reads (the backend's ``index_topk`` where it declares
``lightning-indexer``); the MLA itself then runs through the backend's
``forward_mla_sparse`` over exactly those positions, always (with few tokens the
indices simply list every visible one).

The indexer keeps one key per token: a model-declared cache group
(``AttentionLayerSpec.cache_groups``: ``indexer``, tensor ``index_keys``, one entry per
token, full history), so it shares the full-history block table with MLA's latent
cache, and prefix caching, chunked prefill, preemption and speculative rollback need
nothing of their own: each step stores the new tokens' keys at ``slot_mapping`` and
reads a sequence's keys ``[0, seq_len)`` through its blocks.

Followed from transformers' ``DeepseekV32ForCausalLM`` (the oracle), where it differs
from its V3:

- routing is hard-coded there: sigmoid scores, group-limited ``noaux_tc`` (a config
  saying otherwise is refused here rather than silently followed);
- which layers are MoE comes from ``mlp_layer_types`` (default: the first
  ``first_k_dense_replace`` dense), not ``moe_layer_freq``;
- q-LoRA is always on (the indexer's queries come from its residual);
- MLA's rope stays interleaved, the indexer's is not (``LightningIndexer`` handles it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch

from powertrain.interfaces import (
    AttentionMetadata,
    CacheGroupSpec,
    KVTensorSpec,
    LayerKVCache,
    LightningIndexerBackend,
    ModelContext,
)
from powertrain.layers.attention import SparseMLAAttention
from powertrain.layers.indexer import LightningIndexer, index_topk_reference
from powertrain.models.deepseek_v3 import MLA, DeepseekArgs, DeepseekV3ForCausalLM, mla_layer_spec

ARCHITECTURES = frozenset({"DeepseekV32ForCausalLM"})
#: The model-declared cache tensor holding each token's indexer key.
INDEX_KEYS = "index_keys"
#: What transformers' DeepseekV32TopkRouter does whatever the config says.
_HF_ROUTING = {"scoring_func": "sigmoid", "topk_method": "noaux_tc"}


def read_v32_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` with V3.2's fixed routing filled in; refuses what this model does not follow."""
    for key, value in _HF_ROUTING.items():
        if config.get(key) not in (None, value):
            raise ValueError(
                f"DeepSeek-V3.2 config says {key}={config[key]!r}, but V3.2 routes with {key}={value!r} "
                "(transformers hard-codes it); fix config.json"
            )
    if config.get("q_lora_rank") is None:
        raise ValueError("DeepSeek-V3.2 needs q_lora_rank: its indexer reads the q-LoRA residual")
    return {**config, **_HF_ROUTING}


def _check_mlp_layer_types(args: DeepseekArgs, config: Mapping[str, Any]) -> None:
    kinds = config.get("mlp_layer_types")
    if kinds is None:
        return
    ours = ["sparse" if args.is_moe_layer(i) else "dense" for i in range(args.num_layers)]
    if list(kinds) != ours:
        raise ValueError(
            f"DeepSeek-V3.2 config mlp_layer_types={list(kinds)} is not the first_k_dense_replace="
            f"{args.first_k_dense_replace} / moe_layer_freq={args.moe_layer_freq} pattern {ours} this model builds"
        )


class IndexedMLA(MLA):
    """V3's MLA plus the indexer: attention reads only the positions the indexer picks."""

    def __init__(self, args: DeepseekArgs, ctx: ModelContext) -> None:
        super().__init__(args, ctx.attention)
        self.indexer = LightningIndexer.from_config(ctx.config)
        keys = KVTensorSpec(name=INDEX_KEYS, shape=(self.indexer.head_dim,))
        spec = attrs.evolve(mla_layer_spec(args), cache_groups=(CacheGroupSpec(name="indexer", tensors=(keys,)),))
        self.attn = SparseMLAAttention(spec, ctx.attention)
        # The backend's kernel where it declares ``lightning-indexer``, else the same in torch.
        backend = ctx.attention
        self.index_topk = backend.index_topk if isinstance(backend, LightningIndexerBackend) else index_topk_reference

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: LayerKVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        q_resid, q_nope, q_rope, latent, k_rope = self._project(hidden, cos, sin)
        indices = self._select(hidden, q_resid, cos, sin, kv_cache, metadata)
        return self._attend(q_nope, q_rope, latent, k_rope, kv_cache, metadata, indices)

    def _select(
        self,
        hidden: torch.Tensor,
        q_resid: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: LayerKVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Store this step's indexer keys, read each sequence's ``[0, seq_len)`` back, pick."""
        if INDEX_KEYS not in kv_cache:
            raise ValueError(
                f"DeepSeek-V3.2 layer cache lacks {INDEX_KEYS!r} (has {sorted(kv_cache)}); allocate it with "
                "AttentionLayerSpec.allocate_cache, which adds the model's own cache groups"
            )
        store = kv_cache[INDEX_KEYS]
        metadata = metadata.for_window(None)  # the indexer group keeps the full history
        metadata.store(store, self.indexer.keys(hidden, cos, sin))
        queries, weights = self.indexer.queries(q_resid, cos, sin), self.indexer.head_weights(hidden)
        return self.index_topk(queries, weights, store, metadata, topk=self.indexer.topk)


def indexed_mla(args: DeepseekArgs, ctx: ModelContext) -> IndexedMLA:
    return IndexedMLA(args, ctx)


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    """DeepSeek-V3.2 (``interfaces.CausalLM``): V3 with an indexer in every attention layer."""

    #: Nothing outside the backends syncs: a backend declaring ``cuda-graphs`` refuses the
    #: indexer's out-of-range picks on the device (``AttentionMetadata.refuse_sparse_indices``).
    captures_decode = True

    def __init__(self, ctx: ModelContext) -> None:
        ctx_config = read_v32_config(ctx.config)
        super().__init__(_with_config(ctx, ctx_config), attention=indexed_mla)
        _check_mlp_layer_types(self.args, ctx_config)

    @classmethod
    def read_args(cls, config: Mapping[str, Any]) -> DeepseekArgs:
        return DeepseekArgs.from_config(read_v32_config(config))


def _with_config(ctx: ModelContext, config: Mapping[str, Any]) -> ModelContext:
    return attrs.evolve(ctx, config=config)


__all__: Sequence[str] = ["ARCHITECTURES", "INDEX_KEYS", "DeepseekV32ForCausalLM", "IndexedMLA"]

"""DeepSeek-V4.1's own DSpark drafter: the ``mtp.*`` stages of a V4.1 checkpoint, as DeepSeek's
official inference code wires them (``DSparkBlock``, ``Transformer.forward_spec``); it
implements ``interfaces.BlockDraftModel``, so DSpark's block drafter drives it.

- **Context.** Per position ``p`` whose target state is final, the means of the mHC streams
  entering the ``dspark_target_layer_ids`` layers, concatenated, give
  ``main_x = main_norm(main_proj(...))``; each stage's attention caches
  ``kv_norm(wkv(main_x))``, rotated at ``p`` (its *context entry*, one per token).
- **Block.** The anchor token (the last one kept) and ``dspark_block_size - 1`` noise tokens
  at the anchor's position and after it, embedded and expanded to the mHC streams (the first
  collapse reads stream 0), through V4.1's block machinery (lagged mHC collapses, q LoRA,
  sinks, the grouped output projection, a MoE of ``dspark_n_routed_experts``). Every block
  row attends to every block row and to the last ``sliding_window`` context entries before
  the anchor (DeepSeek's ``get_dspark_topk_idxs`` over its ring of window slots).
- **Heads.** The streams collapsed by the last stage's FFN weights, normed, through the
  target's float32 head: the base logits. The Markov head's bias is its own head over the
  embedding of the token before each draft; the confidence head reads the collapsed (not
  normed) state beside that embedding in float32 (a logit; ``confidence`` returns its
  sigmoid, the probability of acceptance).

The context entries live in a cache group of the full history: a sliding group of the
window would lose the oldest entry the block reads, since the engine keeps what the
target's next query reads (positions after ``anchor - window``), one position fewer than
the drafter's window.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch
from torch import nn

from powertrain.interfaces import (
    AttentionLayerSpec,
    AttentionMetadata,
    CacheGroupSpec,
    HiddenTap,
    KVTensorSpec,
    LayerKVCache,
    ModelContext,
)
from powertrain.layers.compressed_attention import GroupedLinear, V4RMSNorm, attend_with_sinks, rotate_trailing
from powertrain.layers.hyper_connections import HyperConnection, collapse_with
from powertrain.layers.linear import Linear
from powertrain.layers.moe import SharedExpertMoE
from powertrain.layers.paged import read_entries
from powertrain.layers.rotary import RotaryEmbedding


@attrs.frozen(kw_only=True)
class DSparkArgs:
    """The ``dspark_*`` fields of V4.1's ``text_config``."""

    block_size: int
    noise_token_id: int
    target_layer_ids: tuple[int, ...]
    markov_rank: int
    num_experts: int
    top_k: int
    stages: int

    @classmethod
    def from_config(cls, text: Mapping[str, Any], num_layers: int, num_experts: int, top_k: int) -> DSparkArgs | None:
        """None when the config has no drafter (``dspark_block_size`` 0 or absent)."""
        block_size = int(text.get("dspark_block_size") or 0)
        if block_size <= 0:
            return None
        where = "DeepSeek-V4.1 text_config"
        stages = int(text.get("num_nextn_predict_layers") or 1)
        targets = tuple(int(i) for i in text.get("dspark_target_layer_ids") or ())
        if not targets or any(not 0 <= i < num_layers for i in targets):
            raise ValueError(f"{where}: dspark_target_layer_ids {list(targets)} must name layers 0..{num_layers - 1}")
        ratios = [int(r) for r in text.get("compress_ratios") or []][num_layers:]
        if any(r != 0 for r in ratios):
            raise ValueError(f"{where}: compress_ratios of the DSpark stages must be 0 (window only), got {ratios}")
        return cls(
            block_size=block_size,
            noise_token_id=int(text.get("dspark_noise_token_id") or 0),
            target_layer_ids=targets,
            markov_rank=int(text.get("dspark_markov_rank") or 256),
            num_experts=int(text.get("dspark_n_routed_experts") or num_experts),
            top_k=int(text.get("dspark_num_experts_per_tok") or text.get("dspark_n_activated_experts") or top_k),
            stages=stages,
        )


class DSparkAttention(nn.Module):
    """A stage's attention: V4.1's window attention (sinks, shared K = V, de-rotated output,
    grouped output projection) over its context entries and the block."""

    def __init__(self, args: Any, window: int) -> None:
        super().__init__()
        self.args, self.window = args, window
        h, heads, d = args.hidden_size, args.num_heads, args.head_dim
        self.wq_a = Linear(h, args.q_lora_rank, bias=False)
        self.q_norm = V4RMSNorm(args.q_lora_rank, args.rms_norm_eps)
        self.wq_b = Linear(args.q_lora_rank, heads * d, bias=False)
        self.wkv = Linear(h, d, bias=False)
        self.kv_norm = V4RMSNorm(d, args.rms_norm_eps)
        self.wo_a = GroupedLinear(heads * d // args.o_groups, args.o_groups * args.o_lora_rank, args.o_groups)
        self.wo_b = Linear(args.o_groups * args.o_lora_rank, h, bias=False)
        self.attn_sink = nn.Parameter(torch.empty(heads, dtype=torch.float32))
        context = CacheGroupSpec(name="dspark_context", tensors=(KVTensorSpec(name="context", shape=(d,)),))
        self.spec = AttentionLayerSpec(
            kind="custom", num_heads=heads, num_kv_heads=1, head_size=d, scale=d**-0.5, cache_groups=(context,)
        )

    def keys(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return rotate_trailing(self.kv_norm(self.wkv(hidden)), cos, sin)

    def write(
        self, main_x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, cache: LayerKVCache, metadata: Any
    ) -> None:
        cos, sin = rope(positions, metadata.max_seq_len, torch.float32)
        metadata.store(cache["context"], self.keys(main_x, cos, sin))

    def forward(
        self,
        hidden: torch.Tensor,  # [n, hidden]: the blocks' normed, collapsed streams
        positions: torch.Tensor,
        rope: RotaryEmbedding,
        cache: LayerKVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        a = self.args
        cos, sin = rope(positions, metadata.max_seq_len, torch.float32)
        q = rotate_trailing(
            self.wq_b(self.q_norm(self.wq_a(hidden))).view(-1, a.num_heads, a.head_dim),
            cos.unsqueeze(1),
            sin.unsqueeze(1),
        )
        block_keys = self.keys(hidden, cos, sin)
        tables = metadata.for_window(None).block_tables
        out = torch.empty_like(q)
        for seq, anchor in enumerate(metadata.context_lens_host):
            start, end = metadata.query_start_loc_host[seq], metadata.query_start_loc_host[seq + 1]
            window = read_entries(cache["context"], tables[seq], max(0, anchor - self.window), anchor)
            keys = torch.cat((window.to(block_keys.dtype), block_keys[start:end]))
            allowed = torch.ones(end - start, keys.shape[0], dtype=torch.bool, device=q.device)
            out[start:end] = attend_with_sinks(q[start:end], keys, allowed, self.attn_sink, self.spec.scale)
        out = rotate_trailing(out, cos.unsqueeze(1), -sin.unsqueeze(1))
        return self.wo_b(self.wo_a(out.flatten(1)))


class MarkovHead(nn.Module):
    """The bigram bias: the previous token's ``embed`` row through its own float32 ``head``."""

    def __init__(self, vocab_size: int, rank: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, rank, _weight=torch.empty(vocab_size, rank))
        self.head = Linear(rank, vocab_size, bias=False, dtype=torch.float32)

    def bias(self, previous: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(previous).float())


class DSparkStage(nn.Module):
    """One ``mtp.<i>`` stage: V4.1's block (``V41Block``) around ``DSparkAttention``; the first
    stage also projects the target's taps, the last holds the final norm and the heads."""

    def __init__(self, args: Any, dspark: DSparkArgs, stage: int, ctx: ModelContext) -> None:
        super().__init__()
        hc = (args.hidden_size, args.hc_mult, args.hc_sinkhorn_iters, args.hc_eps, args.rms_norm_eps)
        self.attn_hc, self.ffn_hc = HyperConnection(*hc), HyperConnection(*hc)
        self.attn_norm = V4RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.ffn_norm = V4RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.attn = DSparkAttention(args, args.sliding_window)
        routing = attrs.evolve(args.routing, num_experts=dspark.num_experts, top_k=dspark.top_k)
        self.ffn = SharedExpertMoE(
            ctx,
            routing,
            args.hidden_size,
            args.moe_intermediate_size,
            n_shared=args.n_shared_experts,
            swiglu_limit=args.swiglu_limit,
        )
        if stage == 0:
            self.main_proj = Linear(args.hidden_size * len(dspark.target_layer_ids), args.hidden_size, bias=False)
            self.main_norm = V4RMSNorm(args.hidden_size, args.rms_norm_eps)
        if stage == dspark.stages - 1:
            self.norm = V4RMSNorm(args.hidden_size, args.rms_norm_eps)
            self.markov_head = MarkovHead(args.vocab_size, dspark.markov_rank)
            self.confidence_head = nn.Module()  # DeepSeek's keeps its one unit float32
            width = args.hidden_size + dspark.markov_rank
            self.confidence_head.proj = Linear(width, 1, bias=False, dtype=torch.float32)

    def forward(
        self,
        streams: torch.Tensor,
        pre: torch.Tensor,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        rope: RotaryEmbedding,
        cache: LayerKVCache,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        attn_pre, post, comb = self.attn_hc.weights(streams)
        out = self.attn(self.attn_norm(collapse_with(streams, pre)), positions, rope, cache, metadata)
        streams = HyperConnection.expand_in_float32(streams, out, post, comb)
        ffn_pre, post, comb = self.ffn_hc.weights(streams)
        out = self.ffn(self.ffn_norm(collapse_with(streams, attn_pre)), input_ids)
        return HyperConnection.expand_in_float32(streams, out, post, comb), ffn_pre


class DeepseekV41DSpark(nn.Module):
    """The ``mtp`` stages with the target's embedding and head (shared, not copied)."""

    def __init__(self, args: Any, dspark: DSparkArgs, ctx: ModelContext, embed: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.args, self.dspark = args, dspark
        self.stages = nn.ModuleList(DSparkStage(args, dspark, i, ctx) for i in range(dspark.stages))
        self._shared = (embed, head)  # a tuple: the target owns (and loads) them
        self.rope = RotaryEmbedding(args.head_dim, args.main_rope, args.max_position_embeddings)
        self.taps = tuple(HiddenTap(layer, "streams_mean_in") for layer in dspark.target_layer_ids)
        self.block_size = dspark.block_size
        self.mask_token_id = dspark.noise_token_id
        self.attention_layers: tuple[AttentionLayerSpec, ...] = tuple(stage.attn.spec for stage in self.stages)

    def context(self, taps: Sequence[torch.Tensor]) -> torch.Tensor:
        first = self.stages[0]
        # The norm's weight gives the model dtype: a projection's may be packed away (Linear.pack).
        dtype = first.main_norm.weight.dtype
        return first.main_norm(first.main_proj(torch.cat([tap.to(dtype) for tap in taps], -1)))

    def write_context(
        self,
        context: torch.Tensor,
        positions: torch.Tensor,
        caches: Sequence[LayerKVCache],
        metadata: AttentionMetadata,
    ) -> None:
        for stage, cache in zip(self.stages, caches, strict=True):
            stage.attn.write(context, positions, self.rope, cache, metadata.for_window(None))

    def block(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        caches: Sequence[LayerKVCache],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """The blocks' streams collapsed by the last stage's weights, ``[rows, hidden]`` (not normed)."""
        embed = self._shared[0]
        streams = embed(input_ids).unsqueeze(1).expand(-1, self.args.hc_mult, -1).contiguous()
        pre = torch.zeros(input_ids.shape[0], self.args.hc_mult, device=streams.device)
        pre[:, 0] = 1.0
        for stage, cache in zip(self.stages, caches, strict=True):
            streams, pre = stage(streams, pre, input_ids, positions, self.rope, cache, metadata)
        return collapse_with(streams, pre)

    def base_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._shared[1](self.stages[-1].norm(hidden).float())

    def corrected_logits(self, base: torch.Tensor, previous: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return base + self.stages[-1].markov_head.bias(previous)

    def confidence_logit(self, hidden: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        """DeepSeek's raw confidence (before the sigmoid)."""
        last = self.stages[-1]
        features = torch.cat([hidden.float(), last.markov_head.embed(previous).float()], dim=-1)
        return last.confidence_head.proj(features).squeeze(-1)

    def confidence(self, hidden: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.confidence_logit(hidden, previous))


__all__: Sequence[str] = ["DSparkArgs", "DeepseekV41DSpark"]

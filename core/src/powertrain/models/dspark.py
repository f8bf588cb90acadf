"""DeepSeek's DSpark block drafter as DeepSpec saves it (``Qwen3DSparkModel``): its layers,
Markov and confidence heads, and loading a checkpoint folder.

The drafter reads the target's hidden states at ``target_layer_ids`` (layer outputs),
concatenated and projected to one context vector per position (``fc``, ``hidden_norm``).
Each of its Qwen3-shaped layers attends over keys and values of two kinds: a context
position's come from that projected vector (the same vector for every layer, each layer
projecting it with its own ``k_proj``/``v_proj``), a block position's from the block's own
hidden state. A block is the anchor token (the last token kept) and ``block_size - 1``
mask tokens at the positions after it, attending both ways among themselves and to every
context position before the anchor; its ``block_size`` outputs, through the head, are the
drafts' base logits. The Markov head adds a bigram bias from the token before each draft
(drafted one after another); the confidence head reads each block output with the
previous token's Markov embedding and predicts that the draft is accepted.

The layers run through the engine's attention backend with ``causal`` False
(capability ``non-causal``): the context keys and values sit in a paged cache like the
target's, the block's are written after them and attended in one call. The model
implements ``interfaces.BlockDraftModel``; the DSpark plugin drafts with it
(``SpeculativeContext.load_draft_model``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
from safetensors import safe_open
from torch import nn

from powertrain.interfaces import AttentionLayerSpec, AttentionMetadata, HiddenTap, LayerKVCache
from powertrain.layers.embedding import Embedding
from powertrain.layers.linear import Linear
from powertrain.layers.norm import RMSNorm
from powertrain.layers.rotary import RotaryEmbedding
from powertrain.models.llama import LlamaArgs, LlamaAttention, LlamaMLP
from powertrain.models.weights import check_complete, copy_checked, fused_targets, materialize

#: The DeepSpec architectures this module builds (Gemma 4's drafter is not supported yet).
ARCHITECTURES = ("Qwen3DSparkModel",)
MARKOV_HEADS = ("vanilla", "gated")


@attrs.frozen(kw_only=True)
class BlockDrafterConfig:
    """What a DeepSpec drafter's config.json says beyond its layers' Qwen3 shapes."""

    layers: LlamaArgs
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    block_size: int
    mask_token_id: int
    #: 0: no Markov head.
    markov_rank: int
    markov_head_type: str
    confidence_head: bool
    confidence_head_with_markov: bool

    @classmethod
    def from_config(cls, config: Mapping[str, Any], where: str) -> BlockDrafterConfig:
        """Read and check ``config`` (the folder ``where``'s config.json); a missing or
        unsupported key raises ValueError naming it."""
        architectures = list(config.get("architectures") or [])
        if not any(name in ARCHITECTURES for name in architectures):
            raise ValueError(
                f"{where}: architectures={architectures}; the block drafter loads DeepSpec's "
                f"{', '.join(ARCHITECTURES)} checkpoints"
            )

        def required(key: str) -> Any:
            if key not in config:
                raise ValueError(f"{where}: config.json lacks {key!r}, which a DeepSpec DSpark drafter has")
            return config[key]

        markov_rank = int(required("markov_rank"))
        head_type = str(config.get("markov_head_type", "vanilla")).lower() if markov_rank else "vanilla"
        if head_type not in MARKOV_HEADS:
            raise ValueError(
                f"{where}: markov_head_type={head_type!r}; supported: {', '.join(MARKOV_HEADS)} "
                "(the 'rnn' head carries a state through the block)"
            )
        confidence = bool(required("enable_confidence_head"))
        with_markov = confidence and bool(config.get("confidence_head_with_markov", False))
        if with_markov and not markov_rank:
            raise ValueError(f"{where}: confidence_head_with_markov needs a Markov head (markov_rank > 0)")
        block_size = int(required("block_size"))
        if block_size < 1:
            raise ValueError(f"{where}: block_size={block_size} must be at least 1")
        layers = LlamaArgs.from_config({**config, "model_type": "qwen3"})
        if any(window is not None for window in layers.sliding_windows):
            raise ValueError(f"{where}: the drafter's layers attend over its whole context; it sets a sliding window")
        return cls(
            layers=layers,
            target_layer_ids=tuple(int(i) for i in required("target_layer_ids")),
            num_target_layers=int(required("num_target_layers")),
            block_size=block_size,
            mask_token_id=int(required("mask_token_id")),
            markov_rank=markov_rank,
            markov_head_type=head_type,
            confidence_head=confidence,
            confidence_head_with_markov=with_markov,
        )

    def check_target(self, target: Mapping[str, Any], where: str) -> None:
        """Refuse a drafter trained for another target: its width, vocabulary, depth and
        tapped layers must fit ``target`` (the target checkpoint's config.json)."""
        problems = []
        for key, ours in (
            ("hidden_size", self.layers.hidden_size),
            ("vocab_size", self.layers.vocab_size),
            ("num_hidden_layers", self.num_target_layers),
        ):
            theirs = target.get(key)
            if theirs is not None and int(theirs) != ours:
                name = "num_target_layers" if key == "num_hidden_layers" else key
                problems.append(f"its {name} is {ours}, the target's {key} is {theirs}")
        last = self.num_target_layers - 1
        outside = [i for i in self.target_layer_ids if not 0 <= i < last]
        if outside or list(self.target_layer_ids) != sorted(set(self.target_layer_ids)):
            problems.append(
                f"target_layer_ids={list(self.target_layer_ids)} must be increasing layers of 0..{last - 1} "
                "(the last layer's output is not tapped; -1, the embedding, is not supported)"
            )
        if not 0 <= self.mask_token_id < self.layers.vocab_size:
            problems.append(f"mask_token_id={self.mask_token_id} is outside the vocabulary")
        if problems:
            raise ValueError(f"the drafter at {where} does not fit the target model: {'; '.join(problems)}")


class BlockLayer(nn.Module):
    def __init__(self, args: LlamaArgs, index: int, backend: Any) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(args, index, backend, causal=False)
        self.mlp = LlamaMLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, cache, meta)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class MarkovHead(nn.Module):
    """The bigram bias ``markov_w2(markov_w1[previous token])``; the gated head scales the
    embedding by a gate read from the block output and the embedding."""

    def __init__(self, vocab_size: int, rank: int, hidden_size: int, gated: bool) -> None:
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = Linear(rank, vocab_size, bias=False)
        self.gate_proj = Linear(hidden_size + rank, rank) if gated else None

    def bias(self, previous: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        embedded = self.markov_w1(previous)
        if self.gate_proj is not None:
            embedded = torch.sigmoid(self.gate_proj(torch.cat([hidden, embedded], dim=-1))) * embedded
        return self.markov_w2(embedded).float()


class ConfidenceHead(nn.Module):
    """DeepSpec's ``AcceptRatePredictor``: one linear unit, a logit of acceptance."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = Linear(width, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.proj(features).squeeze(-1).float()


class BlockDrafterModel(nn.Module):
    """The drafter's modules, named as DeepSpec saves them (q/k/v and gate/up fused).
    Implements ``interfaces.BlockDraftModel``."""

    def __init__(self, config: BlockDrafterConfig, backend: Any, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.config = config
        args = config.layers
        with torch.device("meta"):
            self.embed_tokens = Embedding(args.vocab_size, args.hidden_size)
            self.layers = nn.ModuleList(BlockLayer(args, i, backend) for i in range(args.num_layers))
            self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
            self.fc = Linear(len(config.target_layer_ids) * args.hidden_size, args.hidden_size, bias=False)
            self.hidden_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
            self.lm_head = Linear(args.hidden_size, args.vocab_size, bias=False)
            self.markov_head = (
                MarkovHead(args.vocab_size, config.markov_rank, args.hidden_size, config.markov_head_type == "gated")
                if config.markov_rank
                else None
            )
            width = args.hidden_size + (config.markov_rank if config.confidence_head_with_markov else 0)
            self.confidence_head = ConfidenceHead(width) if config.confidence_head else None
        materialize(self, dtype, device)
        self.requires_grad_(False)
        self.rotary_emb = RotaryEmbedding(args.head_dim, args.rope, args.max_position_embeddings)
        self.attention_layers: tuple[AttentionLayerSpec, ...] = tuple(
            layer.self_attn.attn.spec for layer in self.layers
        )
        kv_rows = args.num_kv_heads * args.head_dim
        self._fused = {
            "qkv_proj": (("q_proj", "k_proj", "v_proj"), (args.num_heads * args.head_dim, kv_rows, kv_rows)),
            "gate_up_proj": (("gate_proj", "up_proj"), (args.intermediate_size, args.intermediate_size)),
        }

    @property
    def taps(self) -> tuple[HiddenTap, ...]:
        """The target's layer outputs the drafter reads, in its ``fc``'s order."""
        return tuple(HiddenTap(layer, "layer_output") for layer in self.config.target_layer_ids)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    # -- loading ------------------------------------------------------------------------------

    def load_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        targets = fused_targets(self, self._fused)
        loaded, unexpected = set(), []
        with torch.no_grad():
            for name, tensor in weights:
                target = targets.get(name)
                if target is None:
                    unexpected.append(name)
                    continue
                copy_checked(name, target, tensor)
                loaded.add(name)
        check_complete("a DeepSpec DSpark drafter", unexpected, sorted(targets.keys() - loaded))

    # -- running ------------------------------------------------------------------------------

    def context(self, taps: Sequence[torch.Tensor]) -> torch.Tensor:
        """The target's tapped hidden states ``[rows, width]`` each -> context vectors."""
        dtype = self.hidden_norm.weight.dtype  # the model's (a Linear's weight may be packed away)
        return self.hidden_norm(self.fc(torch.cat([tap.to(dtype) for tap in taps], dim=-1)))

    def write_context(
        self,
        context: torch.Tensor,
        positions: torch.Tensor,
        caches: Sequence[LayerKVCache],
        metadata: AttentionMetadata,
    ) -> None:
        """Each layer's keys and values of ``context`` rows, written at their positions (the
        attention those rows also compute is not needed: its output is dropped)."""
        cos, sin = self.rotary_emb(positions, metadata.max_seq_len, context.dtype)
        for layer, cache in zip(self.layers, caches, strict=True):
            layer.self_attn(context, cos, sin, cache, metadata)

    def block(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        caches: Sequence[LayerKVCache],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """The blocks' final-normed outputs ``[rows, hidden]`` (one row per block position)."""
        hidden = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(positions, metadata.max_seq_len, hidden.dtype)
        for layer, cache in zip(self.layers, caches, strict=True):
            hidden = layer(hidden, cos, sin, cache, metadata)
        return self.norm(hidden)

    def base_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def corrected_logits(self, base: torch.Tensor, previous: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """``base`` logits with the Markov bias of the ``previous`` tokens (unchanged without
        a Markov head)."""
        if self.markov_head is None:
            return base
        return base + self.markov_head.bias(previous, hidden)

    def confidence(self, hidden: torch.Tensor, previous: torch.Tensor) -> torch.Tensor | None:
        """Predicted acceptance probabilities of the drafts ``hidden`` produced, or None
        without a confidence head."""
        if self.confidence_head is None:
            return None
        features = hidden
        if self.config.confidence_head_with_markov:
            assert self.markov_head is not None
            features = torch.cat([hidden, self.markov_head.markov_w1(previous).to(hidden.dtype)], dim=-1)
        return torch.sigmoid(self.confidence_head(features))


def read_drafter_config(folder: str | Path) -> BlockDrafterConfig:
    path = Path(folder)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(f"[dspark] draft_model = {str(folder)!r}: no config.json there (a DeepSpec drafter folder)")
    return BlockDrafterConfig.from_config(json.loads(config_file.read_text()), str(path))


def drafter_tensors(folder: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the folder's ``*.safetensors`` files."""
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise ValueError(f"[dspark] draft_model = {str(folder)!r}: no .safetensors files there")
    for file in files:
        with safe_open(str(file), framework="pt") as shard:
            for name in shard.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, shard.get_tensor(name)


def load_block_drafter(
    folder: str | Path, target_config: Mapping[str, Any], backend: Any, dtype: torch.dtype, device: torch.device
) -> BlockDrafterModel:
    """The drafter in ``folder``, checked against the target's config, weights loaded."""
    config = read_drafter_config(folder)
    config.check_target(target_config, str(folder))
    model = BlockDrafterModel(config, backend, dtype, device)
    model.load_weights(drafter_tensors(folder))
    return model

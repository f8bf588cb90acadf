"""DeepSeek's DSpark block drafters as DeepSpec saves them: ``Qwen3DSparkModel`` (here) and
``Gemma4DSparkModel`` (``models/dspark_gemma4.py``), their configs, and loading a checkpoint
folder (``load_block_drafter`` picks the class by the config's ``architectures``).

The drafter reads the target's hidden states at ``target_layer_ids`` (layer outputs),
concatenated and projected to one context vector per position (``fc``, ``hidden_norm``).
Each of its layers (Qwen3-shaped here) attends over keys and values of two kinds: a context
position's come from that projected vector (the same vector for every layer, each layer
projecting it with its own ``k_proj``/``v_proj``), a block position's from the block's own
hidden state. A block is the anchor token (the last token kept) and ``block_size - 1``
mask tokens at the positions after it, attending both ways among themselves and to every
context position before the anchor; its ``block_size`` outputs, through the head, are the
drafts' base logits. The Markov head adds a bigram bias from the token before each draft
(drafted one after another); the confidence head reads each block output with the
previous token's Markov embedding and predicts that the draft is accepted
(``models/dspark_base.py``: what both drafters share).

The layers run through the engine's attention backend with ``causal`` False
(capability ``non-causal``): the context keys and values sit in a paged cache like the
target's, the block's are written after them and attended in one call. The models
implement ``interfaces.BlockDraftModel``; the DSpark plugin drafts with them
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

from powertrain.interfaces import AttentionLayerSpec, AttentionMetadata, LayerKVCache
from powertrain.layers.embedding import Embedding
from powertrain.layers.linear import Linear
from powertrain.layers.norm import RMSNorm
from powertrain.layers.rotary import RotaryEmbedding
from powertrain.models.dspark_base import (
    MARKOV_HEADS,
    BlockDrafterBase,
    ConfidenceHead,
    DSparkKeys,
    MarkovHead,
    refuse_unfit,
)
from powertrain.models.dspark_gemma4 import GEMMA4_ARCHITECTURE, Gemma4BlockDrafterConfig, Gemma4BlockDrafterModel
from powertrain.models.llama import LlamaArgs, LlamaAttention, LlamaMLP
from powertrain.models.weights import fused_targets, materialize

QWEN3_ARCHITECTURE = "Qwen3DSparkModel"
#: The DeepSpec architectures ``load_block_drafter`` builds.
ARCHITECTURES = (QWEN3_ARCHITECTURE, GEMMA4_ARCHITECTURE)


@attrs.frozen(kw_only=True)
class BlockDrafterConfig(DSparkKeys):
    """A ``Qwen3DSparkModel``'s config.json: its layers' Qwen3 shapes and the DSpark keys."""

    layers: LlamaArgs

    @classmethod
    def from_config(cls, config: Mapping[str, Any], where: str) -> BlockDrafterConfig:
        """Read and check ``config`` (the folder ``where``'s config.json); a missing or
        unsupported key raises ValueError naming it."""
        keys = DSparkKeys.read(config, where, QWEN3_ARCHITECTURE)
        layers = LlamaArgs.from_config({**config, "model_type": "qwen3"})
        if any(window is not None for window in layers.sliding_windows):
            raise ValueError(f"{where}: the drafter's layers attend over its whole context; it sets a sliding window")
        return cls(layers=layers, **keys)

    def check_target(self, target: Mapping[str, Any], where: str) -> None:
        """Refuse a drafter trained for another target: its width, vocabulary, depth and
        tapped layers must fit ``target`` (the target checkpoint's config.json)."""
        refuse_unfit(self.fit_problems(target, self.layers.hidden_size, self.layers.vocab_size), where)


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


class BlockDrafterModel(BlockDrafterBase):
    """``Qwen3DSparkModel``'s modules, named as DeepSpec saves them (q/k/v and gate/up fused).
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
            self.add_heads(args.hidden_size, args.vocab_size)
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

    def weight_targets(self) -> dict[str, torch.Tensor]:
        return fused_targets(self, self._fused)

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


def read_drafter_config(folder: str | Path) -> BlockDrafterConfig | Gemma4BlockDrafterConfig:
    """The config of the drafter in ``folder``, of the class its ``architectures`` names."""
    path = Path(folder)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(f"[dspark] draft_model = {str(folder)!r}: no config.json there (a DeepSpec drafter folder)")
    config = json.loads(config_file.read_text())
    architectures = list(config.get("architectures") or [])
    if GEMMA4_ARCHITECTURE in architectures:
        return Gemma4BlockDrafterConfig.from_config(config, str(path))
    if QWEN3_ARCHITECTURE in architectures:
        return BlockDrafterConfig.from_config(config, str(path))
    raise ValueError(
        f"{path}: architectures={architectures}; the block drafter loads DeepSpec's {', '.join(ARCHITECTURES)} "
        "checkpoints"
    )


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
) -> BlockDrafterModel | Gemma4BlockDrafterModel:
    """The drafter in ``folder``, checked against the target's config, weights loaded."""
    config = read_drafter_config(folder)
    config.check_target(target_config, str(folder))
    model: BlockDrafterModel | Gemma4BlockDrafterModel
    if isinstance(config, Gemma4BlockDrafterConfig):
        model = Gemma4BlockDrafterModel(config, backend, dtype, device)
    else:
        model = BlockDrafterModel(config, backend, dtype, device)
    model.load_weights(drafter_tensors(folder))
    return model


__all__: Sequence[str] = [
    "ARCHITECTURES",
    "MARKOV_HEADS",
    "BlockDrafterConfig",
    "BlockDrafterModel",
    "ConfidenceHead",
    "DSparkKeys",
    "Gemma4BlockDrafterConfig",
    "Gemma4BlockDrafterModel",
    "MarkovHead",
    "drafter_tensors",
    "load_block_drafter",
    "read_drafter_config",
]

"""What DeepSpec's DSpark drafters share whatever their layers (DeepSpec's ``common.py`` and
``markov_head.py``): the DSpark keys of a drafter's config.json, the Markov and confidence
heads, the check that a drafter fits its target, and the methods of
``interfaces.BlockDraftModel`` that do not depend on the layers.

``models/dspark.py`` builds DeepSpec's ``Qwen3DSparkModel`` on it and loads every drafter;
``models/dspark_gemma4.py`` builds ``Gemma4DSparkModel``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import attrs
import torch
from torch import nn

from powertrain.interfaces import AttentionMetadata, HiddenTap, LayerKVCache
from powertrain.layers.linear import Linear
from powertrain.models.weights import check_complete, copy_checked

MARKOV_HEADS = ("vanilla", "gated")


@attrs.frozen(kw_only=True)
class DSparkKeys:
    """What a DeepSpec drafter's config.json says beyond its layers: the target layers it
    reads, its block and its heads."""

    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    block_size: int
    mask_token_id: int
    #: 0: no Markov head.
    markov_rank: int
    markov_head_type: str
    confidence_head: bool
    confidence_head_with_markov: bool

    @staticmethod
    def read(config: Mapping[str, Any], where: str, architecture: str) -> dict[str, Any]:
        """These keys of ``config`` (the folder ``where``'s config.json, which must name
        ``architecture``), checked, as keyword arguments; a missing or unsupported key raises
        ValueError naming it."""
        architectures = list(config.get("architectures") or [])
        if architecture not in architectures:
            raise ValueError(
                f"{where}: architectures={architectures}; this config class reads DeepSpec's {architecture}"
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
        return {
            "target_layer_ids": tuple(int(i) for i in required("target_layer_ids")),
            "num_target_layers": int(required("num_target_layers")),
            "block_size": block_size,
            "mask_token_id": int(required("mask_token_id")),
            "markov_rank": markov_rank,
            "markov_head_type": head_type,
            "confidence_head": confidence,
            "confidence_head_with_markov": with_markov,
        }

    def fit_problems(self, target: Mapping[str, Any], hidden_size: int, vocab_size: int) -> list[str]:
        """Why a drafter of this width and vocabulary does not fit ``target`` (a checkpoint's
        config.json; a composite one is read through its ``text_config``): its width,
        vocabulary and depth, and the tapped layers."""
        text = target.get("text_config") or target
        problems = []
        for key, ours in (
            ("hidden_size", hidden_size),
            ("vocab_size", vocab_size),
            ("num_hidden_layers", self.num_target_layers),
        ):
            theirs = text.get(key)
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
        if not 0 <= self.mask_token_id < vocab_size:
            problems.append(f"mask_token_id={self.mask_token_id} is outside the vocabulary")
        return problems


def refuse_unfit(problems: Sequence[str], where: str) -> None:
    if problems:
        raise ValueError(f"the drafter at {where} does not fit the target model: {'; '.join(problems)}")


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


class BlockDrafterBase(nn.Module):
    """The parts of ``interfaces.BlockDraftModel`` every DeepSpec drafter shares. A subclass
    builds ``embed_tokens``, ``layers`` (each with a ``self_attn`` called as ``(rows, cos,
    sin, cache, metadata)``), ``rotary_emb``, ``norm``, ``fc``, ``hidden_norm`` and
    ``lm_head`` (``add_heads`` the rest), and computes ``block`` and ``base_logits``."""

    config: DSparkKeys
    #: What ``load_weights`` calls the model in its errors.
    checkpoint_kind = "a DeepSpec DSpark drafter"

    def add_heads(self, hidden_size: int, vocab_size: int) -> None:
        """The Markov and confidence heads the config asks for (None where it asks for none)."""
        config = self.config
        self.markov_head = (
            MarkovHead(vocab_size, config.markov_rank, hidden_size, config.markov_head_type == "gated")
            if config.markov_rank
            else None
        )
        width = hidden_size + (config.markov_rank if config.confidence_head_with_markov else 0)
        self.confidence_head = ConfidenceHead(width) if config.confidence_head else None

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

    def weight_targets(self) -> dict[str, torch.Tensor]:
        """Checkpoint tensor name -> the tensor it fills (the parameters, by their names)."""
        return dict(self.named_parameters())

    def load_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        targets = self.weight_targets()
        loaded, unexpected = set(), []
        with torch.no_grad():
            for name, tensor in weights:
                target = targets.get(name)
                if target is None:
                    unexpected.append(name)
                    continue
                copy_checked(name, target, tensor)
                loaded.add(name)
        check_complete(self.checkpoint_kind, unexpected, sorted(targets.keys() - loaded))

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
        """Each layer's keys and values of ``context`` rows, written at their positions, nothing
        attended where the backend can store alone (``Attention.store``). The rows enter each
        layer's attention as they are, without the layer's input norm."""
        cos, sin = self.rotary_emb(positions, metadata.max_seq_len, context.dtype)
        for layer, cache in zip(self.layers, caches, strict=True):
            layer.self_attn.store(context, cos, sin, cache, metadata)

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

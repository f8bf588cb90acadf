"""DeepSpec's Gemma 4 DSpark drafter (``Gemma4DSparkModel``, DeepSpec's
``deepspec/modeling/dspark/gemma4``): the block drafter of ``models/dspark.py`` with Gemma 4's
layers, as DeepSpec builds them from transformers' Gemma 4 pieces (at its pin, 5.10.2):

* its config.json is the target's text config (``Gemma4TextConfig``) with the DSpark keys,
  ``architectures: ["Gemma4DSparkModel"]``, ``target_model_type``, ``target_text_model_type``,
  the drafter's ``num_hidden_layers`` and every layer ``full_attention``;
* the token embedding is scaled by sqrt(hidden_size), the factor rounded to the model dtype;
* each layer is shaped as the target's full-attention layers: heads of ``global_head_dim``,
  ``num_global_key_value_heads`` key/value heads with ``attention_k_eq_v`` (and then no
  ``v_proj``: the key projection's output is also the value), else ``num_key_value_heads``;
  query and key norms (weighted) and a value norm (unweighted), on context and block rows
  alike; attention scale 1; the full layers' RoPE table (``rope_parameters["full_attention"]``,
  "proportional": only part of each head rotates). No sliding window and no KV sharing: every
  layer attends over the whole context with keys and values of its own;
* four norms per layer (input, post-attention, pre- and post-feedforward), and a
  ``layer_scalar`` multiplying its output (a buffer in DeepSpec, saved in the checkpoint);
* a GELU-tanh MLP, twice as wide where transformers' ``Gemma4TextMLP`` makes it so for the
  drafter's own config: with ``use_double_wide_mlp``, layer ``i`` of the drafter's ``n`` when
  ``i >= n - num_kv_shared_layers > 0`` (5.10.2's rule; the checkpoint's shapes are checked
  against it at load);
* Gemma 4's RMSNorm everywhere (``fc``'s ``hidden_norm`` and the final norm too);
* the base logits are soft-capped (``final_logit_softcapping``); the Markov bias is added to
  the capped logits.

The layers are ``models/gemma4.py``'s with ``causal`` False, so they run through the engine's
attention backend like the Qwen3 drafter's (capability ``non-causal``).

Refused at load, naming the key and the folder: what DeepSpec refuses (``enable_moe_block``,
``hidden_size_per_layer_input`` other than 0, whose transformers default is 256), a config
that sizes the full layers only by ``per_layer_config`` (how later transformers save Gemma 4;
DeepSpec reads ``global_head_dim``), ``attention_k_eq_v`` without
``num_global_key_value_heads``, layer types other than ``full_attention``, a soft cap that is
not positive, and what ``models/gemma4.py`` refuses (another activation, other RoPE types).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch
from torch import nn

from powertrain.interfaces import AttentionLayerSpec, AttentionMetadata, LayerKVCache
from powertrain.layers.embedding import Embedding
from powertrain.layers.linear import Linear
from powertrain.layers.rotary import RotaryEmbedding
from powertrain.models.dspark_base import BlockDrafterBase, DSparkKeys, refuse_unfit
from powertrain.models.gemma4 import Gemma4Args, Gemma4DecoderLayer, GemmaRMSNorm, _rounded
from powertrain.models.weights import materialize

GEMMA4_ARCHITECTURE = "Gemma4DSparkModel"
#: The text model types of the targets a Gemma 4 drafter serves (a Gemma4ForCausalLM's, or the
#: ``text_config`` of a Gemma4ForConditionalGeneration).
TARGET_TEXT_MODEL_TYPES = ("gemma4_text",)
#: ``Gemma4TextConfig``'s default, which DeepSpec's drafter refuses.
_DEFAULT_PER_LAYER_INPUT = 256


@attrs.frozen(kw_only=True)
class Gemma4BlockDrafterConfig(DSparkKeys):
    """A ``Gemma4DSparkModel``'s config.json: its layers (every one shaped as a Gemma 4
    full-attention layer) and the DSpark keys."""

    layers: Gemma4Args

    @classmethod
    def from_config(cls, config: Mapping[str, Any], where: str) -> Gemma4BlockDrafterConfig:
        """Read and check ``config`` (the folder ``where``'s config.json); a missing or
        unsupported key raises ValueError naming it."""
        keys = DSparkKeys.read(config, where, GEMMA4_ARCHITECTURE)
        _refuse_what_deepspec_refuses(config, where)
        num_layers = config.get("num_hidden_layers")
        if not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"{where}: num_hidden_layers={num_layers!r}; a drafter has at least one layer")
        readable = {key: value for key, value in config.items() if key not in _NOT_READ}
        layer_config = {
            **readable,
            "layer_types": ["full_attention"] * num_layers,
            "num_kv_shared_layers": 0,  # each drafter layer computes its own keys and values
            "use_double_wide_mlp": False,  # widened below, by the drafter's own rule
            "hidden_size_per_layer_input": 0,
        }
        try:
            args = Gemma4Args.from_config(layer_config)
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from None
        return cls(layers=attrs.evolve(args, layers=_widened(args, config)), **keys)

    def check_target(self, target: Mapping[str, Any], where: str) -> None:
        """Refuse a drafter trained for another target: a Gemma 4 text model (flat, or a
        ``text_config``) of the drafter's width, vocabulary and depth, with the tapped layers."""
        text = target.get("text_config") or target
        problems = self.fit_problems(target, self.layers.hidden_size, self.layers.vocab_size)
        model_type = text.get("model_type")
        if model_type is not None and model_type not in TARGET_TEXT_MODEL_TYPES:
            problems.insert(
                0,
                f"it is DeepSpec's Gemma 4 drafter ({GEMMA4_ARCHITECTURE}), the target's model_type is {model_type!r}",
            )
        refuse_unfit(problems, where)


#: Keys ``Gemma4Args`` would read but DeepSpec's drafter does not: the target's per-layer head
#: shapes (its layers are all full-attention layers sized by global_head_dim) and whether the
#: target's text attends both ways (the drafter's attention is never causal).
_NOT_READ = ("per_layer_config", "use_bidirectional_attention")


def _refuse_what_deepspec_refuses(config: Mapping[str, Any], where: str) -> None:
    if config.get("enable_moe_block"):
        raise ValueError(f"{where}: enable_moe_block=True; DeepSpec's Gemma 4 drafter has no MoE layers")
    per_layer_input = config.get("hidden_size_per_layer_input", _DEFAULT_PER_LAYER_INPUT)
    if per_layer_input:
        raise ValueError(
            f"{where}: hidden_size_per_layer_input={per_layer_input} (transformers' default when absent: "
            f"{_DEFAULT_PER_LAYER_INPUT}); DeepSpec's Gemma 4 drafter has no per-layer inputs, it must be 0"
        )
    if "global_head_dim" not in config and "per_layer_config" in config:
        raise ValueError(
            f"{where}: config.json sizes the full-attention layers by per_layer_config but lacks 'global_head_dim', "
            "which DeepSpec's Gemma 4 drafter sizes its heads by"
        )
    if config.get("attention_k_eq_v") and config.get("num_global_key_value_heads") is None:
        raise ValueError(
            f"{where}: attention_k_eq_v=True without 'num_global_key_value_heads', the drafter's key/value heads"
        )
    kinds = sorted(set(config.get("layer_types") or ["full_attention"]) - {"full_attention"})
    if kinds:
        raise ValueError(
            f"{where}: layer_types names {kinds}; DeepSpec's Gemma 4 drafter layers are all full_attention "
            "(each attends over the whole context)"
        )
    cap = config.get("final_logit_softcapping")
    if cap is not None and not float(cap) > 0:
        raise ValueError(f"{where}: final_logit_softcapping={cap} must be positive (or null: no soft cap)")


def _widened(args: Gemma4Args, config: Mapping[str, Any]) -> tuple[Any, ...]:
    """The layers, the double-wide ones widened: transformers 5.10.2's ``Gemma4TextMLP`` doubles
    layer ``i`` when ``use_double_wide_mlp`` and ``i >= n - num_kv_shared_layers > 0``, with the
    drafter's own ``n``."""
    first = args.num_layers - int(config.get("num_kv_shared_layers") or 0)
    wide = bool(config.get("use_double_wide_mlp")) and first > 0
    return tuple(
        attrs.evolve(layer, intermediate_size=2 * layer.intermediate_size) if wide and index >= first else layer
        for index, layer in enumerate(args.layers)
    )


class Gemma4BlockDrafterModel(BlockDrafterBase):
    """``Gemma4DSparkModel``'s modules, named as DeepSpec saves them. Implements
    ``interfaces.BlockDraftModel``."""

    checkpoint_kind = "a DeepSpec Gemma 4 DSpark drafter"

    def __init__(
        self, config: Gemma4BlockDrafterConfig, backend: Any, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.config = config
        args = config.layers
        hidden, eps = args.hidden_size, args.rms_norm_eps
        with torch.device("meta"):
            self.embed_tokens = Embedding(args.vocab_size, hidden)
            self.layers = nn.ModuleList(
                Gemma4DecoderLayer(args, i, backend, causal=False) for i in range(args.num_layers)
            )
            self.norm = GemmaRMSNorm(hidden, eps)
            self.fc = Linear(len(config.target_layer_ids) * hidden, hidden, bias=False)
            self.hidden_norm = GemmaRMSNorm(hidden, eps)
            self.lm_head = Linear(hidden, args.vocab_size, bias=False)
            self.add_heads(hidden, args.vocab_size)
        materialize(self, dtype, device)
        self.requires_grad_(False)
        # transformers keeps the factor as a tensor it casts to the model dtype.
        self.embed_scale = _rounded(hidden**0.5, dtype)
        full = args.layers[0]  # every layer is a full-attention one, with one table
        self.rotary_emb = RotaryEmbedding(full.head_dim, full.rope, args.max_position_embeddings)
        self.attention_layers: tuple[AttentionLayerSpec, ...] = tuple(
            layer.self_attn.attn.spec for layer in self.layers
        )

    def block(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        caches: Sequence[LayerKVCache],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """The blocks' final-normed outputs ``[rows, hidden]`` (one row per block position)."""
        hidden = self.embed_tokens(input_ids) * self.embed_scale
        cos, sin = self.rotary_emb(positions, metadata.max_seq_len, hidden.dtype)
        for layer, cache in zip(self.layers, caches, strict=True):
            hidden, _ = layer(hidden, None, cos, sin, cache, metadata, None)
        return self.norm(hidden)

    def base_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = self.config.layers.final_logit_softcapping
        if cap is not None:
            # In the model dtype, as DeepSpec's compute_logits caps them, then widened.
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

"""``write_tiny_deepspec_drafter``: a tiny random DSpark block drafter in the layout of
DeepSeek's DeepSpec (github.com/deepseek-ai/DeepSpec, ``Qwen3DSparkModel.save_pretrained`` for
a Qwen3 target, ``Gemma4DSparkModel.save_pretrained`` for a Gemma 4 one), written from a seed
and a tiny target alone: no DeepSpec import.

What makes it DeepSpec's layout:

- ``config.json`` is the target's config (a Gemma 4 target's text config) with what
  DeepSpec's ``build_draft_config`` sets on a copy of it: ``architectures`` (its class),
  ``num_target_layers`` (the target's depth), ``num_hidden_layers`` (the drafter's),
  ``layer_types``, ``block_size``, ``mask_token_id``, ``target_layer_ids``, ``num_anchors``,
  ``tie_word_embeddings: false``, ``enable_confidence_head`` (with
  ``confidence_head_with_markov`` only when enabled) and ``markov_rank`` (with
  ``markov_head_type`` only when above zero); for Gemma 4 also ``target_model_type`` and
  ``target_text_model_type`` (the target's top and text model types).
- ``model.safetensors`` holds the names DeepSpec's model saves, without a ``model.`` prefix:
  ``embed_tokens``, ``layers.N.{input_layernorm, self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm,
  post_attention_layernorm, mlp.{gate,up,down}_proj}``, ``norm``, ``fc`` (the tapped target
  layers, concatenated, to the hidden size), ``hidden_norm``, ``lm_head``,
  ``markov_head.markov_w{1,2}`` (and ``markov_head.gate_proj`` for the gated head) and
  ``confidence_head.proj``. A Gemma 4 drafter's layers also have
  ``{pre,post}_feedforward_layernorm`` and ``layer_scalar``, and no ``v_proj`` with
  ``attention_k_eq_v``.
- ``embed_tokens`` and ``lm_head`` are the target's, as DeepSpec's training copies and freezes
  them. No tokenizer: DeepSpec's evaluator reads the target's.

The golden fixtures in ``plugins/dspark/tests/fixtures/deepspec`` (Qwen3) and
``deepspec_gemma4`` were computed by DeepSpec's own code on this drafter; the same call writes
the same bytes.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from powertrain.testing.checkpoints import RECIPE_FILE, _reuse_or_clear, _write_tensors

__all__ = [
    "DEEPSPEC_NUM_ANCHORS",
    "MARKOV_HEAD_TYPES",
    "anchor_tensor_scheme",
    "check_anchor_heads",
    "check_engine_proposals",
    "deepspec_drafter_shapes",
    "write_tiny_deepspec_drafter",
]

#: Training anchors per sample, as every DSpark config of DeepSpec sets it (unused at inference).
DEEPSPEC_NUM_ANCHORS = 512
MARKOV_HEAD_TYPES = ("vanilla", "gated")


def write_tiny_deepspec_drafter(
    path: str | Path,
    target: str | Path,
    *,
    seed: int = 0,
    block_size: int = 7,
    num_layers: int = 2,
    target_layer_ids: Sequence[int] = (0, 2),
    markov_rank: int = 16,
    markov_head_type: str = "vanilla",
    confidence_head: bool = True,
    confidence_head_with_markov: bool = True,
    mask_token_id: int = 3,
) -> Path:
    """Write a tiny random DeepSpec DSpark drafter for the checkpoint folder ``target`` (a
    Qwen3 one, e.g. from ``write_tiny_qwen3``, or a Gemma 4 one from
    ``write_tiny_gemma4(..., global_head_keys=True, hidden_size_per_layer_input=0)``, flat or
    ``conditional_generation``) to ``path`` (new or empty) and return it.

    Weights are drawn in name order from one generator seeded with ``seed``, in the target's
    dtype: every RMSNorm weight and Gemma 4's ``layer_scalar`` 1 + 0.1 N(0, 1), linear
    weights N(0, 1/fan_in), biases 0.1 N(0, 1), the Markov head's ``markov_w1`` table
    N(0, 1); ``embed_tokens`` and ``lm_head`` are copied from the target. So every part
    moves the logits and the confidences, and a part wired wrongly shows. ``markov_rank=0``
    builds no Markov head, ``confidence_head=False`` no confidence head. A second call with
    the same arguments (and the same target) returns at once.

    DeepSpec builds a Gemma 4 drafter only for a ``Gemma4ForConditionalGeneration`` target
    (its ``build_draft_config`` asks for a ``text_config``); for a flat ``Gemma4ForCausalLM``
    one this writes what it would: both target model types are the text config's.
    """
    folder, target = Path(path), Path(target)
    target_config = json.loads((target / "config.json").read_text(encoding="utf-8"))
    gemma4 = _is_gemma4(target_config)
    text_config = target_config.get("text_config") or target_config
    layer_ids = [int(layer) for layer in target_layer_ids]
    _check_arguments(
        text_config, layer_ids, markov_rank, markov_head_type, confidence_head, confidence_head_with_markov
    )
    if gemma4:
        _check_gemma4_target(text_config, target)
    recipe = {
        "variant": "deepspec-dspark-gemma4" if gemma4 else "deepspec-dspark-qwen3",
        "seed": seed,
        "target_digest": _digest(target, ("config.json", "model.safetensors")),
        "block_size": block_size,
        "num_layers": num_layers,
        "target_layer_ids": layer_ids,
        "markov_rank": markov_rank,
        "markov_head_type": markov_head_type,
        "confidence_head": confidence_head,
        "confidence_head_with_markov": confidence_head_with_markov,
        "mask_token_id": mask_token_id,
    }
    if _reuse_or_clear(folder, recipe):
        return folder

    config = {
        **text_config,
        "architectures": ["Gemma4DSparkModel" if gemma4 else "Qwen3DSparkModel"],
        "num_target_layers": text_config["num_hidden_layers"],
        "num_hidden_layers": num_layers,
        "block_size": block_size,
        "tie_word_embeddings": False,
        "layer_types": ["full_attention"] * num_layers,
        "mask_token_id": mask_token_id,
        "target_layer_ids": layer_ids,
        "num_anchors": DEEPSPEC_NUM_ANCHORS,
        "enable_confidence_head": confidence_head,
        "markov_rank": markov_rank,
    }
    if confidence_head:
        config["confidence_head_with_markov"] = confidence_head_with_markov
    if markov_rank > 0:
        config["markov_head_type"] = markov_head_type
    if gemma4:
        config["target_model_type"] = target_config["model_type"]
        config["target_text_model_type"] = text_config["model_type"]
        # What save_pretrained writes of a text config of its own under transformers 5.10.2
        # (DeepSpec's pin): the dtype and version a composite config keeps at its top, and the
        # defaults its RoPE standardization sets beside the per-layer-type tables.
        for key in ("dtype", "transformers_version"):
            if key in target_config:
                config.setdefault(key, target_config[key])
        config["rope_parameters"] = {"rope_type": "default", "rope_theta": None, **text_config["rope_parameters"]}
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    embed, head = _target_embedding_and_head(target)
    generator = torch.Generator().manual_seed(seed)
    tensors = {"embed_tokens.weight": embed.clone(), "lm_head.weight": head.clone()}
    for name, shape in sorted(deepspec_drafter_shapes(config).items()):
        if name in tensors:
            continue
        values = torch.randn(shape, generator=generator, dtype=torch.float32)
        if name.endswith(("norm.weight", "layer_scalar")):
            values = 1 + 0.1 * values
        elif name.endswith(".bias"):
            values = 0.1 * values
        elif name != "markov_head.markov_w1.weight":  # a lookup table, not a sum over fan-in
            values = values / shape[-1] ** 0.5
        tensors[name] = values.to(embed.dtype)
    _write_tensors(folder / "model.safetensors", tensors)

    files = sorted(file.name for file in folder.iterdir())
    (folder / RECIPE_FILE).write_text(json.dumps({**recipe, "files": files}, indent=2) + "\n")
    return folder


def deepspec_drafter_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor DeepSpec's ``Qwen3DSparkModel`` or ``Gemma4DSparkModel``
    (by its ``architectures``) saves for ``config`` (a drafter's config.json)."""
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    inter, rank = config["intermediate_size"], config["markov_rank"]
    gemma4 = "Gemma4DSparkModel" in config["architectures"]
    value_is_key = False
    if gemma4:  # every layer shaped as a full-attention one (DeepSpec's Gemma4DSparkAttention)
        head_dim = config.get("global_head_dim", 512)
        value_is_key = bool(config.get("attention_k_eq_v"))
        kv_heads = config["num_global_key_value_heads"] if value_is_key else kv_heads
    shapes: dict[str, tuple[int, ...]] = {
        "embed_tokens.weight": (vocab, hidden),
        "lm_head.weight": (vocab, hidden),
        "norm.weight": (hidden,),
        "fc.weight": (hidden, len(config["target_layer_ids"]) * hidden),
        "hidden_norm.weight": (hidden,),
    }
    projections = {
        "self_attn.q_proj": (heads * head_dim, hidden),
        "self_attn.k_proj": (kv_heads * head_dim, hidden),
        "self_attn.v_proj": (kv_heads * head_dim, hidden),
        "self_attn.o_proj": (hidden, heads * head_dim),
    }
    if value_is_key:
        del projections["self_attn.v_proj"]
    layers = config["num_hidden_layers"]
    for layer in range(layers):
        prefix = f"layers.{layer}."
        for name, shape in projections.items():
            shapes[f"{prefix}{name}.weight"] = shape
            if config.get("attention_bias"):
                shapes[f"{prefix}{name}.bias"] = shape[:1]
        width = inter * (2 if gemma4 and _gemma4_double_wide(config, layer) else 1)
        shapes |= {
            f"{prefix}self_attn.q_norm.weight": (head_dim,),
            f"{prefix}self_attn.k_norm.weight": (head_dim,),
            f"{prefix}input_layernorm.weight": (hidden,),
            f"{prefix}post_attention_layernorm.weight": (hidden,),
            f"{prefix}mlp.gate_proj.weight": (width, hidden),
            f"{prefix}mlp.up_proj.weight": (width, hidden),
            f"{prefix}mlp.down_proj.weight": (hidden, width),
        }
        if gemma4:
            shapes |= {
                f"{prefix}pre_feedforward_layernorm.weight": (hidden,),
                f"{prefix}post_feedforward_layernorm.weight": (hidden,),
                f"{prefix}layer_scalar": (1,),
            }
    if rank > 0:
        shapes["markov_head.markov_w1.weight"] = (vocab, rank)
        shapes["markov_head.markov_w2.weight"] = (vocab, rank)
        if config["markov_head_type"] == "gated":
            shapes["markov_head.gate_proj.weight"] = (rank, hidden + rank)
            shapes["markov_head.gate_proj.bias"] = (rank,)
    if config["enable_confidence_head"]:
        features = hidden + (rank if config["confidence_head_with_markov"] else 0)
        shapes["confidence_head.proj.weight"] = (1, features)
        shapes["confidence_head.proj.bias"] = (1,)
    return shapes


def _check_arguments(
    target_config: dict[str, Any],
    layer_ids: list[int],
    markov_rank: int,
    markov_head_type: str,
    confidence_head: bool,
    confidence_head_with_markov: bool,
) -> None:
    """Refuse what DeepSpec would refuse (its config checks, and its evaluator's: the target's
    last layer is not tapped, as transformers returns it normalised)."""
    last = target_config["num_hidden_layers"] - 1
    if not layer_ids or any(not -1 <= layer < last for layer in layer_ids) or layer_ids != sorted(set(layer_ids)):
        raise ValueError(
            f"target_layer_ids must be strictly increasing, each -1 (the embeddings) or a layer in "
            f"[0, {last - 1}] of the {last + 1}-layer target; got {layer_ids}"
        )
    if markov_rank < 0:
        raise ValueError(f"markov_rank must be >= 0, got {markov_rank}")
    if markov_rank and markov_head_type not in MARKOV_HEAD_TYPES:
        raise ValueError(f"markov_head_type must be one of {MARKOV_HEAD_TYPES}, got {markov_head_type!r}")
    if confidence_head and confidence_head_with_markov and not markov_rank:
        raise ValueError("confidence_head_with_markov needs a Markov head (markov_rank > 0)")


def _is_gemma4(target_config: dict[str, Any]) -> bool:
    text = target_config.get("text_config") or target_config
    return text.get("model_type") == "gemma4_text"


def _check_gemma4_target(text_config: dict[str, Any], target: Path) -> None:
    """Refuse what DeepSpec's Gemma 4 drafter refuses, or reads otherwise than the config says."""
    if text_config.get("enable_moe_block"):
        raise ValueError(f"{target}: enable_moe_block=True; DeepSpec's Gemma 4 drafter has no MoE layers")
    if text_config.get("hidden_size_per_layer_input", 256):
        raise ValueError(
            f"{target}: hidden_size_per_layer_input must be 0 (DeepSpec's Gemma 4 drafter has no per-layer inputs); "
            "write the target with hidden_size_per_layer_input=0"
        )
    if "global_head_dim" not in text_config:
        raise ValueError(
            f"{target}: its config gives the full layers' head shapes only as per_layer_config; DeepSpec's Gemma 4 "
            "drafter reads global_head_dim and num_global_key_value_heads: write the target with "
            "write_tiny_gemma4(..., global_head_keys=True)"
        )


def _gemma4_double_wide(config: dict[str, Any], layer: int) -> bool:
    """Whether transformers' ``Gemma4TextMLP`` (5.10.2, DeepSpec's pin) doubles the drafter's
    layer ``layer`` (its config's own ``num_hidden_layers``)."""
    first = config["num_hidden_layers"] - int(config.get("num_kv_shared_layers") or 0)
    return bool(config.get("use_double_wide_mlp")) and layer >= first > 0


#: Where a checkpoint keeps its text model's token embedding (a causal LM; Gemma 4's multimodal class).
_EMBEDDINGS = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight")


def _target_embedding_and_head(target: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's token embedding and ``lm_head`` weights (the embedding when tied)."""
    found: dict[str, torch.Tensor] = {}
    for shard in sorted(target.glob("*.safetensors")):
        with safe_open(shard, "pt") as file:
            for name in (*_EMBEDDINGS, "lm_head.weight"):
                if name in file.keys():  # noqa: SIM118 (safe_open is no mapping)
                    found[name] = file.get_tensor(name)
    embeddings = [found[name] for name in _EMBEDDINGS if name in found]
    if not embeddings:
        raise ValueError(f"{target} holds none of {', '.join(_EMBEDDINGS)}: pass a Qwen3 or Gemma 4 checkpoint folder")
    embed = embeddings[0]
    return embed, found.get("lm_head.weight", embed)


def _digest(folder: Path, names: Sequence[str]) -> str:
    digest = hashlib.sha256()
    for name in names:
        digest.update((folder / name).read_bytes())
    return digest.hexdigest()


def spy_on_block_drafts(drafter: Any) -> Callable[[], list[tuple[list[int], list[int], list[float]]]]:
    """Record the drafts a block drafter's sessions give the length rule, step after step;
    returns what gives them, once the steps ran, as (the slot's tokens so far, its drafts,
    their raw confidences) per slot and step."""
    session = drafter.session
    sessions: list[tuple[list[list[int]], Any]] = []

    def spy(slots: list) -> Any:
        drafting = session(slots)
        sessions.append(([list(slot.token_ids) for slot in slots], drafting))
        return drafting

    drafter.session = spy

    def drafted() -> list[tuple[list[int], list[int], list[float]]]:
        rows = []
        for histories, drafting in sessions:
            batch = drafting.drafts()
            rows.extend(
                (h, list(t), list(c)) for h, t, c in zip(histories, batch.tokens, batch.confidences, strict=True)
            )
        return rows

    return drafted


def check_engine_proposals(
    config: Any, tokens: list[int], prompt_len: int, golden: dict[str, torch.Tensor], scenario: str, tolerance: float
) -> None:
    """The engine built from ``config`` (a block drafter under fixed-k) continues the first
    ``prompt_len`` of ``tokens`` greedily to ``tokens``, and every block it drafts at an anchor
    the golden fixtures hold (at least 5) has their draft tokens and, within ``tolerance``,
    their confidences (sigmoid of ``<scenario>.anchor_<a>.confidence_logits``)."""
    from powertrain import LLM, SamplingParams

    prompt = tokens[:prompt_len]
    with LLM(config=config) as llm:
        drafted = spy_on_block_drafts(llm.speculative_policy.drafter)
        params = SamplingParams(temperature=0, max_tokens=len(tokens) - prompt_len, ignore_eos=True)
        output = llm.generate([prompt], [params])[0].outputs[0].token_ids
    proposals = [(len(history) - 1, drafts, confidences) for history, drafts, confidences in drafted()]
    assert prompt + list(output) == tokens, "the engine's greedy continuation is not the fixture's"
    anchors = [anchor for anchor, drafts, _ in proposals if drafts and f"{scenario}.anchor_{anchor}.tokens" in golden]
    assert len(anchors) >= 5, f"only {len(anchors)} blocks at fixture anchors: {proposals}"
    for anchor, drafts, confidences in proposals:
        key = f"{scenario}.anchor_{anchor}"
        if not drafts or f"{key}.tokens" not in golden:
            continue
        count = len(drafts)
        assert drafts == golden[f"{key}.tokens"][:count].tolist(), f"draft tokens at anchor {anchor}"
        want = torch.sigmoid(golden[f"{key}.confidence_logits"][:count])
        torch.testing.assert_close(torch.tensor(confidences), want, atol=tolerance, rtol=0, msg=f"anchor {anchor}")


def anchor_tensor_scheme(
    scenario: str, anchors: list[int], full: list[int], forced: list[int], block: int, vocab: int
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype) of a DeepSpec golden file's tensors for one scenario's anchors
    (the scheme of the fixtures' READMEs): every anchor's tokens and logits of the chosen
    drafts and confidences, full logits at ``full`` anchors, forced paths at ``forced`` ones."""
    expected = {}
    for key, listed in (("anchors", anchors), ("full_logit_anchors", full), ("forced_anchors", forced)):
        expected[f"{scenario}.{key}"] = ((len(listed),), torch.int64)
    for anchor in anchors:
        prefix = f"{scenario}.anchor_{anchor}."
        expected[prefix + "tokens"] = ((block,), torch.int64)
        expected[prefix + "confidence_logits"] = ((block,), torch.float32)
        expected[prefix + "chosen_logits"] = ((block,), torch.float32)
        if anchor in full:
            expected[prefix + "logits"] = ((block, vocab), torch.float32)
            expected[prefix + "base_logits"] = ((block, vocab), torch.float32)
        if anchor in forced:
            expected[prefix + "forced_tokens"] = ((block,), torch.int64)
            expected[prefix + "forced_logits"] = ((block, vocab), torch.float32)
            expected[prefix + "forced_confidence_logits"] = ((block,), torch.float32)
    return expected


def check_anchor_heads(
    model: Any,
    hidden: torch.Tensor,
    anchor_token: torch.Tensor,
    golden: dict[str, torch.Tensor],
    key: str,
    tolerance: float,
    where: str,
) -> None:
    """A drafter's heads on the block ``hidden`` it made at one golden anchor (``key``:
    ``<scenario>.anchor_<a>``; ``anchor_token`` a 1-element tensor): along the greedy path (and
    a forced one where the fixtures hold it), the Markov-corrected logits, the greedy drafts'
    chosen logits, the base logits and the confidences equal the fixtures within ``tolerance``."""
    base = model.base_logits(hidden)
    paths = {"": golden[f"{key}.tokens"]}
    if f"{key}.forced_tokens" in golden:
        paths["forced_"] = golden[f"{key}.forced_tokens"]
    for prefix, path in paths.items():
        previous = torch.cat([anchor_token, path[:-1]])
        logits = model.corrected_logits(base, previous, hidden)
        confidence = model.confidence(hidden, previous)
        at = f"{where}, {prefix or 'greedy '}path"
        if f"{key}.{prefix}logits" in golden:
            torch.testing.assert_close(logits, golden[f"{key}.{prefix}logits"], atol=tolerance, rtol=0, msg=at)
        if not prefix:
            assert logits.argmax(-1).tolist() == path.tolist(), at
            chosen = logits.gather(1, path[:, None])[:, 0]
            torch.testing.assert_close(chosen, golden[f"{key}.chosen_logits"], atol=tolerance, rtol=0, msg=at)
            if f"{key}.base_logits" in golden:
                torch.testing.assert_close(base, golden[f"{key}.base_logits"], atol=tolerance, rtol=0, msg=at)
        want = torch.sigmoid(golden[f"{key}.{prefix}confidence_logits"])
        torch.testing.assert_close(confidence, want, atol=tolerance, rtol=0, msg=at)

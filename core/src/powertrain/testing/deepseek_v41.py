"""``write_tiny_deepseek_v41``: a tiny random DeepSeek-V4.1-Flash checkpoint in the release's
own layout, written from a seed alone (no transformers: none released one).

What makes it the release's layout, as DeepSeek's ``inference/model.py`` builds the model
and loads it (its ``state_dict`` names and storage types):

- ``config.json`` is the composite config of the transformers pull request
  (``model_type: deepseek_v41``; ``text_config`` in its names, ``vision_config``, the top-level
  ``quantization_config`` with ``expert_dtype: fp4`` and 32x32 ue8m0 blocks).
- Tensor names are the native ones: top-level ``embed``, ``norm``, ``head``, ``layers.N.*``
  (mHC ``hc_{attn,ffn}_{fn,base,scale}``, ``attn.*``, ``attn.compressor.*`` on KV sources,
  ``attn.indexer.*`` on index sources, ``ffn.gate``, ``ffn.experts.E.w{1,2,3}``,
  ``ffn.shared_experts.w{1,2,3}``, ``engram.*`` on Engram layers) and ``mtp.K.*`` for the
  DSpark layers; quantised weights have a ``.scale`` beside them.
- Storage, as the release's files hold it (which DeepSeek's ``convert.py`` turns into the
  model's types at load: ``wo_a`` to bfloat16, the experts' bytes viewed as
  ``float4_e2m1fn_x2``, DSpark's copies of ``embed``/``head`` dropped for the tied ones):
  dense projections (``wo_a`` included) float8_e4m3fn with one ``float8_e8m0fnu`` scale per
  32x32 block; routed experts int8 ``[rows, cols/2]`` of e2m1 codes (even column in the low
  nibble) with one scale per 32 columns; Engram tables float8_e4m3fn with one scale per 32
  columns of a row; routers, norms, compressors, the indexer's ``wk``/``weights_proj``,
  ``embed``, ``head`` and DSpark's heads bfloat16; mHC, sinks and both router biases
  (``bias``, and ``bias_vl`` for image tokens) float32.

Every value is a seeded function of ``seed`` and the config, in name order, so the same call
writes the same bytes (``checkpoint_digest`` names them): the golden fixtures in
``core/tests/fixtures/deepseek_v41`` were computed by DeepSeek's code on this checkpoint.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from powertrain.layers.engram import EngramLayout, compressed_token_map
from powertrain.testing.checkpoints import (
    _finish,
    _recipe,
    _reuse_or_clear,
    _tokenizer_for,
    _write_tensors,
    quantize_fp4,
    quantize_fp8_ue8m0,
)

if TYPE_CHECKING:
    from powertrain.interfaces import ModelContext
    from powertrain.models.deepseek_v41 import DeepseekV41ForCausalLM

#: The schedule of the issue: ratio 0 (window only); a KV and index source at ratio 2; a
#: reader at ratio 2; a KV, index and candidate source at ratio 1; a reader at ratio 1; an
#: index source at ratio 1 (scoring inside the candidates); then one DSpark layer.
TINY_DEEPSEEK_V41_TEXT_CONFIG: Mapping[str, Any] = {
    "hidden_size": 256,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "q_lora_rank": 64,
    "qk_rope_head_dim": 16,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    # YaRN on the compressed branch, its ramp active within the tiny context.
    "rope_scaling": {
        "rope_type": "yarn",
        "factor": 4.0,
        "beta_fast": 32,
        "beta_slow": 1,
        "original_max_position_embeddings": 32,
    },
    "max_position_embeddings": 256,
    "sliding_window": 16,
    "compress_ratios": [0, 2, 2, 1, 1, 1, 0],
    "kv_source_layer_ids": [1, 3],
    "index_source_layer_ids": [1, 3, 5],
    "candidate_source_layer_id": 3,
    "candidate_topk_blocks": 3,
    "candidate_block_size": 4,
    "index_n_heads": 8,
    "index_head_dim": 64,
    "index_topk": 8,
    "o_groups": 2,
    "o_lora_rank": 64,
    "moe_intermediate_size": 128,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "scoring_func": "sqrtsoftplus",
    "gate_temp": 1.25,
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "topk_method": "noaux_tc",
    "swiglu_limit": 10.0,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "engram_layer_ids": [0, 1],
    "engram_vocab_size": 100,
    "engram_max_ngram_size": 4,
    "engram_n_heads": 2,
    "engram_head_dim": 32,
    "engram_pad_id": 2,
    "num_nextn_predict_layers": 1,
    "dspark_block_size": 2,
    "dspark_target_layer_ids": [4, 5],
    "dspark_markov_rank": 32,
    "dspark_n_routed_experts": 4,
    "dspark_num_experts_per_tok": 2,
    "rms_norm_eps": 1e-20,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
}

#: A tiny vision tower (``write_tiny_deepseek_v41(..., vision=True)``): the release's patch
#: and merge sizes, a small token budget and minimum area so that its images stay small.
TINY_DEEPSEEK_V41_VISION_CONFIG: Mapping[str, Any] = {
    "num_hidden_layers": 2,
    "hidden_size": 32,
    "num_attention_heads": 2,
    "intermediate_size": 48,
    "patch_size": 14,
    "rope_theta": 10000.0,
    "downsample_ratio": 3,
    "max_n_token": 30,
    "min_pixels": 2500,
    "max_wh_ratio": None,
}

#: The release's quantisation: FP8 dense weights in 32x32 blocks, FP4 experts, ue8m0 scales.
DEEPSEEK_V41_QUANTIZATION_CONFIG: Mapping[str, Any] = {
    "activation_scheme": "dynamic",
    "expert_dtype": "fp4",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "scale_fmt": "ue8m0",
    "weight_block_size": [32, 32],
}

#: Bumped whenever the same arguments would write other bytes (a folder of another layout is rewritten).
LAYOUT = 2
#: How each weight is stored (see the module docstring).
FP8, FP4, ENGRAM, BF16, F32 = "fp8", "fp4", "engram", "bf16", "f32"
BLOCK = 32


#: The release's image sizing (a 1,024-token budget, images under 544 x 544 pixels of area scaled
#: up), which the protocol adapter counts image tokens with: a tiny tower with these sizes spans
#: what the server reports (``write_tiny_deepseek_v41(vision=RELEASE_IMAGE_SIZING)``).
RELEASE_IMAGE_SIZING: Mapping[str, Any] = {"max_n_token": 1024, "min_pixels": 544 * 544}


def write_tiny_deepseek_v41(
    path: str | Path,
    *,
    seed: int = 0,
    vision: bool | Mapping[str, Any] = False,
    image_token: str | None = None,
    **overrides: Any,
) -> Path:
    """Write the tiny V4.1 checkpoint folder (``TINY_DEEPSEEK_V41_TEXT_CONFIG``, any text
    config key overridden; ``engram_layer_ids=[]`` turns Engram off, ``candidate_source_layer_id
    =-1`` the two-level top-k) with the tiny tokenizer, and return it. The Engram table sizes
    and the compressed vocabulary's size are derived (from the layout's primes and the
    tokenizer), as the release's config states them. ``vision=True`` adds the tiny vision tower
    (``TINY_DEEPSEEK_V41_VISION_CONFIG``; its tensors drawn from a generator of their own, so
    every other tensor is the same as without it); a mapping for ``vision`` changes those keys
    of it. ``image_token`` (the release's ``<｜image｜>``): a special token appended to the
    tokenizer as ``image_token_id``, so a protocol adapter's rendered image placeholders
    tokenize to it (without it ``image_token_id`` is the plain token ``vocab_size - 2``, as the
    fixtures' checkpoint has it). A folder already holding the same one is returned as it is."""
    folder = Path(path)
    text = copy.deepcopy({**TINY_DEEPSEEK_V41_TEXT_CONFIG, **overrides})
    changes = vision if isinstance(vision, Mapping) else {}
    vision_config = {**TINY_DEEPSEEK_V41_VISION_CONFIG, **changes} if vision else {"num_hidden_layers": 0}
    recipe_args = {**text, "vision_config": vision_config} if vision else text
    if image_token is not None:
        recipe_args = {**recipe_args, "image_token": image_token}
    recipe = _recipe(f"v4.1-layout{LAYOUT}", seed, torch.bfloat16, True, recipe_args)
    if _reuse_or_clear(folder, recipe):
        return folder
    tokenizer = _tokenizer_for(text, () if image_token is None else (image_token,))
    image_token_id = text["vocab_size"] - 2 if image_token is None else tokenizer.token_to_id(image_token)
    # The last token the tokenizer's model has (an appended image token is not one).
    text["dspark_noise_token_id"] = text.get("dspark_noise_token_id", tokenizer.get_vocab_size(False) - 1)
    if text["engram_layer_ids"]:
        layout = engram_layout(text)
        text["engram_num_embeddings"] = list(layout.table_rows)
        text["engram_compressed_vocab_size"] = compressed_token_map(tokenizer)[1]
    else:
        text["engram_num_embeddings"] = []
    config = {
        "architectures": ["DeepseekV41ForCausalLM"],
        "model_type": "deepseek_v41",
        "text_config": text,
        "vision_config": vision_config,
        "image_token_id": image_token_id,
        "quantization_config": dict(DEEPSEEK_V41_QUANTIZATION_CONFIG),
        "tie_word_embeddings": False,
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tensors = random_weights(text, seed)
    if vision:
        tensors |= vision_weights(vision_config, text["hidden_size"], seed)
    _write_tensors(folder / "model.safetensors", tensors)
    return _finish(folder, tokenizer, recipe)


def engram_layout(text: Mapping[str, Any]) -> EngramLayout:
    return EngramLayout.build(
        text["engram_layer_ids"],
        text["engram_max_ngram_size"],
        text["engram_n_heads"],
        text["engram_head_dim"],
        text["engram_vocab_size"],
    )


def checkpoint_digest(folder: str | Path) -> str:
    """SHA-256 over the folder's config.json and safetensors bytes: what the fixtures were made from."""
    digest = hashlib.sha256()
    for name in ("config.json", "model.safetensors"):
        digest.update((Path(folder) / name).read_bytes())
    return digest.hexdigest()


def random_weights(text: Mapping[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, drawn in name order from one generator."""
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, (shape, kind) in sorted(tensor_shapes(text).items()):
        values = torch.randn(shape, generator=generator, dtype=torch.float32)
        leaf = name.rsplit(".", 2)[-2] if name.endswith(".weight") else name.rsplit(".", 1)[-1]
        if len(shape) == 1:
            # mHC bases and scales, sinks, router biases; norms near one
            values = 1 + 0.1 * values if "norm" in leaf else 0.5 * values
        elif name == "embed.weight":
            values = 0.1 * values
        else:
            values = values * shape[-1] ** -0.5
        stem = name.removesuffix(".weight")
        if kind == FP8:
            tensors[name], tensors[f"{stem}.scale"] = quantize_fp8_ue8m0(values, (BLOCK, BLOCK))
        elif kind == ENGRAM:
            tensors[name], tensors[f"{stem}.scale"] = quantize_fp8_ue8m0(values, (1, BLOCK))
        elif kind == FP4:
            tensors[name], tensors[f"{stem}.scale"] = quantize_fp4(values)
        else:
            tensors[name] = values.to(torch.float32 if kind == F32 else torch.bfloat16)
    for stage in range(text.get("num_nextn_predict_layers", 0)):  # DSpark's copies of the tied tensors
        tensors[f"mtp.{stage}.embed.weight"] = tensors["embed.weight"].clone()
        tensors[f"mtp.{stage}.head.weight"] = tensors["head.weight"].clone()
    return tensors


def vision_weights(vision: Mapping[str, Any], text_hidden: int, seed: int) -> dict[str, torch.Tensor]:
    """The vision tower's tensors (bfloat16; the ViT's norms float32, as the release stores
    them), drawn in name order from a generator of their own."""
    generator = torch.Generator().manual_seed(seed + 0x5649)
    tensors: dict[str, torch.Tensor] = {}
    for name, (shape, kind) in sorted(vision_shapes(vision, text_hidden).items()):
        values = torch.randn(shape, generator=generator, dtype=torch.float32)
        if len(shape) == 1:
            values = 1 + 0.1 * values if "norm" in name else 0.5 * values
        else:
            values = values * shape[-1] ** -0.5
        tensors[name] = values.to(torch.float32 if kind == F32 else torch.bfloat16)
    return tensors


def vision_shapes(vision: Mapping[str, Any], text_hidden: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """Name -> (shape, storage kind) of the vision tower's tensors, as DeepSeek's ``vision.py``
    and ``Transformer`` declare them."""
    dim, inter, patch = vision["hidden_size"], vision["intermediate_size"], vision["patch_size"]
    merged = dim * vision["downsample_ratio"] ** 2
    shapes: dict[str, tuple[tuple[int, ...], str]] = {
        "vision.patch_embed.proj.weight": ((dim, 3 * patch * patch), BF16),
        "vision.patch_embed.proj.bias": ((dim,), BF16),
        "vision.norm.weight": ((dim,), F32),
        "aligner.w1.weight": ((text_hidden, merged), BF16),
        "aligner.w1.bias": ((text_hidden,), BF16),
        "aligner.w2.weight": ((text_hidden, text_hidden), BF16),
        "aligner.w2.bias": ((text_hidden,), BF16),
        "image_start": ((text_hidden,), BF16),
        "image_end": ((text_hidden,), BF16),
        "image_newline": ((text_hidden,), BF16),
    }
    for block in range(vision["num_hidden_layers"]):
        prefix = f"vision.blocks.{block}."
        shapes |= {
            prefix + "norm1.weight": ((dim,), F32),
            prefix + "norm2.weight": ((dim,), F32),
            prefix + "attn.wqkv.weight": ((3 * dim, dim), BF16),
            prefix + "attn.wqkv.bias": ((3 * dim,), BF16),
            prefix + "attn.wo.weight": ((dim, dim), BF16),
            prefix + "attn.wo.bias": ((dim,), BF16),
            prefix + "mlp.w1.weight": ((2 * inter, dim), BF16),
            prefix + "mlp.w2.weight": ((dim, inter), BF16),
        }
    return shapes


def tensor_shapes(text: Mapping[str, Any]) -> dict[str, tuple[tuple[int, ...], str]]:
    """Name -> (logical shape, storage kind) of every weight (not the scales), as DeepSeek's
    V4.1 model declares them."""
    shapes: dict[str, tuple[tuple[int, ...], str]] = {
        "embed.weight": ((text["vocab_size"], text["hidden_size"]), BF16),
        "norm.weight": ((text["hidden_size"],), BF16),
        "head.weight": ((text["vocab_size"], text["hidden_size"]), BF16),
    }
    layers = text["num_hidden_layers"]
    for layer in range(layers + text.get("num_nextn_predict_layers", 0)):
        prefix = f"layers.{layer}." if layer < layers else f"mtp.{layer - layers}."
        shapes.update({prefix + name: shape for name, shape in _block(text, layer).items()})
    return shapes


def _block(text: Mapping[str, Any], layer: int) -> dict[str, tuple[tuple[int, ...], str]]:
    dim, hc, heads, head_dim = text["hidden_size"], text["hc_mult"], text["num_attention_heads"], text["head_dim"]
    q_rank, o_groups, o_rank = text["q_lora_rank"], text["o_groups"], text["o_lora_rank"]
    inter, mix = text["moe_intermediate_size"], (2 + hc) * hc
    backbone = layer < text["num_hidden_layers"]
    experts = text["n_routed_experts"] if backbone else text.get("dspark_n_routed_experts") or text["n_routed_experts"]
    shapes: dict[str, tuple[tuple[int, ...], str]] = {}
    for site in ("attn", "ffn"):
        shapes |= {
            f"hc_{site}_fn": ((mix, hc * dim), F32),
            f"hc_{site}_base": ((mix,), F32),
            f"hc_{site}_scale": ((3,), F32),
        }
    shapes |= {
        "attn_norm.weight": ((dim,), BF16),
        "ffn_norm.weight": ((dim,), BF16),
        "attn.attn_sink": ((heads,), F32),
        "attn.wq_a.weight": ((q_rank, dim), FP8),
        "attn.q_norm.weight": ((q_rank,), BF16),
        "attn.wq_b.weight": ((heads * head_dim, q_rank), FP8),
        "attn.wkv.weight": ((head_dim, dim), FP8),
        "attn.kv_norm.weight": ((head_dim,), BF16),
        "attn.wo_a.weight": ((o_groups * o_rank, heads * head_dim // o_groups), FP8),
        "attn.wo_b.weight": ((dim, o_groups * o_rank), FP8),
        "ffn.gate.weight": ((experts, dim), BF16),
        "ffn.gate.bias": ((experts,), F32),
        "ffn.gate.bias_vl": ((experts,), F32),
        "ffn.shared_experts.w1.weight": ((inter, dim), FP8),
        "ffn.shared_experts.w2.weight": ((dim, inter), FP8),
        "ffn.shared_experts.w3.weight": ((inter, dim), FP8),
    }
    for expert in range(experts):
        shapes |= {
            f"ffn.experts.{expert}.w1.weight": ((inter, dim), FP4),
            f"ffn.experts.{expert}.w2.weight": ((dim, inter), FP4),
            f"ffn.experts.{expert}.w3.weight": ((inter, dim), FP4),
        }
    if backbone:
        shapes |= _sources(text, layer)
        if layer in text["engram_layer_ids"]:
            slot = text["engram_layer_ids"].index(layer)
            columns = (text["engram_max_ngram_size"] - 1) * text["engram_n_heads"]
            width = text["engram_head_dim"]
            shapes |= {
                "engram.q_weight": ((hc, dim), BF16),
                "engram.k_weight": ((hc, dim), BF16),
                "engram.embed.weight": ((text["engram_num_embeddings"][slot], width), ENGRAM),
                "engram.wkv.weight": ((dim * (hc + 1), columns * width), FP8),
            }
        return shapes
    shapes |= {  # DSpark: the last stage's heads and the first stage's projection of the target layers
        "main_proj.weight": ((dim, dim * len(text["dspark_target_layer_ids"])), FP8),
        "main_norm.weight": ((dim,), BF16),
        "norm.weight": ((dim,), BF16),
        "markov_head.embed.weight": ((text["vocab_size"], text["dspark_markov_rank"]), BF16),
        "markov_head.head.weight": ((text["vocab_size"], text["dspark_markov_rank"]), BF16),
        "confidence_head.proj.weight": ((1, dim + text["dspark_markov_rank"]), BF16),
    }
    return shapes


def _sources(text: Mapping[str, Any], layer: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """A KV source's compressor (a gate above ratio 1) and an index source's indexer (its key
    projection where the layer is a KV source too)."""
    head_dim, ratio = text["head_dim"], text["compress_ratios"][layer]
    dim, index_heads, index_dim = text["hidden_size"], text["index_n_heads"], text["index_head_dim"]
    shapes: dict[str, tuple[tuple[int, ...], str]] = {}
    kv_source = layer in text["kv_source_layer_ids"]
    if kv_source:
        shapes |= {
            "attn.compressor.wkv.weight": ((head_dim, dim), BF16),
            "attn.compressor.norm.weight": ((head_dim,), BF16),
        }
        if ratio > 1:
            shapes["attn.compressor.wgate.weight"] = ((head_dim, dim), BF16)
    if layer in text["index_source_layer_ids"]:
        shapes |= {
            "attn.indexer.wq_b.weight": ((index_heads * index_dim, text["q_lora_rank"]), FP8),
            "attn.indexer.weights_proj.weight": ((index_heads, dim), BF16),
        }
        if kv_source:
            shapes |= {
                "attn.indexer.wk.weight": ((index_dim, head_dim), BF16),
                "attn.indexer.k_norm.weight": ((index_dim,), BF16),
            }
    return shapes


def tiny_v41_context(folder: str | Path, dtype: torch.dtype = torch.float32, **text_changes: Any) -> ModelContext:
    """The ``ModelContext`` the V4.1 tests build a model from outside an engine: the
    checkpoint's config (``text_changes`` override text config keys), the torch reference
    attention and grouped MoE backends, the checkpoint's tensor files and tokenizer."""
    from powertrain.builtin.grouped_moe import TorchGroupedMoE
    from powertrain.builtin.reference_attention import TorchReferenceAttention
    from powertrain.interfaces import ModelContext
    from powertrain.loader import load_checkpoint

    checkpoint = load_checkpoint(str(folder))
    config = dict(checkpoint.config)
    if text_changes:
        config["text_config"] = {**config["text_config"], **text_changes}
    return ModelContext(
        config=config,
        dtype=dtype,
        device=torch.device("cpu"),
        attention=TorchReferenceAttention(),
        moe=TorchGroupedMoE(),
        tensor_files=checkpoint.tensor_files,
        tokenizer=checkpoint.tokenizer,
    )


def load_tiny_v41(
    folder: str | Path, dtype: torch.dtype = torch.float32, **text_changes: Any
) -> DeepseekV41ForCausalLM:
    """A ``DeepseekV41ForCausalLM`` built on ``tiny_v41_context`` with the folder's weights
    (FP8 weights dequantised to ``dtype``)."""
    from powertrain.loader import load_checkpoint
    from powertrain.models.deepseek_v41 import DeepseekV41ForCausalLM

    model = DeepseekV41ForCausalLM(tiny_v41_context(folder, dtype, **text_changes))
    model.load_weights(load_checkpoint(str(folder)).tensors(fp8_dtype=dtype, wanted=model.wants_weight))
    return model


def fixture_image_pixels(provenance: Mapping[str, Any], name: str) -> np.ndarray:
    """An image of the vision fixtures (``core/tests/fixtures/deepseek_v41_vision``), drawn again
    from the seed its ``provenance.json`` records, as its ``make_fixtures.py`` drew it."""
    record = provenance["images"][name]
    index = list(provenance["images"]).index(name)
    rng = np.random.default_rng([provenance["image_seed"], index])
    return rng.integers(0, 256, (record["height"], record["width"], 3), dtype=np.uint8)

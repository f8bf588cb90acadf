"""Tiny random DeepSeek, Qwen3 and Gemma 4 checkpoints, written locally, for tests of model code, loaders and kernels.

No model hub is needed: ``write_tiny_deepseek`` builds the model with HF transformers (the
oracle that model code is tested against), fills it with seeded random weights and saves it as
a Hugging Face checkpoint folder. ``quantize_checkpoint_fp8`` turns such a folder into the FP8
block-scaled layout DeepSeek-V3 is released in. Cache a checkpoint per test session::

    @pytest.fixture(scope="session")
    def tiny_v3(tmp_path_factory):
        return write_tiny_deepseek(tmp_path_factory.mktemp("tiny-v3"))

    @pytest.fixture(scope="session")
    def tiny_v3_fp8(tmp_path_factory, tiny_v3):
        return quantize_checkpoint_fp8(tiny_v3, tmp_path_factory.mktemp("tiny-v3-fp8"))

Writing takes well under a second once transformers is imported (importing it takes a few).
"""

from __future__ import annotations

import copy
import json
import re
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import EllipsisType
from typing import Any, Literal

import torch
from safetensors.torch import load_file, save_file

from powertrain.loader.fp4 import E2M1_VALUES, FP4_GROUP, dequantize_fp4
from powertrain.loader.fp8 import SCALE_SUFFIX, quantize_blocks

__all__ = [
    "DEEPSEEK_V3_QUANTIZATION_CONFIG",
    "DEEPSEEK_V4_FP4_QUANTIZATION_CONFIG",
    "TINY_DEEPSEEK_CONFIGS",
    "TINY_DEEPSEEK_V32_CONFIG",
    "TINY_DEEPSEEK_V4_CONFIG",
    "TINY_GEMMA4_CONFIG",
    "TINY_QWEN3_CONFIG",
    "TINY_QWEN3_MOE_CONFIG",
    "dequantize_fp4",
    "fp8_quantized_in_deepseek_v3",
    "mimic_mtp_layers",
    "quantize_checkpoint_fp8",
    "quantize_fp4",
    "random_hf_model",
    "save_with_tiny_tokenizer",
    "tiny_tokenizer",
    "write_tiny_deepseek",
    "write_tiny_deepseek_v32",
    "write_tiny_deepseek_v4",
    "write_tiny_gemma4",
    "write_tiny_qwen3",
    "write_tiny_qwen3_moe",
]

Variant = Literal["v3", "v2-lite"]

#: Written next to the weights; a second call with the same arguments finds it and returns at once.
RECIPE_FILE = "powertrain_tiny_checkpoint.json"
INDEX_FILE = "model.safetensors.index.json"

_YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 128,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
}

#: HF config arguments of each variant, before ``**overrides`` and the tokenizer's vocab size.
#: hidden 256 makes every projection span several 128x128 FP8 blocks, some of them partial.
TINY_DEEPSEEK_CONFIGS: Mapping[Variant, Mapping[str, Any]] = {
    # DeepSeek-V3 / R1: sigmoid scores + correction bias, group-limited top-k, YaRN, MTP.
    "v3": {
        "hidden_size": 256,
        "intermediate_size": 512,
        "moe_intermediate_size": 64,
        "num_hidden_layers": 3,
        "first_k_dense_replace": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "n_group": 2,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid",  # not read by transformers; real DeepSeek-V3 configs carry it
        "topk_method": "noaux_tc",
        "kv_lora_rank": 64,
        "q_lora_rank": 96,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16,
        "v_head_dim": 32,
        "max_position_embeddings": 512,
        "rope_parameters": {**_YARN, "mscale": 1.0, "mscale_all_dim": 1.0},
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
    },
    # DeepSeek-V2-Lite: no q LoRA, softmax scores, plain greedy top-k, 2 shared experts.
    "v2-lite": {
        "hidden_size": 256,
        "intermediate_size": 512,
        "moe_intermediate_size": 64,
        "num_hidden_layers": 3,
        "first_k_dense_replace": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_shared_experts": 2,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": False,
        "routed_scaling_factor": 1.0,
        "scoring_func": "softmax",
        "topk_method": "greedy",
        "kv_lora_rank": 64,
        "q_lora_rank": None,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16,
        "v_head_dim": 32,
        "max_position_embeddings": 512,
        "rope_parameters": {**_YARN, "mscale": 0.707, "mscale_all_dim": 0.707},
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
    },
}

#: HF config arguments of the tiny DeepSeek-V3.2 (``DeepseekV32Config``), before ``**overrides``:
#: V3's tiny shape plus the Lightning Indexer. 16 indexer heads: with few heads a query-key pair
#: whose ReLU scores are all zero (probability 2**-heads) ties with others at exactly 0, and the
#: top-k order among ties is arbitrary. ``index_topk`` 8 so a prompt of a dozen tokens already
#: drops some; ``index_head_dim`` 32 holds the 16 rope dims and 16 that pass through.
TINY_DEEPSEEK_V32_CONFIG: Mapping[str, Any] = {
    **{key: value for key, value in TINY_DEEPSEEK_CONFIGS["v3"].items() if key not in ("scoring_func", "topk_method")},
    "num_hidden_layers": 3,
    "first_k_dense_replace": 1,
    "index_n_heads": 16,
    "index_head_dim": 32,
    "index_topk": 8,
}

#: HF config arguments of the tiny DeepSeek-V4 (``DeepseekV4Config``), before ``**overrides``.
#: Every attention type (layer 0 sliding window only, 1 and 3 CSA, 2 HCA), hash routing in layers
#: 0-1 and learned routing in 2-3, 4 mHC streams (V4-Flash's count). Compression rates 4 (CSA, as
#: released) and 8 (HCA; 128 released) with an 8-token sliding window (128 released): a 40-token
#: prompt spans 10 CSA and 5 HCA windows and leaves the window. ``index_topk`` 4 so the indexer
#: drops entries. 32 indexer heads: a query-entry score is exactly 0 when all heads' ReLU terms are
#: (probability 2**-heads per pair), and zeros tie; where such a tie straddles the top-k boundary the
#: pick is arbitrary, and ours and transformers' differ. With 8 heads this happened for 3 of 115
#: checkpoint seeds (errors of 0.05-0.30 against transformers, the same in float64); with 32 it is
#: about 2e-10 per pair, so never in the tests' ~10^4 pairs.
#: head_dim 32 with 8 rope dims (V4: 512 / 64); ``index_head_dim`` 16 holds those 8 and 8 more.
#: ``swiglu_limit`` 1.5 (10 released) so the clamp bites on unit-scale activations. 64 hidden and
#: 32 expert columns are multiples of 32, the FP4 scale group. YaRN on the "compress" rope only,
#: as V4's config does (factor 4 = max_position_embeddings / original, so transformers is quiet).
TINY_DEEPSEEK_V4_CONFIG: Mapping[str, Any] = {
    "hidden_size": 64,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 4,
    "layer_types": [
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
        "compressed_sparse_attention",
    ],
    "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe"],
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "partial_rotary_factor": 0.25,
    "q_lora_rank": 48,
    "o_groups": 2,
    "o_lora_rank": 16,
    "sliding_window": 8,
    "index_n_heads": 32,
    "index_head_dim": 16,
    "index_topk": 4,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "scoring_func": "sqrtsoftplus",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 1.5,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_parameters": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 128,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
    },
    "max_position_embeddings": 512,
    "num_nextn_predict_layers": 0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
}

#: HF config arguments of the tiny Qwen3 (``Qwen3Config``), before ``**overrides``: GQA (4 query
#: heads share 2 key/value heads) and head_dim 24, not hidden / heads = 16, as Qwen3's own heads
#: are wider than that quotient (Qwen3-8B: 128 against 4096 / 32 = 128, Qwen3-0.6B: 128 against 64).
TINY_QWEN3_CONFIG: Mapping[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 24,
    "max_position_embeddings": 512,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
}

#: HF config arguments of the tiny Qwen3-MoE (``Qwen3MoeConfig``), before ``**overrides``: Qwen3's
#: attention, 8 experts of which each token takes 2 (renormalised, as Qwen3-30B-A3B), layer 0 a
#: dense MLP (``mlp_only_layers``), the others routed.
TINY_QWEN3_MOE_CONFIG: Mapping[str, Any] = {
    **TINY_QWEN3_CONFIG,
    "moe_intermediate_size": 32,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [0],
}

#: HF config arguments of the tiny Gemma 4 (``Gemma4TextConfig``), before ``**overrides``: sliding
#: layers with an 8-token window and 16-wide heads (2 key/value heads) beside full layers with
#: 32-wide heads and proportional RoPE over a quarter of their pairs (with ``attention_k_eq_v``
#: also one key/value head, ``num_global_key_value_heads``); the last two layers read the keys
#: and values of layers 3 and 2 (``num_kv_shared_layers``) through double-wide MLPs; per-layer
#: embeddings of 8 per layer; soft-capped logits. What Gemma 4's E2B and E4B have, at toy size;
#: the 31B's key-as-value full layers are ``attention_k_eq_v=True``.
TINY_GEMMA4_CONFIG: Mapping[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 6,
    "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "global_head_dim": 32,
    "num_global_key_value_heads": 1,
    "sliding_window": 8,
    "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
    },
    "num_kv_shared_layers": 2,
    "use_double_wide_mlp": True,
    "hidden_size_per_layer_input": 8,
    "final_logit_softcapping": 30.0,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 1,
}

#: What a DeepSeek-V4 config.json with FP4 experts says (transformers' ``FineGrainedFP8Config``):
#: ``expert_dtype="fp4"`` makes routed experts e2m1 packed two per byte (int8, low nibble first)
#: with one ue8m0 (power-of-two, ``float8_e8m0fnu``) scale per 32 columns of a row; ``.scale``
#: tensors beside the weights. The block size is that of FP8 dense weights (none here).
DEEPSEEK_V4_FP4_QUANTIZATION_CONFIG: Mapping[str, Any] = {
    "activation_scheme": "dynamic",
    "expert_dtype": "fp4",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "scale_fmt": "ue8m0",
    "weight_block_size": [128, 128],
}

#: What DeepSeek-V3's config.json says about its FP8 weights (the block shape is filled in).
DEEPSEEK_V3_QUANTIZATION_CONFIG: Mapping[str, Any] = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [128, 128],
}

BOS, EOS, USER, ASSISTANT = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"
#: DeepSeek-V3's template, cut down to system/user/assistant turns.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}"
    "{% elif message['role'] == 'user' %}{{ '<｜User｜>' + message['content'] }}"
    "{% elif message['role'] == 'assistant' %}{{ '<｜Assistant｜>' + message['content'] + eos_token }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}"
)
TOKENIZER_VOCAB_SIZE = 512

# The tokenizer's training text: varied enough for 500 merges, fixed so every run gets the same vocab.
_CORPUS = """\
A mixture-of-experts layer sends each token to a few of its experts. The router scores every expert,
keeps the best ones, and the layer adds their outputs, weighted by the scores. Shared experts see
every token, so the routed ones can specialise.

Multi-head latent attention compresses keys and values into one small latent vector per token. The
cache stores that latent and a short rotary key; each head expands them again when it attends. This
is why a long context costs so little memory.

The engine schedules requests in batches. It prefills a prompt in chunks, decodes one token per step
for every running sequence, and frees the cache blocks of finished requests. Prefix caching lets two
requests that begin with the same system prompt share those blocks.

Weights are stored in eight-bit floating point, one scale per block of 128 by 128 values. Loading
multiplies each block by its scale; a kernel may instead keep the bytes and apply the scale inside
the matrix multiplication, which halves the memory traffic of every layer.

Speculative decoding drafts several tokens cheaply and verifies them in one forward pass of the big
model. Accepted tokens cost almost nothing; a rejected token is replaced by the verifier's own sample,
so the output distribution does not change. Numbers 0123456789, punctuation (!?.,;:) and "quotes".
"""


def write_tiny_deepseek(
    path: str | Path,
    *,
    variant: Variant = "v3",
    q_lora_rank: int | None | EllipsisType = ...,
    num_nextn_predict_layers: int | EllipsisType = ...,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    per_expert_names: bool = True,
    **overrides: Any,
) -> Path:
    """Write a tiny random DeepSeek checkpoint folder to ``path`` (new or empty) and return it.

    The folder is what real DeepSeek releases look like, shrunk: ``config.json`` (saved by
    transformers 5: rope settings as ``rope_parameters`` with ``rope_type``; the loader adds the
    ``rope_scaling`` spelling), safetensors weights, ``tokenizer.json`` + ``tokenizer_config.json``
    (a byte-level BPE with DeepSeek's special tokens and a chat template) and
    ``generation_config.json``. ``transformers`` loads it back with ``from_pretrained``, so its
    forward pass is the oracle for model code.

    - ``variant="v3"``: ``DeepseekV3ForCausalLM`` (sigmoid routing with ``e_score_correction_bias``,
      2 expert groups of which 1 is kept, YaRN rope, ``rope_interleave=True`` as transformers'
      default for the class). ``"v2-lite"``: ``DeepseekV2ForCausalLM``, DeepSeek-V2-Lite's shape
      (no q LoRA, softmax routing, greedy top-k, 2 shared experts, YaRN with mscale 0.707; the
      V2 class always rotates interleaved pairs). Sizes: ``TINY_DEEPSEEK_CONFIGS``; any config
      key can be overridden by keyword.
    - ``q_lora_rank``: ``...`` is the variant's (96 for v3, None for v2-lite); ``None`` gives a
      plain ``q_proj``.
    - ``num_nextn_predict_layers``: ``...`` is 1 for v3 and 0 for v2-lite (V2 has no MTP). Each MTP
      layer ``L = num_hidden_layers + k`` is stored as DeepSeek-V3 stores it, in its own shard:
      ``model.layers.{L}.enorm / hnorm / eh_proj [hidden, 2*hidden] / shared_head.norm /
      shared_head.head / embed_tokens`` plus a full MoE decoder block (``self_attn.*``, ``mlp.*``,
      both layernorms). transformers' ``DeepseekV3ForCausalLM`` builds no MTP layer, so it skips
      these tensors with an "unexpected keys" note, and its logits do not change. transformers'
      generic ``modeling_layers.MtpModel.from_pretrained(main_model)`` reads them (an oracle for
      MTP code) once the pattern list ``main_model._keys_to_ignore_on_load_unexpected`` matches
      ``model.layers.{L}.*`` (the class lists layer 61, the real model's).
    - Weights: seeded (``seed``), independent of torch's global RNG, identical on every call.
      Linear and expert weights ~ N(0, 1/fan_in) so activations keep unit scale and logits spread
      out; embeddings ~ N(0, 1); every RMSNorm weight 1 + 0.1 N(0, 1); the router weight is random
      like any linear and ``e_score_correction_bias`` ~ 0.1 N(0, 1) (transformers leaves it at
      zero), so routing is neither uniform nor independent of the bias. All tensors are ``dtype``
      except ``e_score_correction_bias``, which stays float32 as in DeepSeek-V3's release.
    - Expert names: transformers 5 keeps experts fused in memory (``mlp.experts.gate_up_proj``
      ``[E, 2*I, H]``, ``mlp.experts.down_proj`` ``[E, H, I]``) but ``save_pretrained`` writes them
      per expert (``mlp.experts.{e}.gate_proj.weight``), as real DeepSeek checkpoints do.
      ``per_expert_names=True`` guarantees that layout whatever transformers writes; ``False``
      stores the fused tensors instead (transformers loads both).

    Calling again with the same arguments on the same folder returns at once (a recipe file
    records them); other arguments rewrite it. A folder holding anything else is refused.
    """
    folder = Path(path)
    defaults = TINY_DEEPSEEK_CONFIGS.get(variant)
    if defaults is None:
        raise ValueError(f"variant must be one of {sorted(TINY_DEEPSEEK_CONFIGS)}, got {variant!r}")
    if num_nextn_predict_layers is ...:
        num_nextn_predict_layers = 1 if variant == "v3" else 0
    config_args = {
        **defaults,
        **({} if q_lora_rank is ... else {"q_lora_rank": q_lora_rank}),
        # V2 configs have no such key; transformers keeps unknown keys, as config.json shows them.
        **(
            {"num_nextn_predict_layers": num_nextn_predict_layers}
            if variant == "v3" or num_nextn_predict_layers
            else {}
        ),
        **overrides,
    }
    recipe = _recipe(variant, seed, dtype, per_expert_names, config_args)
    if _reuse_or_clear(folder, recipe):
        return folder

    transformers = _import_transformers()
    tokenizer = _tokenizer_for(config_args)
    config_class, model_class = (
        (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM)
        if variant == "v3"
        else (transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM)
    )
    config = config_class(**config_args)
    with torch.random.fork_rng(devices=[]):  # transformers' own init draws from the global RNG
        model = model_class(config)
    generator = torch.Generator().manual_seed(seed)
    _randomize(model.state_dict(keep_vars=True), generator)
    model = _to_dtype(model, dtype)
    model.save_pretrained(folder)
    saved = folder / "model.safetensors"
    _write_tensors(saved, _expert_layout(load_file(saved), per_expert=per_expert_names))

    if num_nextn_predict_layers:
        _add_mtp_layers(folder, model, config, num_nextn_predict_layers, seed, dtype, per_expert_names)

    return _finish(folder, tokenizer, recipe)


def write_tiny_deepseek_v32(
    path: str | Path,
    *,
    num_nextn_predict_layers: int = 0,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    per_expert_names: bool = True,
    **overrides: Any,
) -> Path:
    """Write a tiny random DeepSeek-V3.2 checkpoint folder (``DeepseekV32ForCausalLM``) and return it.

    As ``write_tiny_deepseek`` (same weight recipe, tokenizer, expert layout, recipe file so a second
    call with the same arguments returns at once), with transformers' ``DeepseekV32Config``: V3's MLA
    and sigmoid/group-limited MoE, plus a Lightning Indexer in every attention layer, stored as
    ``model.layers.{i}.self_attn.indexer.{wq_b,wk,weights_proj}.weight`` and
    ``...indexer.k_norm.{weight,bias}`` (a LayerNorm: its bias is random too, ~ 0.1 N(0, 1)).
    Sizes: ``TINY_DEEPSEEK_V32_CONFIG``; any config key can be overridden by keyword. The MLA rope
    stays interleaved, the indexer's is not (transformers hard-codes both).

    ``num_nextn_predict_layers`` MTP layers are stored as ``write_tiny_deepseek`` stores V3's, their
    decoder blocks V3.2's (MoE, with an indexer), as DeepSeek-V3.2's release has them. transformers'
    V3.2 class builds no MTP layer and skips these tensors; ``mlp_layer_types`` in config.json
    still lists the decoder layers only.
    """
    folder = Path(path)
    config_args = {
        **TINY_DEEPSEEK_V32_CONFIG,
        **({"num_nextn_predict_layers": num_nextn_predict_layers} if num_nextn_predict_layers else {}),
        **overrides,
    }
    recipe = _recipe("v3.2", seed, dtype, per_expert_names, config_args)
    if _reuse_or_clear(folder, recipe):
        return folder

    transformers = _import_transformers()
    tokenizer = _tokenizer_for(config_args)
    config = transformers.DeepseekV32Config(**config_args)
    with torch.random.fork_rng(devices=[]):  # transformers' own init draws from the global RNG
        model = transformers.DeepseekV32ForCausalLM(config)
    _randomize(model.state_dict(keep_vars=True), torch.Generator().manual_seed(seed))
    model = _to_dtype(model, dtype)
    model.save_pretrained(folder)
    saved = folder / "model.safetensors"
    _write_tensors(saved, _expert_layout(load_file(saved), per_expert=per_expert_names))

    if num_nextn_predict_layers:
        # transformers picks a V3.2 layer's MLP by mlp_layer_types[layer_idx]: MTP blocks are MoE.
        # (Set after construction: the config validates the list against num_hidden_layers.)
        block_config = copy.deepcopy(config)
        block_config.mlp_layer_types = [*config.mlp_layer_types, *["sparse"] * num_nextn_predict_layers]
        _add_mtp_layers(
            folder, model, config, num_nextn_predict_layers, seed, dtype, per_expert_names, block_config=block_config
        )

    return _finish(folder, tokenizer, recipe)


def write_tiny_deepseek_v4(
    path: str | Path,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    fp4_experts: bool = False,
    fp8_dense: bool = False,
    mtp_layers: int = 0,
    **overrides: Any,
) -> Path:
    """Write a tiny random DeepSeek-V4 checkpoint folder (``DeepseekV4ForCausalLM``) and return it.

    As ``write_tiny_deepseek`` (weight recipe, tokenizer, recipe file so a second call with the same
    arguments returns at once), with transformers' ``DeepseekV4Config``: sliding-window, CSA
    (compressor + Lightning Indexer) and HCA attention layers, hash-routed and learned-routed MoE,
    mHC residual streams. Sizes: ``TINY_DEEPSEEK_V4_CONFIG``; any config key can be overridden.

    - Names: what ``save_pretrained`` writes, which is transformers' conversion mapping run
      backwards: DeepSeek's native names under a ``model.`` prefix (``model.layers.{i}.attn.wq_a``,
      ``.attn.attn_sink``, ``.attn.compressor.{wkv,wgate,ape,norm}``, ``.attn.indexer.{wq_b,
      weights_proj}``, ``.attn.indexer.compressor.*``, ``.ffn.experts.{e}.w1/w2/w3``,
      ``.ffn.gate.{weight,bias,tid2eid}``, ``.hc_attn_{fn,base,scale}``, ``head.weight``) except
      ``model.embed_tokens.weight`` and ``model.hc_head.hc_{fn,base,scale}``, whose ``^``-anchored
      patterns do not match under the prefix (DeepSeek's release: ``embed.weight``,
      ``hc_head_fn``...). transformers loads the folder back either way.
    - Weights: every parameter random (``_randomize``: norms 1 + 0.1 N, linears fan-in scaled),
      the attention sinks, compressor ``ape``, mHC ``base``/``scale`` included (transformers
      starts them at zero or one). ``tid2eid`` (int64 ``[vocab, top_k]``, zeros in transformers)
      is a seeded random choice of ``top_k`` distinct experts per token. Modules transformers keeps
      in float32 (mHC, sinks, ``ape``, norms, the correction bias) stay float32 for other ``dtype``.
    - ``fp4_experts``: routed experts in the layout of transformers' ``FP8Experts(expert_dtype="fp4")``
      (DeepSeek's reference types the same bytes ``float4_e2m1fn_x2``, which transformers 5.24 cannot
      load from safetensors): ``w1/w2/w3.weight`` int8 ``[rows, cols/2]``
      (two e2m1 codes a byte, even column in the low nibble) and ``.scale`` ``float8_e8m0fnu``
      ``[rows, cols/32]``, the scale the power of two ``2**ceil(log2(amax/6))`` of each 32-column
      group; config.json gains ``DEEPSEEK_V4_FP4_QUANTIZATION_CONFIG``. Everything else as without
      it (same seed, same values); transformers dequantises the experts on load (on CPU it must).
      ``dequantize_fp4`` gives the float weights the checkpoint stands for.
    - ``fp8_dense``: the dense projections DeepSeek ships in FP8 (attention ``wq_a``, ``wq_b``,
      ``wkv``, ``wo_a``, ``wo_b``, the indexer's ``wq_b``, the shared experts) as float8_e4m3fn
      ``X.weight`` with ``X.scale`` ``float8_e8m0fnu`` per 128x128 block (power-of-two scales,
      ``scale_fmt: ue8m0``); compressors, routers, norms and the rest stay as they are.

    - ``mtp_layers``: that many MTP layers (``num_nextn_predict_layers``), which transformers' V4
      neither builds nor writes (it ignores ``mtp.*``), in a shard of their own as DeepSeek's release
      stores them and vLLM's ``deepseek_v4_mtp.py`` loads them: ``mtp.{k}.`` then a decoder block's
      native names (``attn.wq_a``, ``attn.kv_norm``, ``hc_attn_fn``, ``ffn.experts.{e}.w1``...; the
      block of a transformers V4 one layer deeper, random from its own seed, so the decoder's
      weights do not change) and the MTP's own ``e_proj``, ``h_proj``, ``enorm``, ``hnorm``,
      ``norm`` and ``hc_head_{fn,base,scale}`` (float32, as mHC). The MTP layer's attention and
      routing are ``layer_types`` / ``mlp_layer_types`` entries after the decoder's when the
      overrides list them (as DeepSeek's ``compress_ratios`` does), else the release's: sliding,
      learned; config.json lists them so. Quantised as the decoder's under ``fp4_experts`` /
      ``fp8_dense`` (``e_proj``, ``h_proj`` FP8 too, as released).
    """
    folder = Path(path)
    config_args = copy.deepcopy({**TINY_DEEPSEEK_V4_CONFIG, **overrides})
    if mtp_layers:
        config_args["num_nextn_predict_layers"] = mtp_layers
    variant = (
        "v4" + ("-fp4" if fp4_experts else "") + ("-fp8" if fp8_dense else "") + f"-mtp{mtp_layers}" * bool(mtp_layers)
    )
    recipe = _recipe(variant, seed, dtype, True, config_args)
    if _reuse_or_clear(folder, recipe):
        return folder

    tokenizer = _tokenizer_for(config_args)
    model = _tiny_deepseek_v4_model(config_args, seed, dtype)
    model.save_pretrained(folder)
    if not (fp4_experts or fp8_dense or mtp_layers):
        return _finish(folder, tokenizer, recipe)
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    if fp4_experts or fp8_dense:
        saved = folder / "model.safetensors"
        _write_tensors(saved, _quantize_v4(load_file(saved), fp4_experts, fp8_dense))
        quantization = dict(DEEPSEEK_V4_FP4_QUANTIZATION_CONFIG)
        if not fp4_experts:
            del quantization["expert_dtype"]
        config["quantization_config"] = quantization
    if mtp_layers:
        kinds = _v4_kinds_with_mtp(config_args, mtp_layers)
        config.update(kinds)
        mtp = _tiny_deepseek_v4_mtp({**config_args, **kinds}, mtp_layers, seed, dtype)
        _add_shard(folder, _quantize_v4(mtp, fp4_experts, fp8_dense))
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return _finish(folder, tokenizer, recipe)


def _quantize_v4(tensors: Mapping[str, torch.Tensor], fp4_experts: bool, fp8_dense: bool) -> dict[str, torch.Tensor]:
    """``tensors`` with routed experts FP4 and the dense weights DeepSeek ships in FP8 so, as asked
    (see ``write_tiny_deepseek_v4``), each with its ``.scale`` beside it."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        scale = name.removesuffix("weight") + "scale"
        if fp4_experts and _V4_EXPERT_WEIGHT.fullmatch(name):
            out[name], out[scale] = quantize_fp4(tensor)
        elif fp8_dense and _V4_FP8_WEIGHT.fullmatch(name):
            out[name], out[scale] = quantize_fp8_ue8m0(tensor)
        else:
            out[name] = tensor
    return out


def _v4_kinds_with_mtp(config_args: Mapping[str, Any], mtp_layers: int) -> dict[str, list[str]]:
    """``layer_types`` and ``mlp_layer_types`` for the decoder and then the MTP layers: listed in
    ``config_args`` past the decoder's, else the release's MTP layer (sliding, learned routing)."""
    layers = config_args["num_hidden_layers"]
    kinds = {}
    for key, default in (("layer_types", "sliding_attention"), ("mlp_layer_types", "moe")):
        given = list(config_args[key])[: layers + mtp_layers]
        kinds[key] = given + [default] * (layers + mtp_layers - len(given))
    return kinds


def _tiny_deepseek_v4_mtp(
    config_args: Mapping[str, Any], count: int, seed: int, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """``count`` random MTP layers under the release's names (see ``write_tiny_deepseek_v4``):
    the blocks of a transformers V4 with ``count`` more layers, as ``save_pretrained`` names
    them, moved under ``mtp.{k}.``, plus each MTP layer's own tensors."""
    import tempfile

    layers, hidden, streams = config_args["num_hidden_layers"], config_args["hidden_size"], config_args["hc_mult"]
    deeper = {**config_args, "num_hidden_layers": layers + count, "num_nextn_predict_layers": 0}
    # Its own seed: the decoder's weights are the same with or without MTP layers.
    model = _tiny_deepseek_v4_model(deeper, seed + 1_000_003 * (layers + 1), dtype)
    with tempfile.TemporaryDirectory() as scratch:
        model.save_pretrained(scratch)
        saved = load_file(Path(scratch) / "model.safetensors")
    tensors: dict[str, torch.Tensor] = {}
    generator = torch.Generator().manual_seed(seed + 1_000_003 * (layers + count + 1))
    for depth in range(count):
        block = f"model.layers.{layers + depth}."
        for name, tensor in saved.items():
            if name.startswith(block):
                # save_pretrained spells the attention's kv_norm as transformers' mapping reads it back.
                tensors[f"mtp.{depth}." + name.removeprefix(block).replace("attn.norm.", "attn.kv_norm.")] = tensor
        shapes = {
            "e_proj.weight": (hidden, hidden),
            "h_proj.weight": (hidden, hidden),
            "enorm.weight": (hidden,),
            "hnorm.weight": (hidden,),
            "norm.weight": (hidden,),
            "hc_head_fn": (streams, streams * hidden),
            "hc_head_base": (streams,),
            "hc_head_scale": (1,),
        }
        own = {f"mtp.{depth}.{name}": torch.empty(shape) for name, shape in shapes.items()}
        _randomize(own, generator)
        for name, tensor in own.items():
            keep_float32 = ".hc_" in name or name.endswith("norm.weight")
            tensors[name] = tensor.to(torch.float32 if keep_float32 else dtype)
    return tensors


#: Routed-expert weights under the names ``save_pretrained`` writes for V4 (native ``w1/w2/w3``).
_V4_EXPERT_WEIGHT = re.compile(r".+\.ffn\.experts\.\d+\.w[123]\.weight")
#: The dense V4 weights ``fp8_dense`` stores FP8 (see ``write_tiny_deepseek_v4``).
_V4_FP8_WEIGHT = re.compile(
    r".+\.(?:attn\.(?:wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|ffn\.shared_experts\.w[123]|[eh]_proj)\.weight"
)


def quantize_fp8_ue8m0(weight: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 with power-of-two block scales, as DeepSeek-V4 stores its dense weights: each block's
    scale is ``2**ceil(log2(amax / 448))`` (so the block fits e4m3), as ``float8_e8m0fnu``."""
    from powertrain.loader.fp8 import FP8_DTYPE, FP8_MAX, expand_blocks

    rows, cols = weight.shape
    padded = torch.nn.functional.pad(weight.float(), (0, -cols % block[1], 0, -rows % block[0]))
    tiles = padded.unflatten(-1, (-1, block[1])).unflatten(-3, (-1, block[0]))
    amax = tiles.abs().amax(dim=(-3, -1)).clamp(min=1e-30)
    scale = torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX)))
    scaled = weight.float() / expand_blocks(scale, rows, cols, block)
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale.to(torch.float8_e8m0fnu)


def _tiny_deepseek_v4_model(config_args: Mapping[str, Any], seed: int, dtype: torch.dtype) -> Any:
    """The random ``DeepseekV4ForCausalLM`` ``write_tiny_deepseek_v4`` saves (``config_args``
    with the tokenizer's vocab_size), in eval mode."""
    transformers = _import_transformers()
    config_args = copy.deepcopy(dict(config_args))  # DeepseekV4Config edits nested dicts in place
    if "vocab_size" not in config_args:
        _tokenizer_for(config_args)
    config = transformers.DeepseekV4Config(**config_args)
    with torch.random.fork_rng(devices=[]):  # transformers' own init draws from the global RNG
        model = transformers.DeepseekV4ForCausalLM(config)
    generator = torch.Generator().manual_seed(seed)
    state = model.state_dict(keep_vars=True)
    _randomize({name: t for name, t in state.items() if t.is_floating_point()}, generator)
    with torch.no_grad():
        for name in sorted(state):
            if name.endswith(".tid2eid"):  # top_k distinct experts per token id
                table = state[name]
                scores = torch.rand(table.shape[0], config.n_routed_experts, generator=generator)
                table.copy_(scores.argsort(dim=-1)[:, : table.shape[1]])
    # What transformers does on load: dtype, except modules it keeps in float32 and the rope
    # tables (non-persistent float32 buffers).
    keep = set(model._keep_in_fp32_modules_strict)
    for name, tensor in state.items():
        if tensor.is_floating_point():
            tensor.data = tensor.data.to(torch.float32 if keep & set(name.split(".")) else dtype)
    return model.eval()


def quantize_fp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` ``[..., cols]`` (cols a multiple of 32) as DeepSeek-V4's FP4 experts: int8 ``[..., cols/2]``
    of e2m1 codes (even column in the low nibble) and ``float8_e8m0fnu`` ``[..., cols/32]`` scales,
    each the power of two ``2**ceil(log2(amax/6))`` of its 32 columns (as DeepSeek's ``fp4_act_quant``),
    values rounded to nearest, ties to even."""
    if weight.shape[-1] % FP4_GROUP:
        raise ValueError(f"FP4 groups are {FP4_GROUP} columns; the last dimension is {weight.shape[-1]}")
    groups = weight.float().unflatten(-1, (-1, FP4_GROUP))
    amax = groups.abs().amax(dim=-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 6.0)))
    scaled = (groups / scale).flatten(-2)
    grid = torch.tensor(E2M1_VALUES[:8])  # the magnitudes; code | 8 is the negative
    midpoints = (grid[1:] + grid[:-1]) / 2
    magnitude = scaled.abs()
    codes = torch.bucketize(magnitude, midpoints)  # a tie goes to the lower code...
    tie = magnitude == midpoints[codes.clamp(max=len(midpoints) - 1)]
    codes = codes + (tie & (codes % 2 == 1)).long()  # ...unless that one's mantissa bit is set: to even
    codes = codes | torch.where(scaled < 0, 8, 0)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8).view(torch.int8)
    return packed, scale.squeeze(-1).to(torch.float8_e8m0fnu)


def _add_mtp_layers(
    folder: Path,
    model: Any,
    config: Any,
    count: int,
    seed: int,
    dtype: torch.dtype,
    per_expert_names: bool,
    block_config: Any = None,
) -> None:
    """Add ``count`` MTP layers, as DeepSeek-V3 stores them, in a shard of their own (see
    ``write_tiny_deepseek``): each a random decoder block of ``model``'s layer class (built
    from ``block_config``, default ``config``) plus the MTP's norms and ``eh_proj``."""
    layer_class = type(model.model.layers[-1])
    main = model.state_dict()
    mtp = {}
    for index in range(config.num_hidden_layers, config.num_hidden_layers + count):
        # A separate generator: the main weights are the same with or without MTP layers.
        mtp_generator = torch.Generator().manual_seed(seed + 1_000_003 * (index + 1))
        block = _to_dtype(layer_class(block_config or config, layer_idx=index), dtype).state_dict(keep_vars=True)
        layer = {
            "enorm.weight": torch.empty(config.hidden_size),
            "hnorm.weight": torch.empty(config.hidden_size),
            "eh_proj.weight": torch.empty(config.hidden_size, 2 * config.hidden_size),
            "shared_head.norm.weight": torch.empty(config.hidden_size),
        }
        _randomize(layer, mtp_generator)
        _randomize(block, mtp_generator)
        layer |= {name: tensor.detach() for name, tensor in block.items()}
        layer |= {
            "embed_tokens.weight": main["model.embed_tokens.weight"],
            "shared_head.head.weight": main["lm_head.weight"],
        }
        for name, tensor in layer.items():
            keep_float32 = name.endswith("e_score_correction_bias")
            mtp[f"model.layers.{index}.{name}"] = tensor.to(torch.float32 if keep_float32 else dtype).clone()
    _add_shard(folder, _expert_layout(mtp, per_expert=per_expert_names))


def mimic_mtp_layers(path: str | Path, scale: float = 0.1, sharpen: float = 4.0) -> Path:
    """Rewrite a tiny DeepSeek checkpoint in place so its MTP layer predicts much like the
    target, for drafter tests that need drafts accepted often (and rejected often): every
    block's attention and MLP outputs scaled down by ``scale``, the heads sharpened by
    ``sharpen``, an MTP input projection that passes the embedding through (plus a little
    of the hidden state), unit ``enorm`` and the final norm as the MTP head's norm.
    DeepSeek-V3's names or V4's (``wo_b``, ``w2``, ``head``; ``e_proj`` the identity,
    ``h_proj`` scaled down, ``mtp.{k}.norm``); float checkpoints only."""
    path = Path(path)
    shards = sorted(path.glob("*.safetensors"))
    tensors = {shard: load_file(shard) for shard in shards}
    final_norm = next(t["model.norm.weight"] for t in tensors.values() if "model.norm.weight" in t)
    for shard, named in tensors.items():
        for name, tensor in named.items():
            if name.endswith(("o_proj.weight", "down_proj.weight", "wo_b.weight", "w2.weight")):
                named[name] = tensor * scale
            elif name.endswith("head.weight"):  # lm_head, shared_head.head, V4's head
                named[name] = tensor * sharpen
            elif name.endswith("eh_proj.weight"):  # [embedding; hidden] -> embedding (+ a little hidden)
                size = tensor.shape[0]
                named[name] = torch.cat([torch.eye(size), tensor[:, size:] * scale], dim=1)
            elif name.endswith(".e_proj.weight"):  # V4: embedding and hidden projected apart
                named[name] = torch.eye(tensor.shape[0], dtype=tensor.dtype)
            elif name.endswith(".h_proj.weight"):
                named[name] = tensor * scale
            elif name.endswith("enorm.weight"):
                named[name] = torch.ones_like(tensor)
            elif name.endswith("shared_head.norm.weight") or re.fullmatch(r"mtp\.\d+\.norm\.weight", name):
                named[name] = final_norm.clone()
        save_file(named, shard, metadata={"format": "pt"})
    return path


def write_tiny_qwen3(path: str | Path, *, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: Any) -> Path:
    """Write a tiny random Qwen3 checkpoint folder (``Qwen3ForCausalLM``, ``TINY_QWEN3_CONFIG``
    with ``overrides``, e.g. ``use_sliding_window=True, sliding_window=8, max_window_layers=1``)
    to ``path`` (new or empty) and return it. Weights and files as ``write_tiny_deepseek``
    describes (seeded, every norm, the q/k norms included, 1 + 0.1 N(0, 1)); a second call
    with the same arguments returns at once."""
    transformers = _import_transformers()
    return _write_tiny_hf(
        path,
        "qwen3",
        transformers.Qwen3Config,
        transformers.Qwen3ForCausalLM,
        {**TINY_QWEN3_CONFIG, **overrides},
        seed=seed,
        dtype=dtype,
    )


def write_tiny_gemma4(
    path: str | Path,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    conditional_generation: bool = False,
    global_head_keys: bool = False,
    **overrides: Any,
) -> Path:
    """Write a tiny random Gemma 4 text checkpoint folder (``Gemma4ForCausalLM``, ``TINY_GEMMA4_CONFIG``
    with ``overrides``, e.g. ``attention_k_eq_v=True, num_kv_shared_layers=0``) to ``path`` (new or
    empty) and return it. Weights and files as ``write_tiny_deepseek`` describes (seeded; every norm,
    the per-head ones included, and every ``layer_scalar`` 1 + 0.1 N(0, 1)). transformers saves the
    full layers' head size and key/value heads as ``per_layer_config``; ``vocab_size_per_layer_input``
    is the tokenizer's size too. ``conditional_generation``: as Google's releases are saved, a
    ``Gemma4ForConditionalGeneration`` (the text config nested, weights under
    ``model.language_model.``), here without vision or audio towers. ``global_head_keys``: the
    config gives those head shapes as Google's releases (and transformers 5.10.2, which DeepSpec
    pins) spell them, ``global_head_dim`` and ``num_global_key_value_heads``, instead of
    ``per_layer_config``; the weights are the same."""
    transformers = _import_transformers()
    config_args = {**TINY_GEMMA4_CONFIG, **overrides}
    config_args.setdefault("vocab_size_per_layer_input", TOKENIZER_VOCAB_SIZE)
    variant = "gemma4-conditional-generation" if conditional_generation else "gemma4"

    def composite(**text: Any) -> Any:
        tied = text.get("tie_word_embeddings", True)
        return transformers.Gemma4Config(
            text_config=text, vision_config=None, audio_config=None, tie_word_embeddings=tied
        )

    return _write_tiny_hf(
        path,
        variant + ("-global-head-keys" if global_head_keys else ""),
        composite if conditional_generation else transformers.Gemma4TextConfig,
        transformers.Gemma4ForConditionalGeneration if conditional_generation else transformers.Gemma4ForCausalLM,
        config_args,
        seed=seed,
        dtype=dtype,
        edit_config=_gemma4_global_head_keys(config_args) if global_head_keys else None,
    )


def _gemma4_global_head_keys(config_args: Mapping[str, Any]) -> Callable[[dict[str, Any]], None]:
    """Rewrites a saved Gemma 4 config.json's ``per_layer_config`` as ``global_head_dim`` and
    ``num_global_key_value_heads`` (``Gemma4TextConfig``'s arguments, which transformers 5.24
    folds into ``per_layer_config`` and 5.10.2 keeps)."""

    def edit(config: dict[str, Any]) -> None:
        text = config.get("text_config", config)
        text.pop("per_layer_config", None)
        text["global_head_dim"] = int(config_args.get("global_head_dim", 512))
        text["num_global_key_value_heads"] = config_args.get("num_global_key_value_heads")

    return edit


def write_tiny_qwen3_moe(
    path: str | Path,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    per_expert_names: bool = True,
    **overrides: Any,
) -> Path:
    """Write a tiny random Qwen3-MoE checkpoint folder (``Qwen3MoeForCausalLM``,
    ``TINY_QWEN3_MOE_CONFIG`` with ``overrides``) to ``path`` (new or empty) and return it.
    Experts as Qwen's releases store them, ``mlp.experts.{e}.{gate,up,down}_proj.weight``
    (what transformers' ``save_pretrained`` writes too), or with ``per_expert_names=False``
    transformers' fused ``mlp.experts.gate_up_proj`` / ``down_proj``; the router is
    ``mlp.gate.weight``. Otherwise as ``write_tiny_qwen3``."""
    transformers = _import_transformers()
    return _write_tiny_hf(
        path,
        "qwen3-moe",
        transformers.Qwen3MoeConfig,
        transformers.Qwen3MoeForCausalLM,
        {**TINY_QWEN3_MOE_CONFIG, **overrides},
        seed=seed,
        dtype=dtype,
        per_expert_names=per_expert_names,
    )


def _write_tiny_hf(
    path: str | Path,
    variant: str,
    config_class: Any,
    model_class: Any,
    config_args: dict[str, Any],
    *,
    seed: int,
    dtype: torch.dtype,
    per_expert_names: bool = True,
    edit_config: Callable[[dict[str, Any]], None] | None = None,
) -> Path:
    """Build ``model_class`` from ``config_args``, fill it with seeded weights, save it with the
    tiny tokenizer (reusing ``path`` if it already holds exactly this checkpoint). ``edit_config``
    changes the saved config.json in place."""
    folder = Path(path)
    recipe = _recipe(variant, seed, dtype, per_expert_names, config_args)
    if _reuse_or_clear(folder, recipe):
        return folder
    tokenizer = _tokenizer_for(config_args)
    config = config_class(**config_args)
    with torch.random.fork_rng(devices=[]):  # transformers' own init draws from the global RNG
        model = model_class(config)
    _randomize(model.state_dict(keep_vars=True), torch.Generator().manual_seed(seed))
    model = _to_dtype(model, dtype)
    model.save_pretrained(folder)
    saved = folder / "model.safetensors"
    _write_tensors(saved, _expert_layout(load_file(saved), per_expert=per_expert_names))
    if edit_config is not None:
        config_file = folder / "config.json"
        saved_config = json.loads(config_file.read_text(encoding="utf-8"))
        edit_config(saved_config)
        config_file.write_text(json.dumps(saved_config, indent=2, sort_keys=True) + "\n")
    return _finish(folder, tokenizer, recipe)


def random_hf_model(model_class: Any, config: Any) -> Any:
    """A transformers model (eager attention, eval mode) whose every parameter is
    perturbed: HF initialises norms to one and biases to zero, and a weight loaded into
    the wrong place must show in the outputs compared against it."""
    config._attn_implementation = "eager"
    model = model_class(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    return model


def save_with_tiny_tokenizer(hf_model: Any, folder: str | Path) -> Path:
    """Save any transformers causal LM (e.g. from ``random_hf_model``, with
    ``vocab_size=TOKENIZER_VOCAB_SIZE``) as a checkpoint folder the engine opens, with the
    tiny tokenizer beside it."""
    folder = Path(folder)
    vocab_size = hf_model.config.vocab_size
    if vocab_size != TOKENIZER_VOCAB_SIZE:
        raise ValueError(f"the model's vocab_size is {vocab_size}; the tiny tokenizer has {TOKENIZER_VOCAB_SIZE}")
    hf_model.save_pretrained(folder)
    _write_tokenizer(folder, tiny_tokenizer())
    return folder


def tiny_tokenizer() -> Any:
    """A byte-level BPE with ``TOKENIZER_VOCAB_SIZE`` entries, DeepSeek-V3's special tokens (BOS id 0,
    EOS id 1, then User and Assistant) and a post-processor that adds BOS, trained offline on a
    fixed text (the same vocab every time). Returns a ``tokenizers.Tokenizer``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        special_tokens=[BOS, EOS, USER, ASSISTANT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_CORPUS.split("\n\n"), trainer)
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, backend.token_to_id(BOS))]
    )
    return backend


def fp8_quantized_in_deepseek_v3(name: str) -> bool:
    """Whether DeepSeek-V3's release stores this tensor as FP8 (with a ``<name>_scale_inv``).

    FP8: the weights of every attention projection (``q_proj``/``q_a_proj``/``q_b_proj``,
    ``kv_a_proj_with_mqa``, ``kv_b_proj``, ``o_proj``) and of every MLP (dense, shared and routed
    experts), MTP layer included: the matrix multiplications that dominate time and memory. In
    V3.2 also the Lightning Indexer's ``wq_b`` and ``wk`` (its ``weights_proj`` is BF16: DeepSeek's
    ``inference/model.py`` builds it with ``dtype=torch.get_default_dtype()``, the others FP8).
    Kept in high precision: embeddings, ``lm_head`` and the MTP copies (``shared_head.head``,
    ``embed_tokens``), norms, the router (``mlp.gate.weight``) and ``e_score_correction_bias``
    (small, and routing decisions are sensitive to them) and the MTP ``eh_proj`` (BF16 in the
    release). Fused expert tensors (``mlp.experts.gate_up_proj``/``down_proj``) count as experts.
    """
    return _FP8_WEIGHT.search(name) is not None


_FP8_WEIGHT = re.compile(
    r"\.(?:self_attn\.(?:q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)\.weight"
    r"|self_attn\.indexer\.(?:wq_b|wk)\.weight"
    r"|mlp\.(?:shared_experts\.|experts\.\d+\.)?(?:gate_proj|up_proj|down_proj)\.weight"
    r"|mlp\.experts\.(?:gate_up_proj|down_proj))$"
)


def quantize_checkpoint_fp8(src: str | Path, dst: str | Path, *, block: tuple[int, int] = (128, 128)) -> Path:
    """Copy the float checkpoint folder ``src`` to ``dst`` (new or empty) in DeepSeek-V3's FP8 layout.

    Each tensor ``fp8_quantized_in_deepseek_v3`` selects becomes float8_e4m3fn plus a float32
    ``<name>_scale_inv`` of one factor per ``block`` (``powertrain.loader.fp8.quantize_blocks``), in
    the same shard; everything else is copied unchanged. config.json gains DeepSeek-V3's
    ``quantization_config`` with ``weight_block_size = block``; the index is rewritten; tokenizer and
    generation files are copied. Returns ``dst``.
    """
    source, target = Path(src), Path(dst)
    config = json.loads((source / "config.json").read_text(encoding="utf-8"))
    if "quantization_config" in config:
        raise ValueError(f"{source} is already quantized ({config['quantization_config']}); pass a float checkpoint")
    if target.exists() and any(target.iterdir()):
        raise FileExistsError(f"{target} is not empty; quantize_checkpoint_fp8 writes into a new or empty folder")
    target.mkdir(parents=True, exist_ok=True)

    index_path = source / INDEX_FILE
    shard_names = (
        sorted(set(json.loads(index_path.read_text(encoding="utf-8"))["weight_map"].values()))
        if index_path.is_file()
        else sorted(file.name for file in source.glob("*.safetensors"))
    )
    weight_map: dict[str, str] = {}
    total_size = 0
    for shard_name in shard_names:
        quantized: dict[str, torch.Tensor] = {}
        for name, tensor in load_file(source / shard_name).items():
            if fp8_quantized_in_deepseek_v3(name):
                quantized[name], quantized[name + SCALE_SUFFIX] = quantize_blocks(tensor, block)
            else:
                quantized[name] = tensor
        _write_tensors(target / shard_name, quantized)
        weight_map |= dict.fromkeys(quantized, shard_name)
        total_size += sum(tensor.numel() * tensor.element_size() for tensor in quantized.values())
    if index_path.is_file():
        index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
        (target / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")

    config["quantization_config"] = {**DEEPSEEK_V3_QUANTIZATION_CONFIG, "weight_block_size": list(block)}
    (target / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    written_here = {INDEX_FILE, "config.json", RECIPE_FILE}
    for file in source.iterdir():
        if file.is_file() and file.suffix != ".safetensors" and file.name not in written_here:
            shutil.copy2(file, target / file.name)
    return target


# -- helpers ----------------------------------------------------------------------------------------


def _import_transformers() -> Any:
    try:
        import transformers
    except ImportError as error:
        raise ImportError(
            "write_tiny_deepseek builds the model with HF transformers (>= 5), which is not installed: "
            "`pip install 'transformers>=5'`."
        ) from error
    return transformers


def _randomize(tensors: Mapping[str, torch.Tensor], generator: torch.Generator) -> None:
    """Overwrite every tensor in place, in name order, from ``generator`` (see write_tiny_deepseek)."""
    with torch.no_grad():
        for name in sorted(tensors):
            tensor = tensors[name]
            values = torch.randn(tensor.shape, generator=generator, dtype=torch.float32)
            if name.endswith(("e_score_correction_bias", "norm.bias")):  # the indexer's k_norm LayerNorm
                values = 0.1 * values
            elif "norm" in name.rsplit(".", 2)[-2] or name.endswith(".layer_scalar"):
                # input_layernorm, q_a_layernorm, enorm, shared_head.norm; Gemma 4's per-layer output scale
                values = 1 + 0.1 * values
            elif "embed_tokens" not in name:
                values = values / tensor.shape[-1] ** 0.5  # fan-in scaled: linears, experts, router
            tensor.copy_(values)


def _to_dtype(module: torch.nn.Module, dtype: torch.dtype) -> Any:
    module = module.to(dtype)
    for submodule in module.modules():
        bias = getattr(submodule, "e_score_correction_bias", None)
        if isinstance(bias, torch.Tensor):
            submodule.e_score_correction_bias = bias.float()
    return module


_FUSED_EXPERTS = re.compile(r"(?P<prefix>.+\.mlp\.experts)\.(?P<kind>gate_up_proj|down_proj)")
_PER_EXPERT = re.compile(
    r"(?P<prefix>.+\.mlp\.experts)\.(?P<expert>\d+)\.(?P<kind>gate_proj|up_proj|down_proj)\.weight"
)


def _expert_layout(tensors: Mapping[str, torch.Tensor], *, per_expert: bool) -> dict[str, torch.Tensor]:
    """Routed experts as ``experts.{e}.<proj>.weight`` (per_expert) or fused ``experts.gate_up_proj``
    ``[E, 2I, H]`` (gate rows first, as transformers chunks it) and ``experts.down_proj`` ``[E, H, I]``."""
    result: dict[str, torch.Tensor] = {}
    if per_expert:
        for name, tensor in tensors.items():
            if match := _FUSED_EXPERTS.fullmatch(name):
                prefix = match["prefix"]
                for expert, weight in enumerate(tensor):
                    if match["kind"] == "down_proj":
                        result[f"{prefix}.{expert}.down_proj.weight"] = weight.clone()
                    else:
                        gate, up = weight.chunk(2, dim=0)
                        result[f"{prefix}.{expert}.gate_proj.weight"] = gate.clone()
                        result[f"{prefix}.{expert}.up_proj.weight"] = up.clone()
            else:
                result[name] = tensor
        return result

    experts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for name, tensor in tensors.items():
        if match := _PER_EXPERT.fullmatch(name):
            experts.setdefault(match["prefix"], {}).setdefault(match["kind"], {})[int(match["expert"])] = tensor
        else:
            result[name] = tensor
    for prefix, kinds in experts.items():
        count = len(kinds["down_proj"])
        result[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([kinds["gate_proj"][e], kinds["up_proj"][e]]) for e in range(count)]
        )
        result[f"{prefix}.down_proj"] = torch.stack([kinds["down_proj"][e] for e in range(count)])
    return result


def _write_tensors(path: Path, tensors: Mapping[str, torch.Tensor]) -> None:
    # transformers refuses safetensors files without {"format": "pt"}.
    save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, str(path), metadata={"format": "pt"})


def _add_shard(folder: Path, extra: Mapping[str, torch.Tensor]) -> None:
    """Turn the single ``model.safetensors`` into a two-shard checkpoint with ``extra`` in the second."""
    main = folder / "model.safetensors"
    shards = [folder / "model-00001-of-00002.safetensors", folder / "model-00002-of-00002.safetensors"]
    main.rename(shards[0])
    _write_tensors(shards[1], extra)
    weight_map, total_size = {}, 0
    for shard in shards:
        for name, tensor in load_file(shard).items():
            weight_map[name] = shard.name
            total_size += tensor.numel() * tensor.element_size()
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def _write_tokenizer(folder: Path, tokenizer: Any) -> None:
    tokenizer.save(str(folder / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": 512,
        "chat_template": CHAT_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n")
    generation_config = {"bos_token_id": 0, "eos_token_id": 1, "do_sample": True, "temperature": 0.6, "top_p": 0.95}
    (folder / "generation_config.json").write_text(json.dumps(generation_config, indent=2) + "\n")


def _finish(folder: Path, tokenizer: Any, recipe: Mapping[str, Any]) -> Path:
    """Write the tokenizer, then the recipe listing every file: a folder with a recipe is whole."""
    _write_tokenizer(folder, tokenizer)
    files = sorted(file.name for file in folder.iterdir())
    (folder / RECIPE_FILE).write_text(json.dumps({**recipe, "files": files}, indent=2) + "\n")
    return folder


def _recipe(
    variant: str, seed: int, dtype: torch.dtype, per_expert_names: bool, config_args: Mapping[str, Any]
) -> dict[str, Any]:
    """What makes a tiny checkpoint what it is; a folder holding the same one is reused."""
    return {
        "variant": variant,
        "seed": seed,
        "dtype": str(dtype),
        "per_expert_names": per_expert_names,
        "config": json.loads(json.dumps(config_args, default=repr)),
    }


def _reuse_or_clear(folder: Path, recipe: Mapping[str, Any]) -> bool:
    """True when ``folder`` already holds this exact tiny checkpoint; otherwise it is
    cleared for a fresh write (so tests that write the same model share one copy)."""
    if _recipe_matches(folder, recipe):
        return True
    _clear(folder)
    return False


def _tokenizer_for(config_args: dict[str, Any], special: Sequence[str] = ()) -> Any:
    """The tiny tokenizer (with the ``special`` tokens appended), with ``config_args``' vocab_size
    set to its size (or checked)."""
    tokenizer = tiny_tokenizer()
    if special:
        tokenizer.add_special_tokens(list(special))
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    if config_args.setdefault("vocab_size", vocab_size) != vocab_size:
        raise ValueError(f"vocab_size must be the tokenizer's size, {vocab_size}; got {config_args['vocab_size']}")
    return tokenizer


def _recipe_matches(folder: Path, recipe: Mapping[str, Any]) -> bool:
    try:
        written = json.loads((folder / RECIPE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    files = written.pop("files", [])
    return written == recipe and all((folder / name).is_file() for name in files)


def _clear(folder: Path) -> None:
    """Make ``folder`` an empty folder; only files an earlier write_tiny_deepseek wrote may be removed."""
    if not folder.exists():
        folder.mkdir(parents=True)
        return
    present = {file.name for file in folder.iterdir()}
    if not present:
        return
    try:
        ours = set(json.loads((folder / RECIPE_FILE).read_text(encoding="utf-8"))["files"]) | {RECIPE_FILE}
    except (OSError, ValueError, KeyError, TypeError):
        ours = set()
    foreign = present - ours
    if foreign:
        raise FileExistsError(
            f"{folder} holds files write_tiny_deepseek did not write ({', '.join(sorted(foreign)[:5])}); "
            "pass a new or empty folder"
        )
    for name in present:
        (folder / name).unlink()

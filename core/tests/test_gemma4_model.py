"""Gemma 4 text models (``models/gemma4.py``) against HF transformers' ``Gemma4ForCausalLM``.

Tiny random float32 checkpoints (``write_tiny_gemma4``: 6 layers, sliding ones with an 8-token
window and 16-wide heads beside full ones with 32-wide heads and proportional RoPE, every norm
and layer scalar perturbed away from one, soft-capped logits) in two shapes: the E2B/E4B kind
("gemma4": the last two layers read layers 3's and 2's keys and values through double-wide MLPs,
per-layer embeddings, tied head) and the 31B kind ("gemma4-k-eq-v": full layers with one
key/value head whose key projection is also the value, no per-layer embeddings, no KV sharing,
an untied head). Logits over a paged cache with shuffled block ids: a ragged prefill, decode
steps beside a neighbour, a prefill in chunks, a prefix-cache hit; the releases' multimodal
class; bfloat16; then the whole engine and the CLI; hidden-state taps against transformers'
hidden states. Last, GGUF files written from the same checkpoints with gguf-py's own tensor
names and llama.cpp's converter's metadata.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import attrs
import gguf
import numpy as np
import pytest
import torch
import transformers  # the oracle; the locked dev group pins 5.24, which has Gemma 4
from click.testing import CliRunner

import powertrain.builtin.models
from powertrain import LLM, SamplingParams
from powertrain.builtin.reference_attention import TorchReferenceAttention
from powertrain.cli import main
from powertrain.interfaces import HiddenTap, ModelContext, TapRecorder
from powertrain.layers.rotary import RopeParameters, inverse_frequencies
from powertrain.loader import UnsupportedCheckpointError, load_checkpoint
from powertrain.models.gemma4 import Gemma4Args, Gemma4ForCausalLM
from powertrain.plugins import PluginManager
from powertrain.testing import write_tiny_gemma4
from powertrain.testing.base import fresh_seed
from powertrain.testing.oracle import assert_greedy_agrees, hf_greedy, hf_greedy_row, hf_logits, relative_error
from powertrain.testing.paged import PagedRunner

#: Relative to the largest reference logit, the Llama family's bound (test_qwen3_model.py): the
#: same float32 arithmetic in other orders, a flat batch against one sequence. The widest sums
#: here are the double-wide MLP's 192 terms and attention's at most ~80 positions, over 6 layers.
RELATIVE_TOLERANCE = 1e-4
#: A greedy pick departs from the oracle's only at a tie that close.
TIE = 2 * RELATIVE_TOLERANCE
DECODE_STEPS = 16
WINDOW = 8
LAYERS = 6
#: The 31B's shape: key-as-value full layers with one key/value head, nothing shared, untied head.
K_EQ_V = {
    "attention_k_eq_v": True,
    "num_kv_shared_layers": 0,
    "use_double_wide_mlp": False,
    "hidden_size_per_layer_input": 0,
    "tie_word_embeddings": False,
}
VARIANTS = ("gemma4", "gemma4-k-eq-v")


def write(variant: str, folder: Path, seed: int) -> Path:
    return write_tiny_gemma4(folder, seed=seed, **(K_EQ_V if variant == "gemma4-k-eq-v" else {}))


@pytest.fixture(scope="module")
def weights_seed() -> int:
    value = fresh_seed()
    print(f"checkpoint seed={value}")
    return value


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory, weights_seed: int) -> dict[str, Path]:
    return {variant: write(variant, tmp_path_factory.mktemp(variant), weights_seed) for variant in VARIANTS}


@pytest.fixture(scope="module")
def hf_models(paths: dict[str, Path]) -> dict[str, Any]:
    return {
        variant: transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        for variant, path in paths.items()
    }


def context_of(config: dict[str, Any], dtype: torch.dtype = torch.float32) -> ModelContext:
    return ModelContext(config=config, dtype=dtype, device=torch.device("cpu"), attention=TorchReferenceAttention())


def load_ours(path: Path, dtype: torch.dtype = torch.float32) -> Gemma4ForCausalLM:
    """From a checkpoint folder or a GGUF file."""
    checkpoint = load_checkpoint(str(path))
    model = Gemma4ForCausalLM(context_of(dict(checkpoint.config), dtype))
    model.load_weights(checkpoint.tensors())
    return model


def config_of(path: Path) -> dict[str, Any]:
    return json.loads((path / "config.json").read_text())


def random_tokens(path: Path, n: int) -> list[int]:
    config = config_of(path)
    return torch.randint(0, config.get("text_config", config)["vocab_size"], (n,)).tolist()


def check(variant: str, what: str, got: torch.Tensor, expected: torch.Tensor, seed: int) -> None:
    error = relative_error(got, expected)
    print(f"{variant}, {what}: max |diff| / max |logit| = {error:.2e}")
    assert error <= RELATIVE_TOLERANCE, f"{variant}, {what}: logits off by {error:.2e} (seed={seed})"


# --------------------------------------------------------------------------- model against HF


@pytest.mark.parametrize("variant", VARIANTS)
def test_prefill_logits_match_hf(variant: str, paths: dict[str, Path], hf_models: dict[str, Any], seed: int) -> None:
    path, hf = paths[variant], hf_models[variant]
    prompts = [random_tokens(path, n) for n in (random.randint(25, 40), random.randint(2, 24))]
    runner = PagedRunner(load_ours(path), TorchReferenceAttention(), block_size=4, num_blocks=32)
    logits = runner.step([("a", prompts[0]), ("b", prompts[1])])
    for prompt, got in zip(prompts, logits, strict=True):
        check(variant, f"prefill of {len(prompt)} tokens", got, hf_logits(hf, prompt), seed)


@pytest.mark.parametrize("variant", VARIANTS)
def test_prefill_and_decode_beside_a_neighbour_match_hf(
    variant: str, paths: dict[str, Path], hf_models: dict[str, Any], seed: int
) -> None:
    path, hf = paths[variant], hf_models[variant]
    prompt = random_tokens(path, random.randint(12, 30))
    neighbour = random_tokens(path, random.randint(3, 15))
    runner = PagedRunner(load_ours(path), TorchReferenceAttention(), block_size=4, num_blocks=64)
    logits, generated = runner.greedy_beside_a_neighbour(prompt, neighbour, random_tokens(path, DECODE_STEPS - 1))
    check(
        variant,
        f"prefill {len(prompt)} + {DECODE_STEPS - 1} decodes",
        logits,
        hf_logits(hf, prompt + generated[:-1]),
        seed,
    )
    expected = hf_greedy(hf, prompt, DECODE_STEPS)
    assert_greedy_agrees(generated, expected, hf_greedy_row(hf, prompt, expected), TIE, f"{variant} greedy")


@pytest.mark.parametrize("variant", VARIANTS)
def test_chunked_prefill_matches_hf(variant: str, paths: dict[str, Path], hf_models: dict[str, Any], seed: int) -> None:
    """A prompt prefilled in three chunks (cut anywhere, across blocks and windows) while a
    neighbour decodes in the same steps."""
    path, hf = paths[variant], hf_models[variant]
    prompt = random_tokens(path, random.randint(30, 45))
    cuts = sorted(random.sample(range(1, len(prompt)), 2))
    chunks = [prompt[: cuts[0]], prompt[cuts[0] : cuts[1]], prompt[cuts[1] :]]
    runner = PagedRunner(load_ours(path), TorchReferenceAttention(), block_size=4, num_blocks=64)
    runner.step([("other", random_tokens(path, 5))])
    pieces = []
    for chunk in chunks:
        _, logits = runner.step([("other", random_tokens(path, 1)), ("p", chunk)])
        pieces.append(logits)
    check(variant, f"chunks {[len(c) for c in chunks]}", torch.cat(pieces), hf_logits(hf, prompt), seed)


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_prefix_cache_hit_matches_hf(
    variant: str, paths: dict[str, Path], hf_models: dict[str, Any], seed: int
) -> None:
    """A second sequence starts on the first one's full blocks (past the window), computes
    only the rest of its prompt beside a neighbour, then decodes."""
    path, hf = paths[variant], hf_models[variant]
    first = random_tokens(path, random.randint(20, 30))
    common = random.randint(13, 20)
    prompt = first[:common] + random_tokens(path, random.randint(3, 12))
    runner = PagedRunner(load_ours(path), TorchReferenceAttention(), block_size=4, num_blocks=96)
    runner.step([("first", first)])
    skipped = runner.share_prefix("s", "first", common)
    assert skipped > WINDOW
    logits, generated = runner.greedy_beside_a_neighbour(
        prompt, random_tokens(path, 6), random_tokens(path, 7), skip=skipped
    )
    expected = hf_logits(hf, prompt + generated[:-1])[skipped:]
    check(variant, f"{skipped} of {len(prompt)} prompt tokens cached, 7 decodes", logits, expected, seed)


def test_the_multimodal_release_class_serves_its_text_model(
    tmp_path: Path, paths: dict[str, Path], weights_seed: int, seed: int
) -> None:
    """Google's checkpoints are ``Gemma4ForConditionalGeneration``: the text config nested, the
    weights under ``model.language_model.``. Its text model, against transformers' class of that
    name, in a step and through the engine; the (here absent) towers would not be read."""
    folder = write_tiny_gemma4(tmp_path / "multimodal", seed=weights_seed, conditional_generation=True)
    assert config_of(folder)["architectures"] == ["Gemma4ForConditionalGeneration"]
    assert "model.language_model.layers.0.layer_scalar" in load_checkpoint(str(folder)).tensor_names
    hf = transformers.AutoModelForImageTextToText.from_pretrained(str(folder), dtype=torch.float32).eval()
    assert type(hf).__name__ == "Gemma4ForConditionalGeneration"
    model = load_ours(folder)
    assert not model.wants_weight("model.vision_tower.encoder.layers.0.mlp.up_proj.linear.weight")
    prompt = random_tokens(folder, random.randint(12, 30))
    runner = PagedRunner(model, TorchReferenceAttention(), block_size=4, num_blocks=64)
    logits, generated = runner.greedy_beside_a_neighbour(prompt, random_tokens(folder, 5), random_tokens(folder, 7))
    check(
        "gemma4 multimodal class",
        f"prefill {len(prompt)} + 7 decodes",
        logits,
        hf_logits(hf, prompt + generated[:-1]),
        seed,
    )
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(str(folder), dtype="float32", block_size=4, num_blocks=64) as llm:
        (output,) = llm.generate([prompt], params)
    expected = hf_greedy(hf, prompt, 8)
    tokens = list(output.outputs[0].token_ids)
    assert_greedy_agrees(tokens, expected, hf_greedy_row(hf, prompt, expected), TIE, "multimodal class engine greedy")


def test_hf_applies_the_window_we_compare_against(paths: dict[str, Path], hf_models: dict[str, Any], seed: int) -> None:
    """Otherwise the comparisons would not test it: past the window, transformers' logits differ
    from the same weights' with a window longer than the prompt."""
    path = paths["gemma4"]
    wide = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, sliding_window=4096)
    tokens = random_tokens(path, 3 * WINDOW)
    windowed, unwindowed = hf_logits(hf_models["gemma4"], tokens), hf_logits(wide.eval(), tokens)
    assert relative_error(windowed[:WINDOW], unwindowed[:WINDOW]) <= RELATIVE_TOLERANCE, f"seed={seed}"
    assert relative_error(windowed[WINDOW:], unwindowed[WINDOW:]) > 1e-2, f"seed={seed}"
    assert [layer.sliding_window for layer in load_ours(path).attention_layers[:4]] == [WINDOW, WINDOW, None, WINDOW]


def test_kv_sharing_layers_hold_no_cache_and_read_their_sources(paths: dict[str, Path]) -> None:
    """Layers 4 and 5 read layers 3's and 2's keys and values: they declare a ``custom`` layer
    without cache groups, so the engine allocates nothing for them; their MLPs are double-wide."""
    model = load_ours(paths["gemma4"])
    assert [layer.kv_source for layer in model.args.layers] == [None, None, None, None, 3, 2]
    assert [spec.kind for spec in model.attention_layers] == ["gqa"] * 4 + ["custom"] * 2
    assert all(not spec.cache_groups for spec in model.attention_layers[4:])
    assert [layer.mlp.up_proj.out_features for layer in model.model.layers] == [96] * 4 + [192] * 2
    dense = load_ours(paths["gemma4-k-eq-v"])
    assert [(spec.head_size, spec.num_kv_heads) for spec in dense.attention_layers[1:3]] == [(16, 2), (32, 1)]
    assert dense.model.layers[2].self_attn.v_proj is None and dense.model.layers[1].self_attn.v_proj is not None


def test_bfloat16_is_as_close_to_float32_as_transformers_bfloat16(
    paths: dict[str, Path], hf_models: dict[str, Any], seed: int
) -> None:
    """In bfloat16 both sides round at every op, in other orders, so their logits differ by
    rounding (measured: about 1e-2 of the largest logit). Ours must be no further from the
    float32 oracle than transformers' own bfloat16 is, give or take a factor of two: a wrong
    rounding (say, of the embedding or per-layer scales) would show as a larger distance."""
    path = paths["gemma4"]
    hf_bfloat16 = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).eval()
    prompt = random_tokens(path, 29)
    runner = PagedRunner(load_ours(path, torch.bfloat16), TorchReferenceAttention(), dtype=torch.bfloat16)
    (got,) = runner.step([("a", prompt)])
    exact = hf_logits(hf_models["gemma4"], prompt)
    ours, theirs = relative_error(got, exact), relative_error(hf_logits(hf_bfloat16, prompt), exact)
    print(f"bfloat16 prefill against float32 transformers: ours {ours:.2e}, transformers' bfloat16 {theirs:.2e}")
    assert ours <= 2 * theirs, f"bfloat16 logits {ours:.2e} from float32's, transformers' {theirs:.2e} (seed={seed})"


# --------------------------------------------------------------------------- the engine and the CLI


@pytest.mark.parametrize("variant", VARIANTS)
def test_engine_greedy_with_prefix_hits_equals_hf(
    variant: str, paths: dict[str, Path], hf_models: dict[str, Any], seed: int
) -> None:
    """The whole engine, prefix caching on: the second and third prompts start with the first's
    tokens, so they hit its cached blocks (sliding blocks out of the window freed)."""
    path, hf = paths[variant], hf_models[variant]
    shared = random_tokens(path, random.randint(20, 28))
    prompts = [shared, shared + random_tokens(path, 9), shared[:17] + random_tokens(path, 4)]
    params = SamplingParams(temperature=0, max_tokens=DECODE_STEPS, ignore_eos=True)
    with LLM(str(path), dtype="float32", block_size=4, num_blocks=96, prefix_caching=True) as llm:
        assert type(llm.engine.runner.model) is Gemma4ForCausalLM
        outputs = [llm.generate([prompt], params)[0] for prompt in prompts]
    for prompt, output in zip(prompts, outputs, strict=True):
        expected = hf_greedy(hf, prompt, DECODE_STEPS)
        tokens = list(output.outputs[0].token_ids)
        assert_greedy_agrees(tokens, expected, hf_greedy_row(hf, prompt, expected), TIE, f"{variant} engine greedy")


def test_generate_answers_through_the_cli(paths: dict[str, Path]) -> None:
    result = CliRunner().invoke(
        main, ["generate", "--model", str(paths["gemma4"]), "--max-tokens", "6", "--json", "--no-chat", "Once"]
    )
    assert result.exit_code == 0, result.output
    (answer,) = [json.loads(line) for line in result.output.splitlines() if line.startswith("{")]
    assert answer["text"] and answer["output_tokens"] == 6


def test_layer_output_taps_equal_transformers_hidden_states(
    paths: dict[str, Path], hf_models: dict[str, Any], seed: int
) -> None:
    """``layer_output`` at the layers asked for (a KV-sharing one among them) is transformers'
    ``output_hidden_states`` entry ``layer + 1``, for every row of a ragged two-sequence step."""
    path, hf = paths["gemma4"], hf_models["gemma4"]
    model = load_ours(path)
    asked = sorted(random.sample(range(4), 2) + [4])
    prompts = {"a": random_tokens(path, 17), "b": random_tokens(path, 5)}
    model.taps = TapRecorder([HiddenTap(layer, "layer_output") for layer in asked])
    PagedRunner(model, TorchReferenceAttention()).step(list(prompts.items()))
    rows = torch.split(torch.stack(model.taps.taken()), [17, 5], dim=1)
    for (name, tokens), got in zip(prompts.items(), rows, strict=True):
        with torch.inference_mode():
            states = hf(input_ids=torch.tensor([tokens]), output_hidden_states=True).hidden_states
        expected = torch.stack([states[layer + 1][0] for layer in asked])
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n} {asked}: {m}")


# --------------------------------------------------------------------------- config and registry


def test_the_gemma4_record_builds_the_model_and_asks_for_sliding_windows(paths: dict[str, Path]) -> None:
    manager = PluginManager.load(environ={"POWERTRAIN_DISABLE_PLUGIN_AUTOLOAD": "1"})
    manager.register(powertrain.builtin.models)
    (provided,) = [p for p in manager.records("model") if p.record.name == "gemma4"]
    assert provided.record.architectures == {"Gemma4ForCausalLM", "Gemma4ForConditionalGeneration"}
    requirements = provided.record.requirements
    assert requirements is not None
    config = config_of(paths["gemma4"])
    assert requirements(config) == {
        "attention": {"gqa", "paged", "prefill", "decode", "chunked-prefill", "sliding-window"}
    }
    full = {**config, "layer_types": ["full_attention"] * LAYERS, "per_layer_config": {}}
    assert "sliding-window" not in requirements(full)["attention"]
    assert isinstance(provided.record.factory(context_of(config)), Gemma4ForCausalLM)


def test_proportional_rope_is_transformers(hf_models: dict[str, Any]) -> None:
    rotary = hf_models["gemma4"].model.rotary_emb
    params = RopeParameters.from_config(
        {"rope_parameters": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6}}
    )
    assert torch.equal(inverse_frequencies(params, 32), rotary.full_attention_inv_freq)
    assert torch.equal(inverse_frequencies(RopeParameters(theta=1e4), 16), rotary.sliding_attention_inv_freq)


def test_both_config_spellings_of_the_full_layers_read_the_same(paths: dict[str, Path]) -> None:
    """transformers 5.24 saves ``per_layer_config``; configs written before it (the Hub's) say
    ``global_head_dim`` and ``num_global_key_value_heads``, from which it derives the same."""
    saved = config_of(paths["gemma4-k-eq-v"])
    assert saved["per_layer_config"] == {
        "2": {"head_dim": 32, "num_key_value_heads": 1},
        "5": saved["per_layer_config"]["2"],
    }
    older = {k: v for k, v in saved.items() if k != "per_layer_config"} | {
        "global_head_dim": 32,
        "num_global_key_value_heads": 1,
    }
    assert Gemma4Args.from_config(older) == Gemma4Args.from_config(saved)
    # Without attention_k_eq_v transformers keeps the full layers' key/value heads.
    plain = Gemma4Args.from_config({**older, "attention_k_eq_v": False})
    assert [layer.num_kv_heads for layer in plain.layers] == [2] * LAYERS


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"enable_moe_block": True}, r"enable_moe_block=True: Gemma 4's routed experts .* SwiGLU experts"),
        ({"use_bidirectional_attention": "all"}, r"use_bidirectional_attention='all'"),
        ({"hidden_activation": "silu"}, r"GELU-tanh MLP, but the config says hidden_activation='silu'"),
        (
            {"rope_parameters": {"sliding_attention": {"rope_type": "yarn", "factor": 2.0}, "full_attention": {}}},
            r"rope_parameters\['sliding_attention'\] has rope_type='yarn'",
        ),
        (
            {"per_layer_config": {"2": {"intermediate_size": 8}}},
            r"per_layer_config\[2\] overrides \['intermediate_size'\]",
        ),
        ({"num_kv_shared_layers": LAYERS}, r"num_kv_shared_layers=6 must leave at least one"),
        ({"per_layer_config": {"5": {"head_dim": 64}}}, r"gives the full_attention layers head sizes \[16, 64\]"),
        (
            {"layer_types": ["sliding_attention"] * 5 + ["chunked_attention"]},
            r"layer_types names \['chunked_attention'\]",
        ),
    ],
)
def test_configs_it_cannot_follow_are_refused(paths: dict[str, Path], changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Gemma4ForCausalLM(context_of({**config_of(paths["gemma4"]), **changes}))


def test_tensors_are_checked_and_kv_sharing_layers_drop_their_kv(paths: dict[str, Path]) -> None:
    """Missing and unexpected tensors are named; a KV-sharing layer's own k/v tensors, which
    older checkpoints hold, are dropped unread as transformers drops them."""
    path = paths["gemma4"]
    tensors = dict(load_checkpoint(str(path)).tensors())
    model = Gemma4ForCausalLM(context_of(config_of(path)))
    stale = {
        "model.layers.5.self_attn.k_proj.weight": torch.randn(32, 64),
        "model.layers.4.self_attn.v_norm.weight": torch.ones(16),
    }
    model.load_weights({**tensors, **stale}.items())
    dropped = {
        name: t for name, t in tensors.items() if name not in ("model.layers.3.layer_scalar", "model.norm.weight")
    }
    with pytest.raises(ValueError, match=r"missing tensors: model.layers.3.layer_scalar, model.norm.weight"):
        model.load_weights(dropped.items())
    with pytest.raises(ValueError, match=r"unexpected tensors: model.layers.2.self_attn.v_norm.weight"):
        model.load_weights([*tensors.items(), ("model.layers.2.self_attn.v_norm.weight", torch.ones(32))])


# --------------------------------------------------------------------------- GGUF


def write_gguf(
    folder: Path, path: Path, quantize: gguf.GGMLQuantizationType | None = None, tokenizer_model: str = "gpt2"
) -> Path:
    """What llama.cpp's Gemma 4 converter (``conversion/gemma.py``) writes for the folder, in F32:
    gguf-py's GEMMA4 tensor names, norms as stored (Gemma 4's scale by ``w``, no ``+ 1``),
    ``layer_scalar`` as ``layer_output_scale``, no head when tied, a ``rope_freqs`` tensor for
    the full layers' proportional RoPE, and ``set_gguf_parameters``' metadata (per-layer arrays
    where layers differ). The tokenizer is the folder's tiny one as a gpt2 vocabulary (a real
    Gemma 4 file says ``gemma4``: ``tokenizer_model``). ``quantize``: the block type of every
    matrix whose rows it divides."""
    config = config_of(folder)
    args = Gemma4Args.from_config(config)
    full = next(layer for layer in args.layers if layer.kind == "full_attention")
    swa = next(layer for layer in args.layers if layer.kind == "sliding_attention")
    writer = gguf.GGUFWriter(str(path), arch="gemma4")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(args.num_layers)
    widths = [layer.intermediate_size for layer in args.layers]
    writer.add_feed_forward_length(widths if len(set(widths)) > 1 else widths[0])
    writer.add_head_count(config["num_attention_heads"])
    kv_heads = [layer.num_kv_heads for layer in args.layers]
    writer.add_head_count_kv(kv_heads if len(set(kv_heads)) > 1 else kv_heads[0])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_key_length(full.head_dim)
    writer.add_value_length(full.head_dim)
    writer.add_key_length_swa(swa.head_dim)
    writer.add_value_length_swa(swa.head_dim)
    writer.add_rope_freq_base(full.rope.theta)
    writer.add_rope_freq_base_swa(swa.rope.theta)
    writer.add_rope_dimension_count(full.head_dim)
    writer.add_rope_dimension_count_swa(swa.head_dim)
    if config["final_logit_softcapping"]:
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    writer.add_sliding_window(config["sliding_window"])
    writer.add_sliding_window_pattern([layer.kind == "sliding_attention" for layer in args.layers])
    writer.add_shared_kv_layers(config["num_kv_shared_layers"])
    writer.add_embedding_length_per_layer_input(config["hidden_size_per_layer_input"])
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"] | {t["content"]: t["id"] for t in tokenizer["added_tokens"]}
    special = {t["id"] for t in tokenizer["added_tokens"] if t["special"]}
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(sorted(vocab, key=vocab.__getitem__))
    writer.add_token_types([3 if i in special else 1 for i in range(len(vocab))])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]])
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    rotated = int(full.head_dim * full.rope.partial_rotary_factor / 2)
    writer.add_tensor(
        "rope_freqs.weight", np.array([1.0] * rotated + [1e30] * (full.head_dim // 2 - rotated), np.float32)
    )
    names = gguf.TensorNameMap(gguf.MODEL_ARCH.GEMMA4, args.num_layers)
    for name, tensor in load_checkpoint(str(folder)).tensors():
        if name == "lm_head.weight" and config["tie_word_embeddings"]:
            continue
        if name.endswith(".layer_scalar"):  # the converter's filter_tensors names it a weight
            name += ".weight"
        stored = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if quantize is not None and tensor.dim() == 2 and tensor.shape[1] % 32 == 0:
            blocks = gguf.quants.quantize(tensor.numpy(), quantize)
            writer.add_tensor(stored, blocks, raw_shape=blocks.shape, raw_dtype=quantize)
        else:
            writer.add_tensor(stored, tensor.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_llama_cpp_gguf_of_the_checkpoint_matches_hf(
    variant: str, tmp_path: Path, paths: dict[str, Path], hf_models: dict[str, Any], seed: int
) -> None:
    folder, hf = paths[variant], hf_models[variant]
    path = write_gguf(folder, tmp_path / f"{variant}.gguf")
    checkpoint = load_checkpoint(str(path))
    assert checkpoint.format == "gguf"
    # The same model, but for rms_norm_eps, which GGUF stores as float32.
    ours, theirs = Gemma4Args.from_config(checkpoint.config), Gemma4Args.from_config(config_of(folder))
    assert ours == attrs.evolve(theirs, rms_norm_eps=ours.rms_norm_eps)
    assert ours.rms_norm_eps == pytest.approx(theirs.rms_norm_eps, rel=1e-7)
    assert sorted(checkpoint.tensor_names) == sorted(load_checkpoint(str(folder)).tensor_names)
    prompt = random_tokens(folder, random.randint(12, 30))
    runner = PagedRunner(load_ours(path), TorchReferenceAttention(), block_size=4, num_blocks=64)
    logits, generated = runner.greedy_beside_a_neighbour(prompt, random_tokens(folder, 7), random_tokens(folder, 11))
    check(
        f"{variant} from GGUF",
        f"prefill {len(prompt)} + 11 decodes",
        logits,
        hf_logits(hf, prompt + generated[:-1]),
        seed,
    )
    params = SamplingParams(temperature=0, max_tokens=DECODE_STEPS, ignore_eos=True)
    with LLM(str(path), dtype="float32", block_size=4, num_blocks=64) as llm:
        (output,) = llm.generate([prompt], params)
    expected = hf_greedy(hf, prompt, DECODE_STEPS)
    tokens = list(output.outputs[0].token_ids)
    assert_greedy_agrees(tokens, expected, hf_greedy_row(hf, prompt, expected), TIE, f"{variant} GGUF engine greedy")


def test_weights_kept_quantized_give_the_dequantized_logits(tmp_path: Path, paths: dict[str, Path], seed: int) -> None:
    """Q8_0 projections, the token embedding (and so the tied head) and the per-layer projection
    kept as stored (the reference kernel multiplies by exactly what dequantisation gives)."""
    from powertrain.builtin.quantized_linear import DequantizingLinear

    path = write_gguf(paths["gemma4"], tmp_path / "q8.gguf", gguf.GGMLQuantizationType.Q8_0)
    checkpoint = load_checkpoint(str(path))
    assert checkpoint.quantized_formats == {"q8"}
    prompt = random_tokens(paths["gemma4"], 19)
    logits = []
    for kernel in (DequantizingLinear(), None):
        context = ModelContext(
            config=checkpoint.config,
            dtype=torch.float32,
            device=torch.device("cpu"),
            attention=TorchReferenceAttention(),
            quantized_linear=kernel,
        )
        model = Gemma4ForCausalLM(context)
        model.load_weights(checkpoint.tensors(keep_quantized=model.keep_quantized if kernel else None))
        kept = [model.model.layers[0].self_attn.q_proj.quantized, model.model.embed_tokens.quantized]
        assert all(weight is not None for weight in kept) is (kernel is not None)
        logits.append(PagedRunner(model, TorchReferenceAttention()).step([("a", prompt)])[0])
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-5, atol=1e-5, msg=lambda m: f"seed {seed}: {m}")


def test_gguf_files_it_cannot_read_are_refused(tmp_path: Path, paths: dict[str, Path]) -> None:
    """Routed experts (the 26B-A4B) and Gemma 4's own tokenizer (``gemma4``), which powertrain
    does not rebuild from GGUF metadata yet, are refused by name."""
    moe = tmp_path / "moe.gguf"
    writer = gguf.GGUFWriter(str(moe), arch="gemma4")
    writer.add_block_count(1)
    writer.add_expert_count(4)
    writer.add_tensor("token_embd.weight", np.zeros((16, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedCheckpointError, match="routed experts .* does not run its MoE blocks"):
        load_checkpoint(str(moe))
    with pytest.raises(UnsupportedCheckpointError, match="tokenizer.ggml.model is 'gemma4'"):
        load_checkpoint(str(write_gguf(paths["gemma4"], tmp_path / "gemma4-vocab.gguf", tokenizer_model="gemma4")))

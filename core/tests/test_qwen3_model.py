"""Qwen3 and Qwen3-MoE (``models/llama.py``) against HF transformers' own classes.

Tiny random float32 checkpoints (``write_tiny_qwen3`` / ``write_tiny_qwen3_moe``: GQA, head_dim
24 where hidden / heads is 16, every norm including the per-head q/k norms perturbed away from
one): plain Qwen3; Qwen3 with tied embeddings and an 8-token sliding window on every layer but
the first (``max_window_layers``); Qwen3-MoE with 8 experts, top-2 renormalised, layer 0 a dense
MLP. Logits over a paged cache with shuffled block ids beside a concurrently decoding neighbour,
then the whole engine, greedy, against transformers' greedy tokens. Last, GGUF files written
from the same checkpoints as llama.cpp's converter writes them (``qwen3`` / ``qwen3moe``).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
import transformers  # the oracle; the locked dev group pins 5.24, which has Qwen3 and Qwen3-MoE

import powertrain.builtin.models
from powertrain import LLM, SamplingParams
from powertrain.builtin.grouped_moe import TorchGroupedMoE
from powertrain.builtin.models import llama_requirements
from powertrain.builtin.reference_attention import TorchReferenceAttention
from powertrain.interfaces import ModelContext
from powertrain.layers.moe import route
from powertrain.loader import UnsupportedCheckpointError, load_checkpoint
from powertrain.loader.gguf import hf_tensor_names
from powertrain.models.llama import LlamaArgs, LlamaForCausalLM, Qwen3ForCausalLM
from powertrain.plugins import PluginManager
from powertrain.testing import write_tiny_qwen3, write_tiny_qwen3_moe
from powertrain.testing.base import fresh_seed
from powertrain.testing.oracle import assert_greedy_agrees, hf_greedy, hf_greedy_row, hf_logits, relative_error
from powertrain.testing.paged import PagedRunner

#: Relative to the largest reference logit. Both sides compute the same float32 arithmetic in
#: other orders (fused q/k/v and gate/up against split, a flat batch against one sequence,
#: grouped experts against one expert at a time). A float32 sum of K terms is off by at most
#: K * 2**-24 relative in the worst case; the widest sums here are the MLP's 96 terms and the
#: attention's at most ~80 positions (5.7e-6), a few per layer over 3 layers, so 1e-4 leaves
#: room for the norms and softmaxes to amplify them. Measured: at most 5.6e-7.
RELATIVE_TOLERANCE = 1e-4
#: A greedy pick departs from the oracle's only at a tie that close (twice the tolerance:
#: both sides may be off by it in opposite directions).
TIE = 2 * RELATIVE_TOLERANCE
DECODE_STEPS = 16
WINDOW = 8
VARIANTS = ("qwen3", "qwen3-sliding-tied", "qwen3-moe")


def write(variant: str, folder: Path, seed: int) -> Path:
    if variant == "qwen3":
        return write_tiny_qwen3(folder, seed=seed)
    if variant == "qwen3-sliding-tied":
        return write_tiny_qwen3(
            folder,
            seed=seed,
            tie_word_embeddings=True,
            use_sliding_window=True,
            sliding_window=WINDOW,
            max_window_layers=1,
        )
    return write_tiny_qwen3_moe(folder, seed=seed)


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


def context_of(config: dict[str, Any]) -> ModelContext:
    return ModelContext(
        config=config,
        dtype=torch.float32,
        device=torch.device("cpu"),
        attention=TorchReferenceAttention(),
        moe=TorchGroupedMoE(),
    )


def load_ours(path: Path) -> Qwen3ForCausalLM:
    """From a checkpoint folder or a GGUF file."""
    checkpoint = load_checkpoint(str(path))
    model = Qwen3ForCausalLM(context_of(dict(checkpoint.config)))
    model.load_weights(checkpoint.tensors())
    return model


def config_of(path: Path) -> dict[str, Any]:
    return json.loads((path / "config.json").read_text())


def random_tokens(path: Path, n: int) -> list[int]:
    return torch.randint(0, config_of(path)["vocab_size"], (n,)).tolist()


# --------------------------------------------------------------------------- model against HF


@pytest.mark.parametrize("variant", VARIANTS)
def test_prefill_logits_match_hf(variant: str, paths: dict[str, Path], hf_models: dict[str, Any], seed: int) -> None:
    path, hf = paths[variant], hf_models[variant]
    prompts = [random_tokens(path, n) for n in (random.randint(25, 40), random.randint(2, 24))]
    runner = PagedRunner(load_ours(path), TorchReferenceAttention(), block_size=4, num_blocks=32)
    logits = runner.step([("a", prompts[0]), ("b", prompts[1])])
    for prompt, got in zip(prompts, logits, strict=True):
        error = relative_error(got, hf_logits(hf, prompt))
        print(f"{variant}, prefill of {len(prompt)} tokens: max |diff| / max |logit| = {error:.2e}")
        assert error <= RELATIVE_TOLERANCE, f"{variant}: prefill logits off by {error:.2e} (seed={seed})"


@pytest.mark.parametrize("variant", VARIANTS)
def test_prefill_and_decode_beside_a_neighbour_match_hf(
    variant: str, paths: dict[str, Path], hf_models: dict[str, Any], seed: int
) -> None:
    path, hf = paths[variant], hf_models[variant]
    prompt = random_tokens(path, random.randint(12, 30))
    neighbour = random_tokens(path, random.randint(3, 15))
    runner = PagedRunner(load_ours(path), TorchReferenceAttention(), block_size=4, num_blocks=64)
    logits, generated = runner.greedy_beside_a_neighbour(prompt, neighbour, random_tokens(path, DECODE_STEPS - 1))
    error = relative_error(logits, hf_logits(hf, prompt + generated[:-1]))
    print(f"{variant}, prefill {len(prompt)} + {DECODE_STEPS - 1} decodes: max |diff| / max |logit| = {error:.2e}")
    assert error <= RELATIVE_TOLERANCE, f"{variant}: logits off by {error:.2e} (seed={seed})"
    expected = hf_greedy(hf, prompt, DECODE_STEPS)
    assert_greedy_agrees(generated, expected, hf_greedy_row(hf, prompt, expected), TIE, f"{variant} greedy")


def test_hf_applies_the_window_and_the_qk_norms_we_compare_against(
    paths: dict[str, Path], hf_models: dict[str, Any], seed: int
) -> None:
    """Otherwise the comparisons would not test them: past the window, transformers' windowed
    logits differ from the same weights' with the window off; and the q/k norm weights matter."""
    path, windowed = paths["qwen3-sliding-tied"], hf_models["qwen3-sliding-tied"]
    # (from_pretrained's use_sliding_window=False would not do: the saved layer_types win.)
    full = transformers.AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, layer_types=["full_attention"] * 3
    ).eval()
    tokens = random_tokens(path, 3 * WINDOW)
    with_window, without = hf_logits(windowed, tokens), hf_logits(full, tokens)
    assert relative_error(with_window[:WINDOW], without[:WINDOW]) <= RELATIVE_TOLERANCE, f"seed={seed}"
    assert relative_error(with_window[WINDOW:], without[WINDOW:]) > 1e-2, f"seed={seed}"
    assert [layer.sliding_window for layer in load_ours(path).attention_layers] == [None, WINDOW, WINDOW]

    unnormed = transformers.AutoModelForCausalLM.from_pretrained(str(paths["qwen3"]), dtype=torch.float32).eval()
    with torch.no_grad():
        for layer in unnormed.model.layers:
            layer.self_attn.q_norm.weight.fill_(1.0)
            layer.self_attn.k_norm.weight.fill_(1.0)
    assert relative_error(hf_logits(unnormed, tokens), hf_logits(hf_models["qwen3"], tokens)) > 1e-2


def test_fused_expert_names_load_the_same_model(
    tmp_path: Path, paths: dict[str, Path], hf_models: dict[str, Any], weights_seed: int, seed: int
) -> None:
    """transformers' fused ``mlp.experts.gate_up_proj`` / ``down_proj`` layout and the per-expert
    names Qwen's releases use give the same logits."""
    fused = write_tiny_qwen3_moe(tmp_path / "fused", seed=weights_seed, per_expert_names=False)
    names = load_checkpoint(str(fused)).tensor_names
    assert "model.layers.1.mlp.experts.gate_up_proj" in names
    assert not any(".mlp.experts.0." in name for name in names)
    prompt = random_tokens(fused, 29)
    (got,) = PagedRunner(load_ours(fused), TorchReferenceAttention()).step([("a", prompt)])
    (per_expert,) = PagedRunner(load_ours(paths["qwen3-moe"]), TorchReferenceAttention()).step([("a", prompt)])
    assert torch.equal(got, per_expert), f"seed={seed}"
    assert relative_error(got, hf_logits(hf_models["qwen3-moe"], prompt)) <= RELATIVE_TOLERANCE


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_routing_is_transformers_router(norm_topk_prob: bool, seed: int) -> None:
    """The core's ``route`` for Qwen3-MoE's RoutingConfig picks the experts of transformers'
    ``Qwen3MoeTopKRouter`` with its weights: softmax in float32 over all experts, top-k, then
    renormalised only with ``norm_topk_prob``."""
    config = transformers.Qwen3MoeConfig(
        hidden_size=32, num_experts=16, num_experts_per_tok=4, norm_topk_prob=norm_topk_prob
    )
    router = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter(config)
    with torch.no_grad():
        router.weight.normal_()
    hidden = torch.randn(200, 32)
    with torch.no_grad():
        logits, weights, ids = router(hidden)
    args = LlamaArgs.from_config({**config.to_dict(), "num_hidden_layers": 2})
    assert args.sparse is not None
    our_ids, our_weights = route(logits.float(), args.sparse.routing)
    assert torch.equal(our_ids.long(), ids), f"seed={seed}"
    torch.testing.assert_close(our_weights, weights, rtol=1e-6, atol=1e-7, msg=lambda m: f"seed={seed}: {m}")


# --------------------------------------------------------------------------- the engine


@pytest.mark.parametrize("variant", VARIANTS)
def test_engine_greedy_equals_hf(variant: str, paths: dict[str, Path], hf_models: dict[str, Any], seed: int) -> None:
    path, hf = paths[variant], hf_models[variant]
    prompts = [random_tokens(path, random.randint(15, 35)), random_tokens(path, random.randint(3, 14))]
    params = SamplingParams(temperature=0, max_tokens=DECODE_STEPS, ignore_eos=True)
    with LLM(str(path), dtype="float32", block_size=4, num_blocks=64, prefix_caching=False) as llm:
        assert type(llm.engine.runner.model) is Qwen3ForCausalLM
        outputs = llm.generate(prompts, params)
    for prompt, output in zip(prompts, outputs, strict=True):
        expected = hf_greedy(hf, prompt, DECODE_STEPS)
        tokens = list(output.outputs[0].token_ids)
        assert_greedy_agrees(tokens, expected, hf_greedy_row(hf, prompt, expected), TIE, f"{variant} engine greedy")


@pytest.mark.slow
def test_data_and_expert_parallel_give_the_same_greedy_tokens(paths: dict[str, Path], seed: int) -> None:
    """(DP, EP) = (2, 2) over spawned processes: each rank loads half the experts, tokens route
    across ranks, and the greedy tokens are the one-process engine's."""
    path = paths["qwen3-moe"]
    prompts = [random_tokens(path, n) for n in (5, 23, 17, 9)]
    params = SamplingParams(temperature=0, max_tokens=DECODE_STEPS, ignore_eos=True)
    with LLM(str(path), dtype="float32", block_size=4, memory_gib=0.05) as llm:
        one = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
    with LLM(str(path), dtype="float32", block_size=4, memory_gib=0.05, data_parallel=2, expert_parallel=2) as llm:
        two = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
        experts = [w.experts for w in llm.engine.workers]
    assert experts == [(0, 4), (4, 4)]
    assert two == one, f"seed={seed}"


# --------------------------------------------------------------------------- config and registry


def test_the_llama_record_builds_qwen3_and_asks_for_a_moe_backend(paths: dict[str, Path]) -> None:
    manager = PluginManager.load(environ={"POWERTRAIN_DISABLE_PLUGIN_AUTOLOAD": "1"})
    manager.register(powertrain.builtin.models)
    (provided,) = [p for p in manager.records("model") if p.record.name == "llama"]
    assert {"Qwen3ForCausalLM", "Qwen3MoeForCausalLM"} <= provided.record.architectures
    requirements = provided.record.requirements
    assert requirements is not None
    dense, sliding, moe = (config_of(paths[variant]) for variant in VARIANTS)
    assert "moe" not in requirements(dense) and "sliding-window" not in requirements(dense)["attention"]
    assert "sliding-window" in requirements(sliding)["attention"]
    assert "moe" in requirements(moe)
    assert "moe" not in requirements({**moe, "num_experts": 0})  # then every layer is dense
    model = provided.record.factory(context_of(moe))
    assert isinstance(model, Qwen3ForCausalLM)
    # Its layers are not Llama-shaped: no kernel pack may take them as a fused Llama stack.
    assert not hasattr(model, "decoder_layer_parts")
    assert [i for i, layer in enumerate(model.model.layers) if layer.mlp in model.routed_expert_layers()] == [1, 2]


def test_config_rules_follow_transformers() -> None:
    """Qwen3Config's defaults and window rule; Qwen3-MoE slides every layer when the window is on."""
    base = {"model_type": "qwen3", "vocab_size": 64, "hidden_size": 64, "intermediate_size": 96}
    base |= {"num_hidden_layers": 4, "num_attention_heads": 4}
    assert LlamaArgs.from_config(base).head_dim == 128  # Qwen3Config's default, not 64 / 4
    windowed = {**base, "sliding_window": 8, "use_sliding_window": True}
    assert LlamaArgs.from_config({**windowed, "max_window_layers": 2}).sliding_windows == (None, None, 8, 8)
    assert LlamaArgs.from_config(windowed).sliding_windows == (None,) * 4  # max_window_layers defaults to 28
    typed = {**windowed, "layer_types": ["full_attention", "sliding_attention"] * 2}
    assert LlamaArgs.from_config(typed).sliding_windows == (None, 8, None, 8)
    assert LlamaArgs.from_config({**typed, "use_sliding_window": False}).sliding_windows == (None,) * 4
    moe = {**windowed, "model_type": "qwen3_moe", "max_window_layers": 2, "num_experts": 4, "num_experts_per_tok": 2}
    args = LlamaArgs.from_config(moe)
    assert args.sliding_windows == (8,) * 4 and args.head_dim == 16 and args.qk_norm
    assert args.sparse is not None and args.sparse.layers == {0, 1, 2, 3}
    sparse = LlamaArgs.from_config({**moe, "decoder_sparse_step": 2, "mlp_only_layers": [3]}).sparse
    assert sparse is not None and sparse.layers == {1}
    # transformers' save_pretrained spells the expert count num_local_experts.
    renamed = {k: v for k, v in moe.items() if k != "num_experts"} | {"num_local_experts": 6}
    sparse = LlamaArgs.from_config(renamed).sparse
    assert sparse is not None and sparse.routing.num_experts == 6


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"num_experts_per_tok": 9}, r"num_experts_per_tok=9 must be between 1 and num_experts=8"),
        ({"mlp_only_layers": [0, 3]}, r"mlp_only_layers=\[0, 3\] names layers \[3\] outside 0..2"),
        ({"decoder_sparse_step": 0}, r"decoder_sparse_step=0 must be at least 1"),
        ({"moe_intermediate_size": 0}, r"moe_intermediate_size=0 must be positive"),
        ({"hidden_act": "gelu"}, r"silu MLP, but the config says hidden_act='gelu'"),
        ({"num_key_value_heads": 3}, r"num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
    ],
)
def test_configs_it_cannot_follow_are_refused(paths: dict[str, Path], changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Qwen3ForCausalLM(context_of({**config_of(paths["qwen3-moe"]), **changes}))


def test_qwen3_needs_its_own_class_and_a_moe_backend(paths: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="has per-head q/k norms.*build Qwen3ForCausalLM"):
        LlamaForCausalLM(context_of(config_of(paths["qwen3"])))
    with pytest.raises(ValueError, match="reads model_type 'qwen3' or 'qwen3_moe' configs, not 'llama'"):
        Qwen3ForCausalLM(context_of({**config_of(paths["qwen3"]), "model_type": "llama"}))
    no_moe = ModelContext(
        config=config_of(paths["qwen3-moe"]),
        dtype=torch.float32,
        device=torch.device("cpu"),
        attention=TorchReferenceAttention(),
    )
    with pytest.raises(ValueError, match="a Qwen3-MoE model needs a MoE backend"):
        Qwen3ForCausalLM(no_moe)


def test_missing_expert_tensors_are_named(paths: dict[str, Path]) -> None:
    path = paths["qwen3-moe"]
    model = Qwen3ForCausalLM(context_of(config_of(path)))
    dropped = {"model.layers.2.mlp.experts.5.up_proj.weight", "model.layers.1.mlp.gate.weight"}
    weights = ((n, t) for n, t in load_checkpoint(str(path)).tensors() if n not in dropped)
    with pytest.raises(ValueError, match="missing tensors: model.layers.1.mlp.gate.weight, model.layers.2.mlp.exp"):
        model.load_weights(weights)


# --------------------------------------------------------------------------- GGUF

#: HF module -> llama.cpp tensor (gguf-py's own names, so the loader's table is checked, not copied).
_LLAMA_CPP = {
    "model.embed_tokens": gguf.MODEL_TENSOR.TOKEN_EMBD,
    "model.norm": gguf.MODEL_TENSOR.OUTPUT_NORM,
    "lm_head": gguf.MODEL_TENSOR.OUTPUT,
    "input_layernorm": gguf.MODEL_TENSOR.ATTN_NORM,
    "self_attn.q_proj": gguf.MODEL_TENSOR.ATTN_Q,
    "self_attn.k_proj": gguf.MODEL_TENSOR.ATTN_K,
    "self_attn.v_proj": gguf.MODEL_TENSOR.ATTN_V,
    "self_attn.o_proj": gguf.MODEL_TENSOR.ATTN_OUT,
    "self_attn.q_norm": gguf.MODEL_TENSOR.ATTN_Q_NORM,
    "self_attn.k_norm": gguf.MODEL_TENSOR.ATTN_K_NORM,
    "post_attention_layernorm": gguf.MODEL_TENSOR.FFN_NORM,
    "mlp.gate_proj": gguf.MODEL_TENSOR.FFN_GATE,
    "mlp.up_proj": gguf.MODEL_TENSOR.FFN_UP,
    "mlp.down_proj": gguf.MODEL_TENSOR.FFN_DOWN,
    "mlp.gate": gguf.MODEL_TENSOR.FFN_GATE_INP,
    "mlp.experts.gate_proj": gguf.MODEL_TENSOR.FFN_GATE_EXP,
    "mlp.experts.up_proj": gguf.MODEL_TENSOR.FFN_UP_EXP,
    "mlp.experts.down_proj": gguf.MODEL_TENSOR.FFN_DOWN_EXP,
}


def llama_cpp_name(hf_name: str) -> str:
    module = hf_name.removesuffix(".weight")
    if not module.startswith("model.layers."):
        return gguf.TENSOR_NAMES[_LLAMA_CPP[module]] + ".weight"
    _, _, layer, rest = module.split(".", 3)
    return gguf.TENSOR_NAMES[_LLAMA_CPP[rest]].format(bid=int(layer)) + ".weight"


def write_gguf(folder: Path, path: Path, quantize: gguf.GGMLQuantizationType | None = None) -> Path:
    """What llama.cpp's convert_hf_to_gguf.py writes for a Qwen3 / Qwen3-MoE folder, in F32: its
    Qwen converters leave q/k rows unpermuted (NEOX rope is HF's half split), stack each MoE
    layer's experts per projection (``[experts, rows, cols]``) and omit a tied head. Tokens,
    merges and special ids are the folder's tokenizer's (which splits words as GPT-2 does).
    ``quantize``: the block type the attention and dense MLP projections are stored in."""
    config = config_of(folder)
    moe = config["model_type"] == "qwen3_moe"
    writer = gguf.GGUFWriter(str(path), arch="qwen3moe" if moe else "qwen3")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if moe:
        writer.add_expert_count(config["num_local_experts"])
        writer.add_expert_used_count(config["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"] | {t["content"]: t["id"] for t in tokenizer["added_tokens"]}
    special = {t["id"] for t in tokenizer["added_tokens"] if t["special"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(sorted(vocab, key=vocab.__getitem__))
    writer.add_token_types([3 if i in special else 1 for i in range(len(vocab))])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]])
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    tensors = dict(load_checkpoint(str(folder)).tensors())
    stacked: dict[str, list[torch.Tensor]] = {}
    for name, tensor in tensors.items():
        if ".mlp.experts." in name:  # model.layers.L.mlp.experts.E.P.weight, E in order
            layer_part, _, rest = name.partition(".experts.")
            stacked.setdefault(f"{layer_part}.experts.{rest.split('.', 1)[1]}", []).append(tensor)
        elif quantize is not None and "_proj." in name:
            stored = gguf.quants.quantize(tensor.numpy(), quantize)
            writer.add_tensor(llama_cpp_name(name), stored, raw_shape=stored.shape, raw_dtype=quantize)
        elif not (name == "lm_head.weight" and config["tie_word_embeddings"]):
            writer.add_tensor(llama_cpp_name(name), tensor.numpy())
    for name, experts in stacked.items():
        writer.add_tensor(llama_cpp_name(name), torch.stack(experts).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("variant", ["qwen3", "qwen3-moe"])
def test_a_llama_cpp_gguf_of_the_checkpoint_matches_hf(
    variant: str, tmp_path: Path, paths: dict[str, Path], hf_models: dict[str, Any], weights_seed: int, seed: int
) -> None:
    """llama.cpp's qwen3moe has experts in every layer: its file is written from a checkpoint
    without ``mlp_only_layers``, and transformers on that checkpoint is the oracle."""
    folder, hf = paths[variant], hf_models[variant]
    if variant == "qwen3-moe":
        folder = write_tiny_qwen3_moe(tmp_path / "all-moe", seed=weights_seed, mlp_only_layers=[])
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    path = write_gguf(folder, tmp_path / f"{variant}.gguf")
    checkpoint = load_checkpoint(str(path))
    assert checkpoint.format == "gguf"
    assert checkpoint.config["architectures"] == config_of(folder)["architectures"]
    assert sorted(checkpoint.tensor_names) == sorted(load_checkpoint(str(folder)).tensor_names)
    assert ("moe" in llama_requirements(checkpoint.config)) is (variant == "qwen3-moe")
    prompt = random_tokens(folder, random.randint(12, 30))
    runner = PagedRunner(load_ours(path), TorchReferenceAttention(), block_size=4, num_blocks=64)
    logits, generated = runner.greedy_beside_a_neighbour(prompt, random_tokens(folder, 7), random_tokens(folder, 11))
    error = relative_error(logits, hf_logits(hf, prompt + generated[:-1]))
    print(f"{variant} from GGUF, prefill {len(prompt)} + 11 decodes: max |diff| / max |logit| = {error:.2e}")
    assert error <= RELATIVE_TOLERANCE, f"{variant} from GGUF: logits off by {error:.2e} (seed={seed})"
    params = SamplingParams(temperature=0, max_tokens=DECODE_STEPS, ignore_eos=True)
    with LLM(str(path), dtype="float32", block_size=4, num_blocks=64) as llm:
        (output,) = llm.generate([prompt], params)
    expected = hf_greedy(hf, prompt, DECODE_STEPS)
    tokens = list(output.outputs[0].token_ids)
    assert_greedy_agrees(tokens, expected, hf_greedy_row(hf, prompt, expected), TIE, f"{variant} GGUF engine greedy")


def test_qwen3_projections_kept_quantized_give_the_dequantized_logits(
    tmp_path: Path, paths: dict[str, Path], seed: int
) -> None:
    """Q8_0 projections kept as stored (the reference kernel multiplies by exactly the values
    dequantisation gives): q/k rows are left in the order the file has them, as dequantised."""
    from powertrain.builtin.quantized_linear import DequantizingLinear

    path = write_gguf(paths["qwen3"], tmp_path / "q8.gguf", gguf.GGMLQuantizationType.Q8_0)
    checkpoint = load_checkpoint(str(path))
    assert checkpoint.quantized_formats == {"q8"}
    prompt = random_tokens(paths["qwen3"], 19)
    logits = []
    for kernel in (DequantizingLinear(), None):
        context = ModelContext(
            config=checkpoint.config,
            dtype=torch.float32,
            device=torch.device("cpu"),
            attention=TorchReferenceAttention(),
            quantized_linear=kernel,
        )
        model = Qwen3ForCausalLM(context)
        model.load_weights(checkpoint.tensors(keep_quantized=model.keep_quantized if kernel else None))
        assert (model.model.layers[0].self_attn.qkv_proj.quantized is not None) is (kernel is not None)
        logits.append(PagedRunner(model, TorchReferenceAttention()).step([("a", prompt)])[0])
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-5, atol=1e-5, msg=lambda m: f"seed {seed}: {m}")


def test_gguf_stacked_experts_become_per_expert_names() -> None:
    assert hf_tensor_names("blk.2.ffn_up_exps.weight", 3) == tuple(
        f"model.layers.2.mlp.experts.{e}.up_proj.weight" for e in range(3)
    )
    assert hf_tensor_names("blk.0.attn_k_norm.weight", 3) == ("model.layers.0.self_attn.k_norm.weight",)
    assert hf_tensor_names("blk.1.ffn_gate_inp.weight", 3) == ("model.layers.1.mlp.gate.weight",)


def test_a_gguf_router_that_is_not_a_softmax_is_refused(tmp_path: Path) -> None:
    sigmoid = tmp_path / "sigmoid-gated.gguf"
    writer = gguf.GGUFWriter(str(sigmoid), arch="qwen3moe")
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    writer.add_block_count(1)
    writer.add_embedding_length(8)
    writer.add_head_count(2)
    writer.add_expert_count(4)
    writer.add_expert_used_count(2)
    writer.add_expert_feed_forward_length(4)
    writer.add_tensor("token_embd.weight", np.zeros((16, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedCheckpointError, match="expert_gating_func is 2, but Qwen3-MoE routes through a"):
        load_checkpoint(str(sigmoid))

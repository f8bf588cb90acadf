"""Tiny random DeepSeek checkpoints (powertrain.testing.checkpoints), checked against HF transformers."""

from __future__ import annotations

import json
import random
import string
from pathlib import Path
from typing import Any

import pytest
import tokenizers
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from powertrain.loader import load_checkpoint
from powertrain.testing import fresh_seed, write_tiny_deepseek
from powertrain.testing.checkpoints import RECIPE_FILE, TINY_DEEPSEEK_CONFIGS

transformers = pytest.importorskip("transformers")

HIDDEN = TINY_DEEPSEEK_CONFIGS["v3"]["hidden_size"]
LAYERS = TINY_DEEPSEEK_CONFIGS["v3"]["num_hidden_layers"]


@pytest.fixture(scope="module")
def seed() -> int:
    return fresh_seed()


@pytest.fixture(scope="module")
def tiny_v3(tmp_path_factory: pytest.TempPathFactory, seed: int) -> Path:
    return write_tiny_deepseek(tmp_path_factory.mktemp(f"tiny-v3-seed{seed}"), seed=seed)


@pytest.fixture(scope="module")
def tiny_v2_lite(tmp_path_factory: pytest.TempPathFactory, seed: int) -> Path:
    return write_tiny_deepseek(tmp_path_factory.mktemp(f"tiny-v2-lite-seed{seed}"), variant="v2-lite", seed=seed)


def stored_tensors(folder: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        tensors |= load_file(shard)
    return tensors


def logits(model: Any, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids).logits


def random_ids(vocab: int, shape: tuple[int, int] = (3, 24)) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(fresh_seed()))


def test_v3_config_is_what_transformers_writes(tiny_v3: Path) -> None:
    config = json.loads((tiny_v3 / "config.json").read_text())
    tokenizer = tokenizers.Tokenizer.from_file(str(tiny_v3 / "tokenizer.json"))
    assert config["model_type"] == "deepseek_v3" and config["architectures"] == ["DeepseekV3ForCausalLM"]
    assert config["vocab_size"] == tokenizer.get_vocab_size(with_added_tokens=True) == 512
    assert (config["hidden_size"], config["num_hidden_layers"], config["first_k_dense_replace"]) == (256, 3, 1)
    assert (config["n_routed_experts"], config["num_experts_per_tok"], config["n_shared_experts"]) == (8, 2, 1)
    assert (config["n_group"], config["topk_group"], config["q_lora_rank"], config["kv_lora_rank"]) == (2, 1, 96, 64)
    assert config["num_nextn_predict_layers"] == 1
    # transformers 5 spells rope settings as rope_parameters (rope_type, rope_theta inside).
    assert "rope_scaling" not in config and "rope_theta" not in config
    assert config["rope_parameters"] == {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 128,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
    }
    assert config["rope_interleave"] is True  # DeepseekV3Config's default
    assert config["scoring_func"] == "sigmoid" and config["topk_method"] == "noaux_tc"


def test_v3_loads_back_in_transformers(tiny_v3: Path) -> None:
    model = transformers.DeepseekV3ForCausalLM.from_pretrained(tiny_v3)
    stored = stored_tensors(tiny_v3)
    # transformers fuses experts in memory; compare through its own per-expert names.
    state = model.state_dict()
    for layer in range(1, LAYERS):
        prefix = f"model.layers.{layer}.mlp.experts"
        gate_up, down = state.pop(f"{prefix}.gate_up_proj"), state.pop(f"{prefix}.down_proj")
        for expert in range(8):
            gate, up = gate_up[expert].chunk(2)
            assert torch.equal(gate, stored[f"{prefix}.{expert}.gate_proj.weight"])
            assert torch.equal(up, stored[f"{prefix}.{expert}.up_proj.weight"])
            assert torch.equal(down[expert], stored[f"{prefix}.{expert}.down_proj.weight"])
    for name, tensor in state.items():
        assert torch.equal(tensor, stored[name]), name
    # Non-trivial values everywhere: norms are not ones, the correction bias is not zero.
    assert (state["model.layers.0.input_layernorm.weight"] - 1).std() > 0.05
    assert state["model.layers.1.mlp.gate.e_score_correction_bias"].abs().min() > 0
    output = logits(model, random_ids(model.config.vocab_size))
    assert torch.isfinite(output).all() and output.std() > 0.3


def test_mtp_layer_is_stored_as_deepseek_v3_stores_it(tiny_v3: Path, tmp_path: Path, seed: int) -> None:
    index = json.loads((tiny_v3 / "model.safetensors.index.json").read_text())
    weight_map = index["weight_map"]
    mtp_names = {name for name in weight_map if name.startswith(f"model.layers.{LAYERS}.")}
    assert {weight_map[name] for name in mtp_names} == {"model-00002-of-00002.safetensors"}
    assert set(weight_map.values()) == {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}
    stored = stored_tensors(tiny_v3)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in stored.values())
    prefix = f"model.layers.{LAYERS}"
    vocab = stored["lm_head.weight"].shape[0]
    shapes = {
        "enorm.weight": (HIDDEN,),
        "hnorm.weight": (HIDDEN,),
        "eh_proj.weight": (HIDDEN, 2 * HIDDEN),
        "shared_head.norm.weight": (HIDDEN,),
        "shared_head.head.weight": (vocab, HIDDEN),
        "embed_tokens.weight": (vocab, HIDDEN),
        "input_layernorm.weight": (HIDDEN,),
        "post_attention_layernorm.weight": (HIDDEN,),
        "self_attn.q_a_proj.weight": (96, HIDDEN),
        "self_attn.q_b_proj.weight": (4 * 48, 96),
        "self_attn.kv_a_proj_with_mqa.weight": (64 + 16, HIDDEN),
        "self_attn.kv_b_proj.weight": (4 * (32 + 32), 64),
        "self_attn.o_proj.weight": (HIDDEN, 4 * 32),
        "mlp.gate.weight": (8, HIDDEN),
        "mlp.gate.e_score_correction_bias": (8,),
        "mlp.shared_experts.gate_proj.weight": (64, HIDDEN),
        "mlp.experts.7.down_proj.weight": (HIDDEN, 64),
    }
    for name, shape in shapes.items():
        assert tuple(stored[f"{prefix}.{name}"].shape) == shape, name
    # The MTP block is a MoE layer named exactly like the main model's MoE layers.
    main_block = {name.split(".", 3)[3] for name in stored if name.startswith("model.layers.1.")}
    mtp_block = {name.split(".", 3)[3] for name in mtp_names} - {
        "enorm.weight",
        "hnorm.weight",
        "eh_proj.weight",
        "shared_head.norm.weight",
        "shared_head.head.weight",
        "embed_tokens.weight",
    }
    assert mtp_block == main_block
    assert torch.equal(stored[f"{prefix}.embed_tokens.weight"], stored["model.embed_tokens.weight"])
    assert torch.equal(stored[f"{prefix}.shared_head.head.weight"], stored["lm_head.weight"])
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        assert (stored[f"{prefix}.{norm}.weight"] - 1).std() > 0.05, norm
    assert not torch.equal(
        stored[f"{prefix}.self_attn.o_proj.weight"], stored["model.layers.1.self_attn.o_proj.weight"]
    )

    # transformers skips layer L, so the MTP tensors change nothing for the main model.
    without_mtp = write_tiny_deepseek(tmp_path / "no-mtp", seed=seed, num_nextn_predict_layers=0)
    assert not (without_mtp / "model.safetensors.index.json").exists()
    with_mtp_model = transformers.DeepseekV3ForCausalLM.from_pretrained(tiny_v3)
    plain_model = transformers.DeepseekV3ForCausalLM.from_pretrained(without_mtp)
    input_ids = random_ids(vocab)
    assert torch.equal(logits(with_mtp_model, input_ids), logits(plain_model, input_ids))


def test_transformers_mtp_model_reads_the_mtp_layer(tiny_v3: Path) -> None:
    """transformers' generic MTP module maps DeepSeek's names itself and raises on any missing weight.
    (uv.lock pins a transformers that has it; a version without it fails here, loudly.)"""
    from transformers import modeling_layers

    model = transformers.DeepseekV3ForCausalLM.from_pretrained(tiny_v3)
    # Its pattern names layer 61 (the real model's); point it at this checkpoint's MTP layer.
    model._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{LAYERS}\..*"]
    mtp = modeling_layers.MtpModel.from_pretrained(model).state_dict()
    stored = stored_tensors(tiny_v3)
    prefix = f"model.layers.{LAYERS}"
    assert torch.equal(mtp["layers.0.eh_proj.weight"], stored[f"{prefix}.eh_proj.weight"])
    assert torch.equal(mtp["layers.0.post_norm.weight"], stored[f"{prefix}.shared_head.norm.weight"])
    assert torch.equal(
        mtp["layers.0.mtp_block.self_attn.q_b_proj.weight"], stored[f"{prefix}.self_attn.q_b_proj.weight"]
    )
    gate, up = mtp["layers.0.mtp_block.mlp.experts.gate_up_proj"][5].chunk(2)
    assert torch.equal(gate, stored[f"{prefix}.mlp.experts.5.gate_proj.weight"])
    assert torch.equal(up, stored[f"{prefix}.mlp.experts.5.up_proj.weight"])


def test_v3_without_q_lora(tmp_path: Path) -> None:
    folder = write_tiny_deepseek(tmp_path, q_lora_rank=None, seed=fresh_seed())
    assert json.loads((folder / "config.json").read_text())["q_lora_rank"] is None
    stored = stored_tensors(folder)
    for layer in range(LAYERS + 1):  # the MTP block follows the config too
        assert tuple(stored[f"model.layers.{layer}.self_attn.q_proj.weight"].shape) == (4 * 48, HIDDEN)
        assert f"model.layers.{layer}.self_attn.q_a_proj.weight" not in stored
    model = transformers.DeepseekV3ForCausalLM.from_pretrained(folder)
    assert model.model.layers[0].self_attn.q_a_proj is None
    assert torch.equal(model.model.layers[2].self_attn.q_proj.weight, stored["model.layers.2.self_attn.q_proj.weight"])
    assert torch.isfinite(logits(model, random_ids(model.config.vocab_size))).all()


def test_v2_lite_shape(tiny_v2_lite: Path) -> None:
    config = json.loads((tiny_v2_lite / "config.json").read_text())
    assert config["model_type"] == "deepseek_v2" and config["architectures"] == ["DeepseekV2ForCausalLM"]
    assert config["q_lora_rank"] is None and config["n_shared_experts"] == 2
    assert (config["topk_method"], config["scoring_func"], config["norm_topk_prob"]) == ("greedy", "softmax", False)
    assert (config["n_group"], config["topk_group"], config["first_k_dense_replace"]) == (1, 1, 1)
    assert config["rope_parameters"]["rope_type"] == "yarn"
    assert "num_nextn_predict_layers" not in config  # V2-Lite has no MTP layer
    stored = stored_tensors(tiny_v2_lite)
    assert not any(name.startswith(f"model.layers.{LAYERS}.") for name in stored)
    assert tuple(stored["model.layers.1.mlp.shared_experts.gate_proj.weight"].shape) == (2 * 64, HIDDEN)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_v2_lite)
    assert type(model).__name__ == "DeepseekV2ForCausalLM"
    assert torch.equal(model.model.layers[1].self_attn.q_proj.weight, stored["model.layers.1.self_attn.q_proj.weight"])
    output = logits(model, random_ids(model.config.vocab_size))
    assert torch.isfinite(output).all() and output.std() > 0.3


def routing(model: Any, input_ids: torch.Tensor) -> list[tuple[Any, torch.Tensor, torch.Tensor]]:
    """(router module, its input, its chosen experts) for every MoE layer of a transformers model."""
    captured = []
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda module, args, out: captured.append((module, args[0], out[2])))
        for layer in model.model.layers
        if hasattr(layer.mlp, "gate")
    ]
    logits(model, input_ids)
    for hook in hooks:
        hook.remove()
    return captured


def test_v3_routing_is_not_degenerate(tiny_v3: Path) -> None:
    model = transformers.DeepseekV3ForCausalLM.from_pretrained(tiny_v3)
    layers = routing(model, random_ids(model.config.vocab_size, (4, 64)))
    assert len(layers) == LAYERS - 1
    for router, hidden, chosen in layers:
        assert torch.bincount(chosen.flatten(), minlength=8).min() > 0  # every expert gets tokens
        assert (chosen // 4).unique().numel() == 2  # both groups win sometimes
        # Removing the correction bias, or the group limit, changes the choice for some tokens.
        bias = router.e_score_correction_bias.clone()
        router.e_score_correction_bias.zero_()
        with torch.no_grad():
            unbiased = router(hidden)[2]
        router.e_score_correction_bias.copy_(bias)
        assert (unbiased.sort(-1).values != chosen.sort(-1).values).any(-1).float().mean() > 0.05
        scores = torch.sigmoid(hidden.reshape(-1, HIDDEN).float() @ router.weight.float().T) + bias
        ungrouped = scores.topk(2, dim=-1).indices
        assert (ungrouped.sort(-1).values != chosen.sort(-1).values).any(-1).float().mean() > 0.05


def test_v2_lite_routing_is_not_degenerate(tiny_v2_lite: Path) -> None:
    model = transformers.DeepseekV2ForCausalLM.from_pretrained(tiny_v2_lite)
    for _, _, chosen in routing(model, random_ids(model.config.vocab_size, (4, 64))):
        counts = torch.bincount(chosen.flatten(), minlength=8)
        assert counts.min() > 0 and counts.max() < 0.5 * chosen.numel()


def test_load_checkpoint_reads_config_and_tokenizer(tiny_v3: Path) -> None:
    checkpoint = load_checkpoint(tiny_v3)
    saved = json.loads((tiny_v3 / "config.json").read_text())
    for key, value in saved.items():
        assert checkpoint.config[key] == value, key
    assert checkpoint.config["rope_scaling"]["rope_type"] == "yarn"  # the loader adds the transformers-4 spelling
    assert checkpoint.fp8_block is None
    assert set(checkpoint.tensor_names) == set(stored_tensors(tiny_v3))
    tokenizer = checkpoint.tokenizer
    assert tokenizer.vocab_size == saved["vocab_size"]
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (saved["bos_token_id"], saved["eos_token_id"])
    assert checkpoint.generation_config["eos_token_id"] == saved["eos_token_id"]
    prompt = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Route this token."}]
    )
    assert prompt == "<｜begin▁of▁sentence｜>Be brief.<｜User｜>Route this token.<｜Assistant｜>"
    ids = tokenizer.encode(prompt)
    assert ids[0] == saved["bos_token_id"] and len(ids) < len(prompt) / 2  # merges learned; specials are one token

    oracle = transformers.AutoTokenizer.from_pretrained(str(tiny_v3))
    rng = random.Random(fresh_seed())
    for _ in range(30):
        text = "".join(rng.choices(string.ascii_letters + " \n.,!é😀", k=rng.randint(1, 60)))
        assert tokenizer.encode(text) == oracle.encode(text, add_special_tokens=False)
        assert tokenizer.encode(text, add_special_tokens=True) == oracle.encode(text)
        assert tokenizer.decode(tokenizer.encode(text)) == text
    conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert tokenizer.apply_chat_template(conversation) == oracle.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=True
    )


def test_per_expert_names_round_trip(tiny_v3: Path, tmp_path: Path, seed: int) -> None:
    fused = write_tiny_deepseek(tmp_path, seed=seed, per_expert_names=False)
    fused_tensors, per_expert_tensors = stored_tensors(fused), stored_tensors(tiny_v3)
    for layer in range(1, LAYERS + 1):
        prefix = f"model.layers.{layer}.mlp.experts"
        assert tuple(fused_tensors[f"{prefix}.gate_up_proj"].shape) == (8, 2 * 64, HIDDEN)
        assert tuple(fused_tensors[f"{prefix}.down_proj"].shape) == (8, HIDDEN, 64)
        assert not any(name.startswith(f"{prefix}.0.") for name in fused_tensors)
        for expert in range(8):
            gate, up = fused_tensors[f"{prefix}.gate_up_proj"][expert].chunk(2)
            assert torch.equal(gate, per_expert_tensors[f"{prefix}.{expert}.gate_proj.weight"])
            assert torch.equal(up, per_expert_tensors[f"{prefix}.{expert}.up_proj.weight"])
    assert not any(".experts.gate_up_proj" in name for name in per_expert_tensors)
    # transformers reads both layouts into the same model.
    from_fused = transformers.DeepseekV3ForCausalLM.from_pretrained(fused).state_dict()
    from_per_expert = transformers.DeepseekV3ForCausalLM.from_pretrained(tiny_v3).state_dict()
    assert from_fused.keys() == from_per_expert.keys()
    for name, tensor in from_fused.items():
        assert torch.equal(tensor, from_per_expert[name]), name


def test_bfloat16_keeps_the_correction_bias_in_float32(tmp_path: Path) -> None:
    folder = write_tiny_deepseek(tmp_path, dtype=torch.bfloat16, seed=fresh_seed())
    dtypes = {}
    for shard in folder.glob("*.safetensors"):
        with safe_open(shard, "pt") as file:
            dtypes |= {name: file.get_slice(name).get_dtype() for name in file.keys()}  # noqa: SIM118
    assert {name for name, dtype in dtypes.items() if dtype != "BF16"} == {
        f"model.layers.{layer}.mlp.gate.e_score_correction_bias" for layer in range(1, LAYERS + 1)
    }
    assert set(dtypes.values()) == {"BF16", "F32"}
    model = transformers.DeepseekV3ForCausalLM.from_pretrained(folder)
    assert torch.isfinite(logits(model, random_ids(model.config.vocab_size))).all()


def test_writes_are_deterministic_and_cached(tiny_v3: Path, tmp_path: Path, seed: int) -> None:
    again = write_tiny_deepseek(tmp_path / "again", seed=seed)
    first, second = stored_tensors(tiny_v3), stored_tensors(again)
    assert first.keys() == second.keys()
    assert all(torch.equal(first[name], second[name]) for name in first)
    assert (tiny_v3 / "tokenizer.json").read_bytes() == (again / "tokenizer.json").read_bytes()

    stamps = {file.name: file.stat().st_mtime_ns for file in again.iterdir()}
    assert write_tiny_deepseek(again, seed=seed) == again
    assert {file.name: file.stat().st_mtime_ns for file in again.iterdir()} == stamps  # nothing rewritten

    other_seed = write_tiny_deepseek(again, seed=seed + 1, num_nextn_predict_layers=0)  # other arguments: rewritten
    assert json.loads((other_seed / RECIPE_FILE).read_text())["seed"] == seed + 1
    assert sorted(file.name for file in other_seed.glob("*.safetensors")) == ["model.safetensors"]
    rewritten = stored_tensors(other_seed)
    assert not torch.equal(rewritten["model.embed_tokens.weight"], first["model.embed_tokens.weight"])


def test_refuses_a_folder_it_did_not_write(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="notes.txt"):
        write_tiny_deepseek(tmp_path)
    with pytest.raises(ValueError, match="variant"):
        write_tiny_deepseek(tmp_path / "new", variant="v4")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="vocab_size must be the tokenizer's size, 512"):
        write_tiny_deepseek(tmp_path / "new", vocab_size=1000)

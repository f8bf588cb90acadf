"""The tiny DeepSeek-V3.2 checkpoint (powertrain.testing.write_tiny_deepseek_v32), checked against HF transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers  # the oracle; the locked dev group pins 5.24, which has DeepSeek-V3.2
from safetensors.torch import load_file

from powertrain.testing import fresh_seed, write_tiny_deepseek_v32
from powertrain.testing.checkpoints import TINY_DEEPSEEK_V32_CONFIG

LAYERS = TINY_DEEPSEEK_V32_CONFIG["num_hidden_layers"]
INDEXER_TENSORS = {
    "wq_b.weight": (16 * 32, 96),
    "wk.weight": (32, 256),
    "k_norm.weight": (32,),
    "k_norm.bias": (32,),
    "weights_proj.weight": (16, 256),
}


@pytest.fixture(scope="module")
def seed() -> int:
    return fresh_seed()


@pytest.fixture(scope="module")
def tiny_v32(tmp_path_factory: pytest.TempPathFactory, seed: int) -> Path:
    return write_tiny_deepseek_v32(tmp_path_factory.mktemp(f"tiny-v32-seed{seed}"), seed=seed)


def test_config_is_deepseek_v32(tiny_v32: Path) -> None:
    config = json.loads((tiny_v32 / "config.json").read_text())
    assert config["model_type"] == "deepseek_v32" and config["architectures"] == ["DeepseekV32ForCausalLM"]
    assert (config["index_n_heads"], config["index_head_dim"], config["index_topk"]) == (16, 32, 8)
    assert config["mlp_layer_types"] == ["dense", "sparse", "sparse"]
    assert (config["q_lora_rank"], config["qk_rope_head_dim"], config["n_routed_experts"]) == (96, 16, 8)


def test_every_attention_layer_stores_an_indexer(tiny_v32: Path) -> None:
    stored = load_file(tiny_v32 / "model.safetensors")
    for layer in range(LAYERS):
        prefix = f"model.layers.{layer}.self_attn.indexer."
        names = {name.removeprefix(prefix) for name in stored if name.startswith(prefix)}
        assert names == set(INDEXER_TENSORS), layer
        for name, shape in INDEXER_TENSORS.items():
            assert tuple(stored[prefix + name].shape) == shape, name
        # Random, not transformers' init: the LayerNorm is neither identity nor bias-free.
        assert (stored[prefix + "k_norm.weight"] - 1).std() > 0.05
        assert stored[prefix + "k_norm.bias"].abs().min() > 0
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" in stored  # per-expert names, as released


def test_loads_back_in_transformers_with_finite_nontrivial_logits(tiny_v32: Path) -> None:
    model = transformers.DeepseekV32ForCausalLM.from_pretrained(tiny_v32).eval()
    stored = load_file(tiny_v32 / "model.safetensors")
    state = model.state_dict()
    for name in (
        f"model.layers.{layer}.self_attn.indexer.{tensor}" for layer in range(LAYERS) for tensor in INDEXER_TENSORS
    ):
        assert torch.equal(state[name], stored[name]), name
    # Longer than index_topk, so the indexer drops tokens.
    ids = torch.randint(0, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(fresh_seed()))
    with torch.no_grad():
        logits = model(ids).logits
    assert torch.isfinite(logits).all() and logits.std() > 0.3
    assert (logits[0] - logits[1]).abs().max() > 0.1  # different prompts, different logits


def test_writes_are_deterministic_and_cached(tiny_v32: Path, tmp_path: Path, seed: int) -> None:
    again = write_tiny_deepseek_v32(tmp_path / "again", seed=seed)
    written, first = load_file(again / "model.safetensors"), load_file(tiny_v32 / "model.safetensors")
    assert written.keys() == first.keys()
    for name, tensor in written.items():
        assert torch.equal(tensor, first[name]), name
    stamps = {file.name: file.stat().st_mtime_ns for file in again.iterdir()}
    assert write_tiny_deepseek_v32(again, seed=seed) == again
    assert {file.name: file.stat().st_mtime_ns for file in again.iterdir()} == stamps  # nothing rewritten
    other = write_tiny_deepseek_v32(again, seed=seed + 1)
    assert not torch.equal(
        load_file(other / "model.safetensors")["model.layers.0.self_attn.indexer.wk.weight"],
        load_file(tiny_v32 / "model.safetensors")["model.layers.0.self_attn.indexer.wk.weight"],
    )


def test_mtp_layers_are_v32_blocks_beside_unchanged_main_weights(tiny_v32: Path, tmp_path: Path, seed: int) -> None:
    """``num_nextn_predict_layers``: the MTP layer is stored past the decoder layers, its block a
    MoE one with an indexer (as DeepSeek-V3.2 releases it); the main weights are those written
    without it, and transformers loads the folder (skipping the MTP tensors) to the same logits."""
    path = write_tiny_deepseek_v32(tmp_path / "mtp", seed=seed, num_nextn_predict_layers=1)
    config = json.loads((path / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1
    assert config["mlp_layer_types"] == ["dense", "sparse", "sparse"]  # the decoder layers only
    stored = {name: t for shard in sorted(path.glob("*.safetensors")) for name, t in load_file(shard).items()}
    plain = load_file(tiny_v32 / "model.safetensors")
    for name, tensor in plain.items():
        assert torch.equal(stored[name], tensor), name
    mtp = {name.removeprefix(f"model.layers.{LAYERS}.") for name in stored.keys() - plain.keys()}
    assert all(name.startswith(f"model.layers.{LAYERS}.") for name in stored.keys() - plain.keys())
    assert {"enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight"} <= mtp
    assert {f"self_attn.indexer.{name}" for name in INDEXER_TENSORS} <= mtp
    assert {"mlp.gate.weight", "mlp.gate.e_score_correction_bias", "mlp.experts.7.down_proj.weight"} <= mtp
    assert torch.equal(stored[f"model.layers.{LAYERS}.shared_head.head.weight"], plain["lm_head.weight"])
    ids = torch.randint(0, config["vocab_size"], (1, 20), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        with_mtp = transformers.DeepseekV32ForCausalLM.from_pretrained(path).eval()(ids).logits
        without = transformers.DeepseekV32ForCausalLM.from_pretrained(tiny_v32).eval()(ids).logits
    assert torch.equal(with_mtp, without)

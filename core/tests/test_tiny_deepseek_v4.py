"""The tiny DeepSeek-V4 checkpoint (powertrain.testing.checkpoints.write_tiny_deepseek_v4), checked against HF
transformers' ``DeepseekV4ForCausalLM``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers  # the oracle; the locked dev group pins 5.24, which has DeepSeek-V4
from safetensors.torch import load_file
from transformers.models.deepseek_v4.modeling_deepseek_v4 import apply_rotary_pos_emb

from powertrain.testing import fresh_seed
from powertrain.testing.checkpoints import (
    DEEPSEEK_V4_FP4_QUANTIZATION_CONFIG,
    TINY_DEEPSEEK_V4_CONFIG,
    _tiny_deepseek_v4_model,
    dequantize_fp4,
    quantize_fp4,
    write_tiny_deepseek_v4,
)

EXPERTS = TINY_DEEPSEEK_V4_CONFIG["n_routed_experts"]
TOP_K = TINY_DEEPSEEK_V4_CONFIG["num_experts_per_tok"]
#: 10 CSA windows, 5 HCA windows, 5 times the sliding window; more CSA entries than index_topk.
PROMPT = 40


@pytest.fixture(scope="module")
def seed() -> int:
    return fresh_seed()


@pytest.fixture(scope="module")
def tiny_v4(tmp_path_factory: pytest.TempPathFactory, seed: int) -> Path:
    return write_tiny_deepseek_v4(tmp_path_factory.mktemp(f"tiny-v4-seed{seed}"), seed=seed)


@pytest.fixture(scope="module")
def tiny_v4_fp4(tmp_path_factory: pytest.TempPathFactory, seed: int) -> Path:
    return write_tiny_deepseek_v4(tmp_path_factory.mktemp(f"tiny-v4-fp4-seed{seed}"), seed=seed, fp4_experts=True)


@pytest.fixture(scope="module")
def prompts(seed: int) -> torch.Tensor:
    return torch.randint(0, 512, (2, PROMPT), generator=torch.Generator().manual_seed(seed + 1))


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def test_config_covers_every_v4_feature(tiny_v4: Path) -> None:
    config = json.loads((tiny_v4 / "config.json").read_text())
    assert config["model_type"] == "deepseek_v4" and config["architectures"] == ["DeepseekV4ForCausalLM"]
    assert set(config["layer_types"]) == {
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
    }
    assert "hash_moe" in config["mlp_layer_types"] and "moe" in config["mlp_layer_types"]
    assert config["hc_mult"] >= 2
    assert config["index_n_heads"] >= 8  # fewer make all-zero ReLU scores (top-k ties) likely
    rates = config["compress_rates"]
    assert 4 * max(rates.values()) <= PROMPT and PROMPT // rates["compressed_sparse_attention"] > config["index_topk"]
    assert config["rope_parameters"]["compress"]["rope_type"] == "yarn"
    assert config["rope_parameters"]["main"]["rope_type"] == "default"
    assert "quantization_config" not in config


def test_loads_back_in_transformers_with_the_in_memory_logits(tiny_v4: Path, seed: int, prompts: torch.Tensor) -> None:
    loaded = transformers.DeepseekV4ForCausalLM.from_pretrained(tiny_v4).eval()
    built = _tiny_deepseek_v4_model(TINY_DEEPSEEK_V4_CONFIG, seed, torch.float32)
    logits = _logits(loaded, prompts)
    assert torch.equal(logits, _logits(built, prompts))
    assert torch.isfinite(logits).all() and logits.std() > 0.3
    assert (logits[0] - logits[1]).abs().max() > 0.1  # different prompts, different logits
    # Native names, as save_pretrained writes them (DeepSeek's, under a ``model.`` prefix).
    stored = load_file(tiny_v4 / "model.safetensors")
    assert {
        "head.weight",
        "model.layers.1.attn.attn_sink",
        "model.layers.1.attn.indexer.compressor.ape",
        "model.layers.2.attn.compressor.wkv.weight",
        "model.layers.0.ffn.gate.tid2eid",
        "model.layers.3.ffn.gate.bias",
        "model.layers.0.ffn.experts.7.w3.weight",
        "model.layers.0.hc_attn_fn",
    } <= stored.keys()


def test_every_parameter_is_random_and_tid2eid_a_valid_assignment(tiny_v4: Path) -> None:
    stored = load_file(tiny_v4 / "model.safetensors")
    for name, tensor in stored.items():
        if name.endswith("tid2eid"):
            continue
        assert tensor.dtype == torch.float32, name
        if name.rsplit(".", 2)[-2].endswith("norm"):  # RMSNorm weights: 1 + 0.1 N(0, 1)
            assert (tensor - 1).abs().min() > 0 and (tensor - 1).std() > 0.03, name
        else:  # sinks, ape, mHC base/scale, the correction bias: transformers' zeros and ones replaced
            # torch.randn gives an exact 0 about once in 2^24 draws (seed 2973759967: one in an
            # expert's 2048), so a rare one is a draw, not a constant left in place.
            constant = (tensor == 0) | (tensor == 1)
            assert constant.float().mean() <= 1e-3, name
    tables = [stored[f"model.layers.{layer}.ffn.gate.tid2eid"] for layer in (0, 1)]
    assert "model.layers.2.ffn.gate.tid2eid" not in stored  # learned routing there
    for table in tables:
        assert table.dtype == torch.int64 and table.shape == (512, TOP_K)
        assert table.min() >= 0 and table.max() < EXPERTS and table.any()
        assert (table[:, 0] != table[:, 1]).all()  # distinct experts per token
        assert len(table.unique()) == EXPERTS
    assert not torch.equal(tables[0], tables[1])


def test_a_second_call_reuses_the_folder(tiny_v4: Path, seed: int) -> None:
    stamps = {file.name: file.stat().st_mtime_ns for file in tiny_v4.iterdir()}
    assert write_tiny_deepseek_v4(tiny_v4, seed=seed) == tiny_v4
    assert {file.name: file.stat().st_mtime_ns for file in tiny_v4.iterdir()} == stamps


def test_bfloat16_keeps_transformers_float32_modules(tmp_path: Path, seed: int, prompts: torch.Tensor) -> None:
    path = write_tiny_deepseek_v4(tmp_path / "bf16", seed=seed, dtype=torch.bfloat16)
    stored = load_file(path / "model.safetensors")
    assert stored["model.layers.1.attn.wq_a.weight"].dtype == torch.bfloat16
    for name in ("hc_attn_fn", "attn.attn_sink", "attn.compressor.ape", "attn_norm.weight", "ffn.gate.bias"):
        assert stored[f"model.layers.3.{name}"].dtype == torch.float32, name
    loaded = transformers.DeepseekV4ForCausalLM.from_pretrained(path).eval()
    logits = _logits(loaded, prompts)
    assert torch.isfinite(logits).all()
    assert torch.equal(logits, _logits(_tiny_deepseek_v4_model(TINY_DEEPSEEK_V4_CONFIG, seed, torch.bfloat16), prompts))


def _entries_from_rows(compressor: torch.nn.Module, x: torch.Tensor, rate: int, overlap: bool) -> torch.Tensor:
    """Compressed entries as docs/deepseek_v4_notes.md states them: per-token rows
    ``[kv_proj(x_t) | gate_proj(x_t) + ape[t mod m]]``; entry w softmax-mixes (per channel) the rows
    of window w (CSA: their second half, plus the first half of window w-1's rows), then the norm,
    then RoPE ("compress" table) at position w*m. ``x``: ``[S, D]``, one sequence's attention input."""
    kv, gate = compressor.kv_proj(x), compressor.gate_proj(x)
    windows = x.shape[0] // rate
    score = gate[: windows * rate] + compressor.position_bias.repeat(windows, 1)
    half = kv.shape[-1] // 2
    entries = []
    for w in range(windows):
        now = slice(w * rate, (w + 1) * rate)
        if overlap:
            before = slice(max(w - 1, 0) * rate, w * rate)  # empty for w = 0
            rows = torch.cat([kv[before, :half], kv[now, half:]])
            scores = torch.cat([score[before, :half], score[now, half:]])
        else:
            rows, scores = kv[now], score[now]
        entries.append((rows * scores.softmax(dim=0)).sum(dim=0))
    entries = compressor.kv_norm(torch.stack(entries))[None]
    positions = torch.arange(windows)[None] * rate
    cos, sin = compressor.rotary_emb(entries, position_ids=positions, layer_type="compress")
    return apply_rotary_pos_emb(entries.unsqueeze(1), cos, sin)[0, 0]


def test_compressed_entries_are_a_function_of_recent_token_rows(tiny_v4: Path, prompts: torch.Tensor) -> None:
    """The compressor-state claim of docs/deepseek_v4_notes.md, against transformers: the entries
    its cache holds after a chunked prefill and single-token decode steps are those computed from
    per-token rows alone (CSA from the last 2m tokens' rows, HCA from the last m'), and the
    chunked run's logits are the one-shot forward's.

    With every compressed entry selected (``index_topk`` at least the prompt): the claim is
    about the compressors, and transformers' indexer picks a different top 4 chunked than in
    one shot for some prompts (seed 407608741: logits off by 0.47 at token 19, in float64
    too; with every entry selected the two agree to 4e-6)."""
    model = transformers.DeepseekV4ForCausalLM.from_pretrained(tiny_v4, index_topk=PROMPT).eval()
    inputs: dict[int, torch.Tensor] = {}
    hooks = [
        layer.self_attn.register_forward_pre_hook(lambda _m, args, i=i: inputs.__setitem__(i, args[0][0]))
        for i, layer in enumerate(model.model.layers)
    ]
    ids = prompts[:1]
    with torch.no_grad():
        full = model(ids).logits
        x = dict(inputs)
        cache = transformers.DynamicCache(config=model.config)
        pieces, start = [], 0
        for stop in (13, 14, 15, 16, 23, *range(24, PROMPT + 1)):
            pieces.append(model(ids[:, start:stop], cache=cache, use_cache=True).logits)
            start = stop
    for hook in hooks:
        hook.remove()
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=0, atol=1e-5 * full.abs().max().item())
    rates = model.config.compress_rates
    with torch.no_grad():
        for i, layer_type in enumerate(model.config.layer_types):
            if layer_type == "sliding_attention":
                continue
            compressor, state = model.model.layers[i].self_attn.compressor, cache.layers[i]
            csa = layer_type == "compressed_sparse_attention"
            expected = {"compressor": _entries_from_rows(compressor, x[i], rates[layer_type], csa)}
            if csa:
                expected["indexer"] = _entries_from_rows(compressor.indexer, x[i], rates[layer_type], True)
            for name, entries in expected.items():
                assert entries.shape[0] == PROMPT // rates[layer_type]
                torch.testing.assert_close(state.compressed_kv[name][0].squeeze(0), entries, rtol=1e-5, atol=1e-5)


def test_fp4_roundtrip_is_on_the_e2m1_grid() -> None:
    weight = torch.randn(6, 96, generator=torch.Generator().manual_seed(fresh_seed())) * 3
    packed, scale = quantize_fp4(weight)
    assert packed.dtype == torch.int8 and packed.shape == (6, 48)
    assert scale.dtype == torch.float8_e8m0fnu and scale.shape == (6, 3)
    restored = dequantize_fp4(packed, scale)
    groups = scale.float().repeat_interleave(32, dim=-1)
    # Round to nearest: within half the widest grid step (6 - 4) of each group's scale.
    assert ((restored - weight).abs() <= groups).all()
    assert (restored.abs() <= 6 * groups).all() and ((weight.abs() / groups) > 3).any()
    assert torch.equal(dequantize_fp4(*quantize_fp4(restored)), restored)  # grid values are exact
    # Ties round to the even code (as a float cast does): 0.25 -> 0, 0.75 -> 1, 2.5 -> 2, 5 -> 4; scale 1.
    ties = torch.tensor([[0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0] + [6.0] * 24])
    assert dequantize_fp4(*quantize_fp4(ties))[0, :8].tolist() == [0, 1, 1, 2, 2, 4, 4, -4]


def test_fp4_experts_load_in_transformers_as_the_dequantised_model(
    tiny_v4: Path, tiny_v4_fp4: Path, seed: int, prompts: torch.Tensor
) -> None:
    """The FP4 folder is the float one with the experts packed; transformers dequantises them on
    load (on CPU it must) to exactly the float32 weights they stand for (e2m1 values times powers
    of two), so its logits equal a float model holding ``dequantize_fp4``'s experts. The tolerance,
    1e-5 of the largest logit, only allows for a different summation order, should transformers
    ever dequantise differently; the FP4 rounding itself moves logits by O(1) here."""
    config = json.loads((tiny_v4_fp4 / "config.json").read_text())
    assert config["quantization_config"] == DEEPSEEK_V4_FP4_QUANTIZATION_CONFIG
    float_tensors = load_file(tiny_v4 / "model.safetensors")
    fp4_tensors = load_file(tiny_v4_fp4 / "model.safetensors")
    scales = {name for name in fp4_tensors if name.endswith(".scale")}
    assert fp4_tensors.keys() - scales == float_tensors.keys()
    assert len(scales) == 3 * EXPERTS * TINY_DEEPSEEK_V4_CONFIG["num_hidden_layers"]
    for name, tensor in float_tensors.items():
        if ".ffn.experts." in name:
            packed, scale = fp4_tensors[name], fp4_tensors[name.removesuffix("weight") + "scale"]
            assert packed.dtype == torch.int8 and packed.shape == (tensor.shape[0], tensor.shape[1] // 2)
            assert scale.dtype == torch.float8_e8m0fnu and scale.shape == (tensor.shape[0], tensor.shape[1] // 32)
        else:
            assert torch.equal(fp4_tensors[name], tensor), name

    loaded = transformers.DeepseekV4ForCausalLM.from_pretrained(tiny_v4_fp4).eval()
    reference = _tiny_deepseek_v4_model(TINY_DEEPSEEK_V4_CONFIG, seed, torch.float32)
    with torch.no_grad():
        for layer, (ours, theirs) in enumerate(zip(reference.model.layers, loaded.model.layers, strict=True)):

            def weight(expert: int, proj: str, layer: int = layer) -> torch.Tensor:
                name = f"model.layers.{layer}.ffn.experts.{expert}.{proj}."
                return dequantize_fp4(fp4_tensors[name + "weight"], fp4_tensors[name + "scale"])

            experts = ours.mlp.experts
            for expert in range(EXPERTS):
                experts.gate_up_proj[expert] = torch.cat([weight(expert, "w1"), weight(expert, "w3")])
                experts.down_proj[expert] = weight(expert, "w2")
            assert torch.equal(theirs.mlp.experts.gate_up_proj, experts.gate_up_proj)
            assert torch.equal(theirs.mlp.experts.down_proj, experts.down_proj)
    fp4_logits, dequantised = _logits(loaded, prompts), _logits(reference, prompts)
    assert torch.isfinite(fp4_logits).all()
    torch.testing.assert_close(fp4_logits, dequantised, rtol=0, atol=1e-5 * dequantised.abs().max().item())
    float_logits = _logits(transformers.DeepseekV4ForCausalLM.from_pretrained(tiny_v4).eval(), prompts)
    assert (fp4_logits - float_logits).abs().max() > 1e-3  # the experts did change

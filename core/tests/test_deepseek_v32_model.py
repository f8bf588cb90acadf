"""DeepSeek-V3.2 (``models/deepseek_v32.py``) against HF transformers' ``DeepseekV32ForCausalLM``.

Tiny random float32 checkpoints (``write_tiny_deepseek_v32``, ``index_topk`` 8), prompts of
20-40 tokens so the indexer drops most of them: logits over a paged cache with shuffled
block ids, with a concurrently decoding neighbour; then the whole engine, greedy, with
prefix caching, small prefill chunks and preemption under memory pressure.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers  # the oracle; the locked dev group pins 5.24, which has DeepSeek-V3.2
from click.testing import CliRunner

from powertrain import LLM, SamplingParams
from powertrain.assemble import build_engine, plan
from powertrain.builtin.grouped_moe import TorchGroupedMoE
from powertrain.builtin.models import deepseek_v32_requirements
from powertrain.builtin.reference_attention import TorchReferenceAttention
from powertrain.cli import main as cli_main
from powertrain.config import CacheConfig, EngineConfig, ModelConfig
from powertrain.interfaces import ModelContext
from powertrain.loader import load_checkpoint
from powertrain.models.deepseek_v32 import DeepseekV32ForCausalLM
from powertrain.testing.base import fresh_seed
from powertrain.testing.checkpoints import write_tiny_deepseek_v32
from powertrain.testing.oracle import hf_greedy, hf_logits, relative_error, startup_event
from powertrain.testing.paged import PagedRunner

#: Relative to the largest reference logit: float32 rounding through a few layers is ~1e-6.
RELATIVE_TOLERANCE = 1e-4
DECODE_STEPS = 32


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    value = fresh_seed()
    print(f"checkpoint seed={value}")
    return write_tiny_deepseek_v32(tmp_path_factory.mktemp("v32"), seed=value)


@pytest.fixture(scope="module")
def hf(path: Path) -> Any:
    model = transformers.DeepseekV32ForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    model.config._attn_implementation = "eager"
    return model.eval()


def load_ours(path: Path) -> DeepseekV32ForCausalLM:
    checkpoint = load_checkpoint(str(path))
    context = ModelContext(
        config=checkpoint.config,
        dtype=torch.float32,
        device=torch.device("cpu"),
        attention=TorchReferenceAttention(),
        moe=TorchGroupedMoE(),
    )
    model = DeepseekV32ForCausalLM(context)
    model.load_weights(checkpoint.tensors())
    return model


def context_with(path: Path, **changes: Any) -> ModelContext:
    checkpoint = load_checkpoint(str(path))
    return ModelContext(
        config={**checkpoint.config, **changes},
        dtype=torch.float32,
        device=torch.device("cpu"),
        attention=TorchReferenceAttention(),
        moe=TorchGroupedMoE(),
    )


def config_of(path: Path) -> dict[str, Any]:
    return json.loads((path / "config.json").read_text())


def random_tokens(path: Path, n: int) -> list[int]:
    return torch.randint(0, config_of(path)["vocab_size"], (n,)).tolist()


# --------------------------------------------------------------------------- model against HF


def test_prefill_logits_match_hf(path: Path, hf: Any, seed: int) -> None:
    ours = load_ours(path)
    prompts = [random_tokens(path, n) for n in (random.randint(20, 40), random.randint(9, 30))]
    runner = PagedRunner(ours, TorchReferenceAttention(), block_size=4, num_blocks=64)
    logits = runner.step([("a", prompts[0]), ("b", prompts[1])])
    for prompt, got in zip(prompts, logits, strict=True):
        error = relative_error(got, hf_logits(hf, prompt))
        print(f"prefill of {len(prompt)} tokens: max |diff| / max |logit| = {error:.2e}")
        assert error <= RELATIVE_TOLERANCE, f"prefill logits off by {error:.2e} (seed={seed})"


def test_indexer_keys_are_in_the_paged_cache(path: Path, seed: int) -> None:
    """The indexer writes its keys into the model-declared cache, at the tokens' slots."""
    ours = load_ours(path)
    runner = PagedRunner(ours, TorchReferenceAttention(), block_size=4, num_blocks=32)
    prompt = random_tokens(path, 13)
    runner.step([("a", prompt)])
    head_dim = config_of(path)["index_head_dim"]
    for cache in runner.caches:
        keys = cache["index_keys"]
        assert keys.shape == (32, 4, head_dim)
        blocks = runner.blocks["a"]
        rows = keys[blocks].reshape(-1, head_dim)
        assert torch.isfinite(rows[:13]).all() and torch.isnan(rows[13:]).all()


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no-prefix-cache", "prefix-cache"])
def test_prefill_and_decode_beside_a_neighbour_match_hf(path: Path, hf: Any, prefix_caching: bool, seed: int) -> None:
    ours = load_ours(path)
    prompt = random_tokens(path, random.randint(20, 40))
    neighbour = random_tokens(path, 11)
    runner = PagedRunner(ours, TorchReferenceAttention(), block_size=4, num_blocks=96)
    skip = 0
    if prefix_caching:
        runner.step([("earlier", prompt[:18] + neighbour)])
        skip = runner.share_prefix("s", "earlier", 18)
        assert skip == 16
    logits, generated = runner.greedy_beside_a_neighbour(
        prompt, neighbour, random_tokens(path, DECODE_STEPS - 1), skip=skip
    )
    reference = hf_logits(hf, prompt + generated[:-1])[skip:]
    error = relative_error(logits, reference)
    print(f"prefill {len(prompt)} + {DECODE_STEPS} decodes: max |diff| / max |logit| = {error:.2e}")
    assert error <= RELATIVE_TOLERANCE, f"logits off by {error:.2e} (seed={seed})"
    assert generated == hf_greedy(hf, prompt, DECODE_STEPS), f"greedy continuation differs (seed={seed})"


def test_hf_generate_agrees_with_its_own_step_by_step_forward(tmp_path: Path) -> None:
    """The step-by-step reference used above is what HF's cached ``generate`` produces too.

    This checks the oracle, not our code, on one fixed checkpoint and prompt: with fresh
    random ones, HF's cached and uncached forwards (different float summation orders)
    flipped a near-tied choice once in about a dozen runs, which says nothing about powertrain.
    """
    fixed = write_tiny_deepseek_v32(tmp_path, seed=20261201)
    model = transformers.DeepseekV32ForCausalLM.from_pretrained(str(fixed), dtype=torch.float32)
    model.config._attn_implementation = "eager"
    model.eval()
    prompt = torch.randint(
        0, config_of(fixed)["vocab_size"], (25,), generator=torch.Generator().manual_seed(7)
    ).tolist()
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, min_new_tokens=8)
    assert out[0, len(prompt) :].tolist() == hf_greedy(model, prompt, 8)


# --------------------------------------------------------------------------- the engine


def engine_greedy(path: Path, prompts: Sequence[Sequence[int]], **settings: Any) -> tuple[list[list[int]], Any]:
    params = SamplingParams(temperature=0, max_tokens=DECODE_STEPS, ignore_eos=True)
    with LLM(str(path), dtype="float32", **settings) as llm:
        outputs = llm.generate([list(p) for p in prompts], params)
        stats = llm.engine.scheduler
        return [list(o.outputs[0].token_ids) for o in outputs], (outputs, stats)


def test_engine_greedy_equals_hf_beside_a_neighbour(path: Path, hf: Any, seed: int) -> None:
    prompts = [random_tokens(path, random.randint(20, 40)), random_tokens(path, random.randint(9, 20))]
    got, _ = engine_greedy(path, prompts, block_size=8, num_blocks=64, prefix_caching=False)
    for prompt, tokens in zip(prompts, got, strict=True):
        assert tokens == hf_greedy(hf, prompt, DECODE_STEPS), f"seed={seed}"


def test_engine_prefix_cache_chunks_and_preemption_change_nothing(path: Path, seed: int) -> None:
    shared = random_tokens(path, 24)
    prompts = [shared + random_tokens(path, n) for n in (5, 9, 3, 12)]
    plain, _ = engine_greedy(path, prompts, block_size=4, num_blocks=96, prefix_caching=False, chunked_prefill=False)
    with LLM(str(path), dtype="float32", block_size=4, num_blocks=96, prefix_caching=True) as llm:
        params = SamplingParams(temperature=0, max_tokens=DECODE_STEPS, ignore_eos=True)
        first = llm.generate([prompts[0]], params)
        rest = llm.generate(prompts[1:], params)
    assert all(o.num_cached_tokens == 24 for o in rest), [o.num_cached_tokens for o in rest]
    assert [list(o.outputs[0].token_ids) for o in first + rest] == plain, f"prefix caching (seed={seed})"
    chunked, _ = engine_greedy(
        path, prompts, block_size=4, num_blocks=96, prefix_caching=False, max_num_batched_tokens=8
    )
    assert chunked == plain, f"chunked prefill of 8 tokens a step (seed={seed})"
    # 20 blocks of 4 tokens: one request (<= 68 tokens = 17 blocks) fits, four at once do not.
    tight, (_, scheduler) = engine_greedy(path, prompts, block_size=4, num_blocks=20, prefix_caching=False)
    assert scheduler.num_preemptions > 0
    assert tight == plain, f"under memory pressure (seed={seed})"


def test_engine_allocates_and_counts_the_index_keys(path: Path) -> None:
    config = config_of(path)
    layers, rank, rope, index = (
        config["num_hidden_layers"],
        config["kv_lora_rank"],
        config["qk_rope_head_dim"],
        config["index_head_dim"],
    )
    engine = build_engine(
        EngineConfig(model=ModelConfig(path=str(path), dtype="float32"), cache=CacheConfig(num_blocks=16))
    )
    try:
        caches = engine.runner.kv_caches
        block_size = engine.block_manager.block_size
        assert len(caches) == layers
        for cache in caches:
            assert set(cache) == {"latent", "rope", "index_keys"}
            assert cache["index_keys"].shape == (16, block_size, index)
        total = sum(t.nbytes for cache in caches for t in cache.values())
        assert total == (rank + rope + index) * layers * 4 * 16 * block_size
        assert type(engine.runner.model).__name__ == "DeepseekV32ForCausalLM"
    finally:
        engine.shutdown()


def test_startup_log_accounts_each_cache_group(path: Path) -> None:
    kv = startup_event(path, "kv cache")
    config = config_of(path)
    layers = config["num_hidden_layers"]
    groups = {g["name"]: g for g in kv["groups"]}
    assert set(groups) == {"attention", "indexer"}
    assert all(g["retention"] == "full" and g["tokens_per_entry"] == 1 for g in groups.values())
    assert groups["indexer"]["bytes_per_token"] == config["index_head_dim"] * layers * 4
    latent_and_rope = (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * layers * 4
    assert groups["attention"]["bytes_per_token"] == latent_and_rope
    assert kv["bytes_per_token"] == latent_and_rope + groups["indexer"]["bytes_per_token"]
    qk = config["qk_nope_head_dim"] + config["qk_rope_head_dim"]
    assert kv["dense_bytes_per_token"] == config["num_attention_heads"] * (qk + config["v_head_dim"]) * layers * 4
    assert list(kv["blocks"]) == ["full"] and kv["gib"] > 0


def test_auto_attention_is_a_sparse_mla_backend(path: Path) -> None:
    needs = deepseek_v32_requirements(config_of(path))
    assert needs["attention"] == {"mla", "sparse-mla", "paged", "prefill", "decode", "chunked-prefill"}
    assert "moe" in needs
    chosen = plan(EngineConfig(), requirements=needs, strict=False).resolutions["attention"]
    assert chosen.name == "torch-reference", chosen.error


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"scoring_func": "softmax"}, "scoring_func='softmax', but V3.2 routes with scoring_func='sigmoid'"),
        ({"topk_method": "greedy"}, "topk_method='greedy', but V3.2 routes with topk_method='noaux_tc'"),
        ({"q_lora_rank": None}, "needs q_lora_rank"),
        ({"mlp_layer_types": ["sparse", "dense", "sparse"]}, "mlp_layer_types=.* is not the first_k_dense_replace"),
    ],
)
def test_configs_it_does_not_follow_are_refused(path: Path, changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DeepseekV32ForCausalLM(context_with(path, **changes))


def test_a_cache_without_index_keys_is_refused(path: Path) -> None:
    ours = load_ours(path)
    runner = PagedRunner(ours, TorchReferenceAttention(), block_size=4, num_blocks=8)
    for cache in runner.caches:
        del cache["index_keys"]
    with pytest.raises(ValueError, match="lacks 'index_keys'.*AttentionLayerSpec.allocate_cache"):
        runner.step([("a", random_tokens(path, 5))])


def test_config_check_reports_the_indexer_group_and_the_dense_comparison(path: Path, tmp_path: Path) -> None:
    config = config_of(path)
    toml = tmp_path / "engine.toml"
    toml.write_text(f'[model]\npath = "{path}"\ndtype = "float32"\n[cache]\nnum_blocks = 32\n')
    result = CliRunner().invoke(cli_main, ["config", "check", str(toml), "--json"])
    assert result.exit_code == 0, result.output
    cache = json.loads(result.output)["kv_cache"]
    layers = config["num_hidden_layers"]
    groups = {g["name"]: g["bytes_per_token"] for g in cache["groups"]}
    assert groups == {
        "attention": (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * layers * 4,
        "indexer": config["index_head_dim"] * layers * 4,
    }
    assert cache["architecture"] == "deepseek-v32" and cache["blocks"] == {"full": 32}
    qk = config["qk_nope_head_dim"] + config["qk_rope_head_dim"]
    dense = config["num_attention_heads"] * (qk + config["v_head_dim"]) * layers * 4
    assert cache["dense_bytes_per_token"] == dense > cache["bytes_per_token"]  # what MLA saves


def test_indices_refused_on_the_device_fail_the_step_with_the_hosts_message(
    path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A backend that must not sync (a captured step) refuses on the device; the runner
    raises the refusal once the step has run. The reference stands in for such a
    backend (``refuse_sparse_indices`` in place of its host check, the one thing
    patched), and then the indexer picks one position past the end of each row's sequence."""
    real_forward, real_topk = TorchReferenceAttention.forward_mla_sparse, TorchReferenceAttention.index_topk
    past_the_end = False

    def refusing_on_the_device(self, layer, q_latent, q_rope, latent, k_rope, kv_cache, metadata, indices):  # noqa: ANN001, ANN202
        cleaned = metadata.refuse_sparse_indices(indices)
        return real_forward(self, layer, q_latent, q_rope, latent, k_rope, kv_cache, metadata, cleaned)

    def picks(self, query, weights, keys, metadata, **kwargs):  # noqa: ANN001, ANN202
        picked = real_topk(self, query, weights, keys, metadata, **kwargs)
        if past_the_end:
            picked[: metadata.num_tokens, 0] = metadata.seq_lens[metadata.token_sequences].to(torch.int32)
        return picked

    prompt = list(range(5, 25))
    expected = engine_greedy(path, [prompt])[0][0][:4]  # the reference as it is, checking on the host
    monkeypatch.setattr(TorchReferenceAttention, "forward_mla_sparse", refusing_on_the_device)
    monkeypatch.setattr(TorchReferenceAttention, "index_topk", picks)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with LLM(str(path), dtype="float32", prefix_caching=False) as llm:
        assert llm.generate([prompt], params)[0].outputs[0].token_ids == expected  # nothing refused
        past_the_end = True
        with pytest.raises(Exception, match=r"sparse index 20 at query row 0 \(column 0\) is out of range"):
            llm.generate([prompt], params)

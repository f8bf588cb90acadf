"""Sliding-window retention through the whole engine: a Mistral-style model (every layer
slides) and a model with one sliding and one full layer, against HF transformers.

The block manager frees what falls out of the window, so a long sequence holds a
bounded number of the sliding pool's blocks (asserted after every step), while the
outputs stay HF's, also with prefix caching and under memory pressure. Weights and
prompts come from fixed seeds: greedy continuations of random models can meet a near
tie, and a fixed draw that passes once passes always.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

from powertrain.assemble import build_engine
from powertrain.cli import main
from powertrain.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from powertrain.interfaces import SamplingParams
from powertrain.testing.checkpoints import TOKENIZER_VOCAB_SIZE, random_hf_model, save_with_tiny_tokenizer

WINDOW, BLOCK = 8, 4
STEPS = 40
COMMON = dict(
    vocab_size=TOKENIZER_VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    num_hidden_layers=2,
    initializer_range=0.1,
)
MODELS = {
    "mistral": (MistralForCausalLM, lambda: MistralConfig(**COMMON, sliding_window=WINDOW)),
    "one-sliding-one-full": (
        Qwen2ForCausalLM,
        lambda: Qwen2Config(
            **COMMON,
            use_sliding_window=True,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"],
        ),
    ),
}


@pytest.fixture(scope="module", params=list(MODELS))
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any, Path]:
    torch.manual_seed(11)
    model_class, config = MODELS[request.param]
    hf = random_hf_model(model_class, config())
    return request.param, hf, save_with_tiny_tokenizer(hf, tmp_path_factory.mktemp(request.param))


def prompts(count: int, length: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(2, TOKENIZER_VOCAB_SIZE, (length,), generator=generator).tolist() for _ in range(count)]


def hf_greedy(hf: Any, prompt: list[int]) -> list[int]:
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False)
    return out[0, len(prompt) :].tolist()


def run(path: Path, batch: list[list[int]], **cache: Any) -> tuple[list[list[int]], Any, list[dict]]:
    """Greedy outputs, the engine, and the blocks each running sequence held after each step."""
    engine = build_engine(
        EngineConfig(
            model=ModelConfig(path=str(path), dtype="float32"),
            cache=CacheConfig(block_size=BLOCK, **cache),
            scheduler=SchedulerConfig(max_num_batched_tokens=16),
        )
    )
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)
    held: list[dict] = []
    try:
        ids = [engine.add_request(prompt, params) for prompt in batch]
        finished: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    finished[output.request_id] = list(output.outputs[0].token_ids)
            for seq in engine.scheduler.running:
                held.append({"tokens": seq.num_computed_tokens, **engine.block_manager.blocks_held(seq)})
        return [finished[i] for i in ids], engine, held
    finally:
        engine.shutdown()


def test_outputs_equal_hf_while_window_blocks_are_freed(model: tuple[str, Any, Path]) -> None:
    name, hf, path = model
    batch = prompts(2, 30, seed=5)
    got, engine, held = run(path, batch, num_blocks=64, prefix_caching=False)
    assert got == [hf_greedy(hf, prompt) for prompt in batch], name
    pools = engine.block_manager.pools
    assert set(pools) == ({WINDOW} if name == "mistral" else {None, WINDOW})
    # A step's queries start at the sequence's computed tokens less what the step adds (a
    # chunk of at most 16 here); they read the WINDOW - 1 tokens before that.
    bound = math.ceil((WINDOW - 1) / BLOCK) + 1 + math.ceil(16 / BLOCK)
    assert held and max(h[WINDOW] for h in held) <= bound, held
    longest = max(h["tokens"] for h in held)
    assert longest >= 30 + STEPS - 1 and math.ceil(longest / BLOCK) > 2 * bound  # the bound is real
    if None in pools:  # the full layer keeps every block
        assert max(h[None] for h in held) == math.ceil(longest / BLOCK)


def test_prefix_hits_and_memory_pressure_change_nothing(model: tuple[str, Any, Path]) -> None:
    name, hf, path = model
    shared = prompts(1, 24, seed=8)[0]
    batch = [shared + tail for tail in prompts(3, 6, seed=9)]
    expected = [hf_greedy(hf, prompt) for prompt in batch]
    got, engine, _ = run(path, [batch[0]], num_blocks=64, prefix_caching=True)
    assert got == expected[:1], name
    # A fresh engine serves the first request, then the others hit its prefix: the sliding
    # pool only needs the window before the hit.
    engine = build_engine(
        EngineConfig(
            model=ModelConfig(path=str(path), dtype="float32"),
            cache=CacheConfig(block_size=BLOCK, num_blocks=64, prefix_caching=True),
        )
    )
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)
    try:
        outputs = []
        for prompt in batch:
            engine.add_request(prompt, params)
            while engine.has_unfinished_requests():
                outputs += [o for o in engine.step() if o.finished]
        assert [list(o.outputs[0].token_ids) for o in outputs] == expected, name
        assert [o.num_cached_tokens for o in outputs] == [0, 24, 24]
    finally:
        engine.shutdown()
    # Full history: 18 blocks of 4 tokens hold one sequence (<= 70 tokens), not three.
    # Sliding only: a sequence holds at most 6 blocks (a 16-token chunk and the 7 tokens
    # before it), so 7 blocks hold one, not three.
    tight, engine, _ = run(path, batch, num_blocks=7 if name == "mistral" else 18, prefix_caching=False)
    assert engine.scheduler.num_preemptions > 0
    assert tight == expected, name


def test_config_check_accounts_each_retention_class(model: tuple[str, Any, Path], tmp_path: Path) -> None:
    name, hf, path = model
    config = tmp_path / "engine.toml"
    config.write_text(
        f'[model]\npath = "{path}"\ndtype = "float32"\n[cache]\nblock_size = {BLOCK}\nmemory_gib = 0.01\n'
        "[scheduler]\nmax_num_seqs = 4\nmax_num_batched_tokens = 64\n"
    )
    result = CliRunner().invoke(main, ["config", "check", str(config), "--json"])
    assert result.exit_code == 0, result.output
    cache = json.loads(result.output)["kv_cache"]
    per_layer = 2 * COMMON["num_key_value_heads"] * COMMON["head_dim"] * 4  # key + value, float32
    groups = {(g["name"], g["retention"]): g for g in cache["groups"]}
    if name == "mistral":
        assert groups == {
            ("attention", "sliding 8"): {
                "name": "attention",
                "retention": "sliding 8",
                "tokens_per_entry": 1,
                "layers": 2,
                "bytes_per_token": 2 * per_layer,
            }
        }
        assert list(cache["blocks"]) == ["sliding 8"]
    else:
        assert {k: g["layers"] for k, g in groups.items()} == {("attention", "sliding 8"): 1, ("attention", "full"): 1}
        # The sliding pool holds what 4 sequences' windows and one step's 64 tokens need.
        bound = 4 * (math.ceil((WINDOW - 1) / BLOCK) + 2) + 64 // BLOCK
        assert cache["blocks"]["sliding 8"] == bound
        budget = int(0.01 * 2**30)
        assert cache["blocks"]["full"] == (budget - (bound + 1) * per_layer * BLOCK) // (per_layer * BLOCK)
    assert cache["bytes_per_token"] == cache["dense_bytes_per_token"] == 2 * per_layer
    text = CliRunner().invoke(main, ["config", "check", str(config)])
    assert "bytes/token in all" in text.output and "sliding 8" in text.output

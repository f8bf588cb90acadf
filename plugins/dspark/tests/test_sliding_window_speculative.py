"""Speculative decoding over a sliding-window cache: rejected drafts roll back and the
window's blocks are given back, without either disturbing the other.

A tiny random Mistral model (every layer slides over 8 tokens, blocks of 4): the
block manager releases blocks behind each sequence's window as it decodes, while
drafts grow a scheduled step without releasing what its first query still reads, and
rejections rewind the sequence. Greedy outputs must be exactly plain decoding's, with
drafts both accepted and rejected, also when the cache is so small that sequences are
preempted. Random weights make a model that soon repeats itself, which the n-gram
drafter then proposes; the weights come from a fixed seed so the counts are stable.
"""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM

from powertrain import LLM, SamplingParams
from powertrain.config import EngineConfig
from powertrain.llm import apply_overrides
from powertrain.testing.checkpoints import TOKENIZER_VOCAB_SIZE, random_hf_model, save_with_tiny_tokenizer

WINDOW, BLOCK = 8, 4


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(3)
    config = MistralConfig(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        num_hidden_layers=2,
        sliding_window=WINDOW,
    )
    return save_with_tiny_tokenizer(random_hf_model(MistralForCausalLM, config), tmp_path_factory.mktemp("mistral"))


def generate(path: Path, speculative: str, num_blocks: int) -> tuple[list[list[int]], object]:
    settings = {"path": str(path), "dtype": "float32", "speculative": speculative}
    config = apply_overrides(EngineConfig(), {**settings, "block_size": BLOCK, "num_blocks": num_blocks})
    if speculative != "none":
        config = attrs.evolve(config, sections={"dspark": {"max_draft_tokens": 3, "profile_sequences": [1, 4]}})
    generator = torch.Generator().manual_seed(4)
    prompts = [torch.randint(2, TOKENIZER_VOCAB_SIZE, (n,), generator=generator).tolist() for n in (5, 21, 13)]
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    with LLM(config=config) as llm:
        outputs = llm.generate(prompts, params)
        return [list(o.outputs[0].token_ids) for o in outputs], llm.engine.stats()


@pytest.mark.parametrize("num_blocks", [64, 9], ids=["roomy", "preempting"])
def test_drafts_over_a_sliding_window_equal_plain_decoding(mistral: Path, num_blocks: int) -> None:
    plain, _ = generate(mistral, "none", 64)
    speculated, stats = generate(mistral, "fixed-k", num_blocks)
    assert speculated == plain
    assert stats.speculative_accepted_tokens > 0, stats
    assert stats.speculative_verified_tokens > stats.speculative_accepted_tokens, stats  # some were rejected
    if num_blocks == 9:
        assert stats.preemptions > 0, stats

"""Speculative decoding over a sliding-window cache: rejected drafts roll back and the
window's blocks are given back, without either disturbing the other.

A tiny random Mistral model (every layer slides over 8 tokens, blocks of 4): the
block manager releases blocks behind each sequence's window as it decodes, while
drafts grow a scheduled step without releasing what its first query still reads, and
rejections rewind the sequence. Greedy outputs must be plain decoding's, with drafts both
accepted and rejected, also when the cache is so small that sequences are preempted.
The drafts are plain decoding's own tokens with one made wrong in every other proposal
(``ScriptedDrafter``), so both happen by construction, whatever the checkpoint's seed; a
departure from plain decoding passes only at a greedy tie of the transformers oracle.
"""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM

import powertrain_dspark.plugin
from powertrain import LLM, SamplingParams
from powertrain.config import EngineConfig
from powertrain.llm import apply_overrides
from powertrain.testing.base import fresh_seed
from powertrain.testing.checkpoints import TOKENIZER_VOCAB_SIZE, random_hf_model, save_with_tiny_tokenizer
from powertrain.testing.oracle import assert_same_greedy
from powertrain_dspark.scripted import scripted

WINDOW, BLOCK = 8, 4
#: Greedy picks closer than this (relative to the largest logit) may go either way between
#: a decode step and a verification step: their float32 sums over 64-wide rows differ in
#: order, a few ulps (~1e-6 relative) per layer; a wrong rollback moves logits by O(1).
TIE = 1e-4


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, MistralForCausalLM]:
    torch.manual_seed(fresh_seed())
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
    hf = random_hf_model(MistralForCausalLM, config)
    return save_with_tiny_tokenizer(hf, tmp_path_factory.mktemp("mistral")), hf


def generate(path: Path, prompts: list[list[int]], speculative: str, num_blocks: int) -> tuple[list[list[int]], object]:
    settings = {"path": str(path), "dtype": "float32", "speculative": speculative}
    config = apply_overrides(EngineConfig(), {**settings, "block_size": BLOCK, "num_blocks": num_blocks})
    if speculative != "none":
        config = attrs.evolve(config, sections={"dspark": {"max_draft_tokens": 3, "profile_sequences": [1, 4]}})
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    with LLM(config=config) as llm:
        outputs = llm.generate(prompts, params)
        return [list(o.outputs[0].token_ids) for o in outputs], llm.engine.stats()


@pytest.mark.parametrize("num_blocks", [64, 9], ids=["roomy", "preempting"])
def test_drafts_over_a_sliding_window_equal_plain_decoding(
    mistral: tuple[Path, MistralForCausalLM], num_blocks: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, hf = mistral
    generator = torch.Generator().manual_seed(fresh_seed())
    prompts = [torch.randint(2, TOKENIZER_VOCAB_SIZE, (n,), generator=generator).tolist() for n in (5, 21, 13)]
    plain, _ = generate(path, prompts, "none", 64)
    drafter = scripted({tuple(p): tokens for p, tokens in zip(prompts, plain, strict=True)})
    monkeypatch.setattr(powertrain_dspark.plugin, "make_drafter", drafter)
    speculated, stats = generate(path, prompts, "fixed-k", num_blocks)
    assert_same_greedy(speculated, plain, prompts, hf, TIE, "speculated tokens")
    assert drafter.built.wrong > 0, stats
    assert 0 < stats.speculative_accepted_tokens < stats.speculative_verified_tokens, stats
    if num_blocks == 9:
        assert stats.preemptions > 0, stats

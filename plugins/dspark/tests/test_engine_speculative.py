"""Speculative decoding in the real engine on SmolLM2 with the n-gram drafter.

Greedy outputs must be token-for-token what plain decoding gives, whatever the length
rule, with stop strings, max_tokens cut-offs, several sequences per request, requests
that cannot speculate (logprobs, penalties) in the same batch, and a cache so small
that sequences are preempted mid-speculation. The drafts must actually be verified
and accepted (the prompts quote text the model then repeats), or the comparison
would prove nothing.
"""

from __future__ import annotations

import attrs
import pytest

from powertrain import LLM, SamplingParams
from powertrain.config import EngineConfig
from powertrain.llm import apply_overrides

QUOTE = (
    "The river flows past the old mill, turns north at the stone bridge, "
    "and reaches the sea after seven miles of farmland."
)
PROMPTS = [
    f"Repeat this sentence exactly: {QUOTE}\nRepeated: {QUOTE[:40]}",
    "Count from one to twenty in words: one, two, three, four,",
    f"Text: {QUOTE}\nQuote the text word for word:",
    "The capital of France is",
]
REQUESTS = [
    (PROMPTS[0], SamplingParams(temperature=0, max_tokens=40)),
    (PROMPTS[1], SamplingParams(temperature=0, max_tokens=33, stop=["eleven"])),
    (PROMPTS[2], SamplingParams(temperature=0, max_tokens=3)),
    (PROMPTS[2], SamplingParams(temperature=0, max_tokens=36, n=2)),
    (PROMPTS[3], SamplingParams(temperature=0, max_tokens=12, logprobs=2)),
    (PROMPTS[0], SamplingParams(temperature=0, max_tokens=20, repetition_penalty=1.3)),
    (PROMPTS[1], SamplingParams(temperature=0, max_tokens=1)),
]
PROFILE = [1, 8]  # a short startup profile (sequence counts) keeps the tests quick


def engine_config(speculative: str, **dspark) -> EngineConfig:
    # Dense float32 weights: kept quantised, a step of more than 16 tokens (a batch of
    # verifications) dequantises every weight per call, and DSpark's cost profile may then
    # rightly verify nothing, which would leave these checks proving nothing.
    overrides = {"speculative": speculative, "dtype": "float32", "quantization": "dequantize"}
    config = apply_overrides(EngineConfig(), overrides)
    if speculative != "none":
        config = attrs.evolve(config, sections={"dspark": {"profile_sequences": PROFILE, **dspark}})
    return config


def generate(config: EngineConfig) -> tuple[list, object]:
    with LLM(config=config) as llm:
        outputs = llm.generate([p for p, _ in REQUESTS], [s for _, s in REQUESTS])
        return outputs, llm.engine.stats()


def summary(outputs: list) -> list:
    return [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in outputs]


@pytest.fixture(scope="module")
def plain() -> list:
    outputs, stats = generate(engine_config("none"))
    assert stats.speculative_request_steps == 0
    return summary(outputs)


@pytest.mark.parametrize(
    ("speculative", "dspark"),
    [
        ("dspark", {}),
        ("dspark", {"lagged_budget": True}),
        ("fixed-k", {"max_draft_tokens": 2}),
        ("fixed-k", {"max_draft_tokens": 5}),
    ],
    ids=["dspark", "dspark-lagged", "fixed-2", "fixed-5"],
)
@pytest.mark.usefixtures("steady_step_time")  # DSpark verifies the same drafts under any load
def test_greedy_outputs_equal_plain_decoding(plain: list, speculative: str, dspark: dict) -> None:
    outputs, stats = generate(engine_config(speculative, **dspark))
    assert summary(outputs) == plain
    assert stats.speculative_verified_tokens > 0
    assert stats.speculative_accepted_tokens > 0
    assert stats.speculative_accepted_tokens <= stats.speculative_verified_tokens


def test_greedy_outputs_survive_preemption(plain: list) -> None:
    config = attrs.evolve(
        engine_config("fixed-k", max_draft_tokens=4), cache=attrs.evolve(EngineConfig().cache, num_blocks=14)
    )
    with LLM(config=config) as llm:
        outputs = llm.generate([p for p, _ in REQUESTS], [s for _, s in REQUESTS])
        stats = llm.engine.stats()
    assert stats.preemptions > 0, "the cache was meant to be too small for every request at once"
    assert summary(outputs) == plain


@pytest.mark.usefixtures("steady_step_time")
def test_seeded_sampling_gives_the_tokens_plain_decoding_gives() -> None:
    """The n-gram drafter's drafts are point masses, and verification draws each token
    with the sampler's own noise from the request's generator: a seeded request gets
    the same tokens with or without speculation, whatever the length rule chose."""
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=30, seed=7)
    results = {}
    for speculative in ("none", "dspark", "fixed-k"):
        with LLM(config=engine_config(speculative)) as llm:
            results[speculative] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
            if speculative != "none":
                assert llm.engine.stats().speculative_accepted_tokens > 0
    assert results["dspark"] == results["none"]
    assert results["fixed-k"] == results["none"]


@pytest.mark.usefixtures("steady_step_time")
def test_overlapped_steps_give_the_tokens_of_synchronous_ones() -> None:
    """With async scheduling the engine thread schedules step N+1 while N runs, and the
    device thread drafts for N+1 once N has run (interfaces/speculative.py). Greedy and
    seeded requests (n-gram drafts are point masses) get the tokens synchronous
    speculative steps give them, with DSpark's lagged budget choosing the lengths."""
    seeded = [
        (prompt, SamplingParams(temperature=0.8, top_p=0.95, max_tokens=30, seed=11 + i))
        for i, prompt in enumerate(PROMPTS)
    ]
    batch = REQUESTS + seeded
    results = {}
    for overlapped in (False, True):
        config = apply_overrides(
            engine_config("dspark", lagged_budget=True), {"speculative_overlap": "on" if overlapped else "off"}
        )
        with LLM(config=config) as llm:
            outputs = llm.generate([p for p, _ in batch], [s for _, s in batch])
            runner = llm.engine.runner
            results[overlapped] = (summary(outputs), llm.engine.stats(), runner.overlapped_steps)
            left_out = runner.ended_rows_left_out  # sequences the step before ended
    (synchronous, _, no_overlaps), (overlapped_outputs, stats, overlaps) = results[False], results[True]
    assert overlapped_outputs == synchronous
    assert no_overlaps == 0 and overlaps > 0
    assert left_out > 0
    assert stats.speculative_accepted_tokens > 0

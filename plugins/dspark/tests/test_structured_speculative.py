"""Speculation under constraints, in the real engine on SmolLM2 with the n-gram drafter.

A constrained request (JSON schema, regex, Lark grammar) speculates like any other: its
drafts are checked against its grammar before the step, the verified rows' logits are
masked as the sampler masks them, and the kept tokens are the ones constrained decoding
without speculation gives: greedy, and seeded sampling (the n-gram drafts are point
masses, drawn with the sampler's own noise). The prompts show the answer, so the
n-gram drafter finds drafts the grammar allows and the target accepts; one test also
plants a token no grammar allows among the drafts and checks it is never verified.
"""

from __future__ import annotations

import json
import re

import attrs
import pytest

from powertrain import LLM, SamplingParams
from powertrain.config import EngineConfig
from powertrain.interfaces.sampling import StructuredOutput
from powertrain.llm import apply_overrides
from powertrain.testing.schemas import JSON_SCHEMAS

PROFILE = [1, 8]  # a short startup profile (sequence counts) keeps the tests quick
PERSON = '{"name": "Ada Lovelace", "age": 36}'
ARRAY = '{"items": [{"id": 1, "ok": true}, {"id": 2, "ok": false}]}'
DATE = '{"date": "1843-07-10"}'
LARK = r"""
start: greeting " " NAME "!"
greeting: "Hello" | "Hi" | "Goodbye"
NAME: /[A-Z][a-z]{1,10}/
"""
#: (what the prompt shows, the constraint); the answer the prompt shows fits the constraint.
CONSTRAINED = [
    (PERSON, StructuredOutput.json_schema(JSON_SCHEMAS["flat person"])),
    (ARRAY, StructuredOutput.json_schema(JSON_SCHEMAS["array of objects"])),
    (DATE, StructuredOutput.json_schema(JSON_SCHEMAS["date pattern"])),
    ("yes, because the sky scatters blue light.", StructuredOutput.regex(r"(yes|no), because [a-z ]{1,40}\.")),
    ("Hello Alice!", StructuredOutput.lark(LARK)),
]


def engine_config(speculative: str, **dspark: object) -> EngineConfig:
    # Dense float32 weights, as in test_engine_speculative: verification batches then cost
    # what a decode step does, and DSpark verifies drafts.
    overrides = {"speculative": speculative, "dtype": "float32", "quantization": "dequantize"}
    config = apply_overrides(EngineConfig(), overrides)
    if speculative != "none":
        config = attrs.evolve(config, sections={"dspark": {"profile_sequences": PROFILE, **dspark}})
    return config


def requests(llm: LLM) -> tuple[list[str], list[SamplingParams]]:
    """Each constraint greedy and seeded-sampled, with one unconstrained request beside them."""
    chat = llm.tokenizer.apply_chat_template
    prompts, params = [], []
    for i, (answer, constraint) in enumerate(CONSTRAINED):
        prompt = chat([{"role": "user", "content": f"Reply with exactly this, twice: {answer}"}])
        prompt += answer  # the answer once more right before the reply: the n-gram drafter's source
        for sampling in (
            SamplingParams(temperature=0, max_tokens=32, structured=constraint),
            SamplingParams(temperature=0.8, top_p=0.95, seed=100 + i, max_tokens=32, structured=constraint),
        ):
            prompts.append(prompt)
            params.append(sampling)
    prompts.append(chat([{"role": "user", "content": f"Repeat: {PERSON} {PERSON}"}]))
    params.append(SamplingParams(temperature=0, max_tokens=24))
    return prompts, params


def generate(config: EngineConfig, spy: object = None) -> tuple[list[tuple], object]:
    """(tokens, text, finish reason) per request, and the engine's counts."""
    with LLM(config=config) as llm:
        if spy is not None:
            spy(llm)  # type: ignore[operator]
        prompts, params = requests(llm)
        outputs = [o.outputs[0] for o in llm.generate(prompts, params)]
        return [(list(o.token_ids), o.text, o.finish_reason) for o in outputs], llm.engine.stats()


@pytest.fixture(scope="module")
def plain() -> list[tuple]:
    outputs, stats = generate(engine_config("none"))
    assert stats.speculative_request_steps == 0
    return outputs


def test_the_plain_outputs_follow_their_constraints(plain: list[tuple]) -> None:
    """The baseline itself is constrained (else the equalities below would prove less)."""
    for i, (_, constraint) in enumerate(CONSTRAINED):
        for _, text, reason in plain[2 * i : 2 * i + 2]:
            if reason != "stop":  # cut at max_tokens: a prefix of a valid answer
                assert reason == "length" and text.startswith("{"), (text, reason)
            elif constraint.kind == "regex":
                assert re.fullmatch(constraint.spec, text), text
            elif constraint.kind == "lark":
                assert re.fullmatch(r"(Hello|Hi|Goodbye) [A-Z][a-z]{1,10}!", text), text
            else:
                assert isinstance(json.loads(text), dict), text


@pytest.mark.usefixtures("steady_step_time")  # DSpark verifies the same drafts under any load
def test_constrained_speculation_gives_the_tokens_constrained_decoding_gives(plain: list[tuple]) -> None:
    """DSpark's lengths; fixed-k's are the next test's (with a planted forbidden draft)."""
    outputs, stats = generate(engine_config("dspark"))
    assert outputs == plain
    assert stats.speculative_verified_tokens > 0
    assert stats.speculative_accepted_tokens > 0


#: ``<|im_start|>``: a special token, which no grammar here allows.
FORBIDDEN = 1


def test_a_draft_the_grammar_forbids_is_never_verified(plain: list[tuple]) -> None:
    """The drafter's second draft is replaced by a token no grammar allows. fixed-k would
    verify it; the engine cuts each constrained slot's drafts before it."""
    planted, verified_forbidden, verified = [0], [0], [0]

    def spy(llm: LLM) -> None:
        policy = llm.speculative_policy
        propose, verify = policy.drafter.propose, policy.verify  # type: ignore[union-attr]

        def planting(slots: list) -> object:
            drafted = propose(slots)
            for drafts in drafted.tokens:
                if len(drafts) >= 2:
                    drafts[1] = FORBIDDEN
                    planted[0] += 1
            return drafted

        def checking(proposal: object, lengths: list[int], logits: list) -> list[list[int]]:
            for slot, drafts, length in zip(proposal.slots, proposal.tokens, lengths, strict=True):  # type: ignore[attr-defined]
                if slot.params.structured is not None and length:
                    verified[0] += length
                    verified_forbidden[0] += FORBIDDEN in drafts[:length]
            return verify(proposal, lengths, logits)

        policy.drafter.propose = planting  # type: ignore[union-attr]
        policy.verify = checking  # type: ignore[union-attr]

    outputs, stats = generate(engine_config("fixed-k", max_draft_tokens=4), spy)
    assert planted[0] > 0 and verified[0] > 0
    assert verified_forbidden[0] == 0
    assert outputs == plain
    assert stats.speculative_accepted_tokens > 0

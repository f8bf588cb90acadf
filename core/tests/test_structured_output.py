"""Structured output on the embedded SmolLM2-135M-Instruct: JSON schemas, JSON objects, regexes
and Lark grammars through llguidance, checked by independent oracles (``json`` + ``jsonschema``,
Python's ``re``), in batches with unconstrained requests, across abort, n=2 and preemption."""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest
import torch

from powertrain import LLM, SamplingParams
from powertrain.engine.structured import TokenMasks
from powertrain.interfaces.errors import InvalidRequestError
from powertrain.interfaces.sampling import StructuredOutput
from powertrain.testing.schemas import JSON_SCHEMAS


@pytest.fixture(scope="module")
def llm() -> LLM:
    with LLM(dtype="float32") as engine:
        yield engine


#: Short on purpose: the constraint, not the prompt, makes the output valid, and prefill stays cheap.
PROMPT = [{"role": "user", "content": "Reply in JSON."}]


def _prompt(llm: LLM) -> str:
    return llm.tokenizer.apply_chat_template(PROMPT)


def _validate(text: str, schema: dict, label: str) -> None:
    try:
        value = json.loads(text)
    except ValueError as error:
        raise AssertionError(f"{label}: not JSON ({error}): {text!r}") from None
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError as error:
        raise AssertionError(f"{label}: {error.message}: {text!r}") from None


def test_json_schemas_greedy_and_sampled_validate(llm: LLM) -> None:
    assert len(JSON_SCHEMAS) >= 20
    prompts, params, labels = [], [], []
    for i, (name, schema) in enumerate(JSON_SCHEMAS.items()):
        constraint = StructuredOutput.json_schema(schema)
        for label, p in (
            ("greedy", SamplingParams(temperature=0, max_tokens=64, structured=constraint)),
            (
                "sampled",
                SamplingParams(temperature=0.8, top_p=0.95, seed=1000 + i, max_tokens=64, structured=constraint),
            ),
        ):
            prompts.append(_prompt(llm))
            params.append(p)
            labels.append((name, label, schema))
    outputs = llm.generate(prompts, params)
    for (name, label, schema), output in zip(labels, outputs, strict=True):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", f"{name} ({label}) ran out of tokens: {completion.text!r}"
        _validate(completion.text, schema, f"{name} ({label})")


def test_json_object_regex_and_lark(llm: LLM) -> None:
    lark = r"""
start: greeting " " NAME "!"
greeting: "Hello" | "Hi" | "Goodbye"
NAME: /[A-Z][a-z]{1,10}/
"""
    # %json embeds a schema in a grammar, as a tool call wrapped in tags would need.
    tool_call = r"""
start: "<call>" %json {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
    "additionalProperties": false, "x-guidance": {"whitespace_flexible": false}
} "</call>"
"""
    regex = r"(yes|no), because [a-z ]{1,30}\."
    chat = llm.tokenizer.apply_chat_template
    requests = [
        (
            chat([{"role": "user", "content": 'Reply with exactly this JSON: {"ok": true}'}]),
            StructuredOutput.json_object(),
        ),
        (chat([{"role": "user", "content": "Is the sky blue? Answer and say why."}]), StructuredOutput.regex(regex)),
        (chat([{"role": "user", "content": "Greet Alice."}]), StructuredOutput.lark(lark)),
        (chat([{"role": "user", "content": "Call the weather tool for Paris."}]), StructuredOutput.lark(tool_call)),
    ]
    outputs = llm.generate(
        [prompt for prompt, _ in requests],
        [SamplingParams(temperature=0.7, seed=5, max_tokens=64, structured=c) for _, c in requests],
    )
    texts = [o.outputs[0].text for o in outputs]
    assert all(o.outputs[0].finish_reason == "stop" for o in outputs), texts
    assert isinstance(json.loads(texts[0]), dict), texts[0]
    assert re.fullmatch(regex, texts[1]), texts[1]
    assert re.fullmatch(r"(Hello|Hi|Goodbye) [A-Z][a-z]{1,10}!", texts[2]), texts[2]
    match = re.fullmatch(r"<call>(.*)</call>", texts[3])
    assert match, texts[3]
    assert isinstance(json.loads(match.group(1))["city"], str)


@pytest.mark.parametrize(
    ("constraint", "reason"),
    [
        (StructuredOutput.json_schema({"type": "strin"}), "Invalid type: strin"),
        (StructuredOutput.json_schema({"type": "integer", "minimum": 5, "maximum": 1}), "minimum .5. is greater"),
        (StructuredOutput.json_schema({"properties": {"a": {"$ref": "#/$defs/missing"}}}), "does not exist"),
        (StructuredOutput.json_schema({"type": "string", "format": "no-such-format"}), "Unknown format"),
        (StructuredOutput.json_schema({"type": "array", "uniqueItems": True}), "Unimplemented keys"),
        (StructuredOutput.regex("(unclosed"), "unclosed group"),
        (StructuredOutput.lark("start: undefined_rule"), "unknown name"),
    ],
)
def test_a_constraint_that_does_not_compile_is_refused_saying_why(
    llm: LLM, constraint: StructuredOutput, reason: str
) -> None:
    engine = llm.engine
    # A request already running is not disturbed by a refused one.
    running = engine.add_request("The capital of France is", SamplingParams(temperature=0, max_tokens=6))
    engine.step()
    with pytest.raises(InvalidRequestError, match=f"(?s)cannot be compiled: .*{reason}"):
        engine.add_request("Hello", SamplingParams(structured=constraint))
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            finished[output.request_id] = output
    assert len(finished[running].outputs[0].token_ids) == 6
    assert set(finished) == {running}


def test_invalid_constraints_are_refused_on_construction() -> None:
    with pytest.raises(InvalidRequestError, match="kind must be one of"):
        StructuredOutput("xml", "<a/>")
    with pytest.raises(InvalidRequestError, match="schema as a JSON object"):
        StructuredOutput.json_schema(["not", "a", "schema"])
    with pytest.raises(InvalidRequestError, match="not valid JSON"):
        StructuredOutput.json_schema("{nope")
    with pytest.raises(InvalidRequestError, match="non-empty string"):
        StructuredOutput.regex("")
    with pytest.raises(InvalidRequestError, match="takes no spec"):
        StructuredOutput("json_object", {"type": "object"})
    with pytest.raises(InvalidRequestError, match="structured must be a StructuredOutput"):
        SamplingParams(structured={"type": "object"})
    with pytest.raises(InvalidRequestError, match="min_tokens cannot be combined"):
        SamplingParams(min_tokens=2, structured=StructuredOutput.json_object())
    schema = {"type": "object"}
    constraint = StructuredOutput.json_schema(schema)
    schema["type"] = "array"  # the constraint holds its own copy
    assert constraint.spec == {"type": "object"}
    assert constraint == StructuredOutput.json_schema('{"type": "object"}')


def test_unconstrained_requests_are_unchanged_by_constrained_ones_in_the_batch(llm: LLM) -> None:
    plain_prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,"]
    plain_params = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=11, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.9, top_k=20, seed=12, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=1.2),
    ]
    alone = [
        llm.generate([p], params)[0].outputs[0].token_ids for p, params in zip(plain_prompts, plain_params, strict=True)
    ]
    schema = JSON_SCHEMAS["flat person"]
    constrained = [
        SamplingParams(temperature=0, max_tokens=40, structured=StructuredOutput.json_schema(schema)),
        SamplingParams(temperature=1.0, seed=3, max_tokens=40, structured=StructuredOutput.json_schema(schema)),
    ]
    prompts = [plain_prompts[0], _prompt(llm), *plain_prompts[1:3], _prompt(llm), plain_prompts[3]]
    params = [plain_params[0], constrained[0], *plain_params[1:3], constrained[1], plain_params[3]]
    outputs = llm.generate(prompts, params)
    together = [outputs[i].outputs[0].token_ids for i in (0, 2, 3, 5)]
    assert together == alone
    for i in (1, 4):
        _validate(outputs[i].outputs[0].text, schema, f"constrained request {i}")


def test_n_2_each_sequence_has_its_own_matcher(llm: LLM) -> None:
    schema = JSON_SCHEMAS["array of objects"]
    params = SamplingParams(
        n=2, temperature=1.0, seed=21, max_tokens=64, structured=StructuredOutput.json_schema(schema)
    )
    engine = llm.engine
    request_id = engine.add_request(_prompt(llm), params)
    sequences = engine._requests[request_id].sequences
    assert sequences[0].grammar is not None and sequences[1].grammar is not None
    assert sequences[0].grammar.matcher is not sequences[1].grammar.matcher
    final = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            final = output if output.finished else final
    assert final is not None and len(final.outputs) == 2
    for completion in final.outputs:
        assert completion.finish_reason == "stop", completion.text
        _validate(completion.text, schema, f"n=2, sequence {completion.index}")
    assert all(seq.grammar is None for seq in sequences)


def test_abort_drops_the_matcher_and_the_engine_keeps_serving(llm: LLM) -> None:
    engine = llm.engine
    free_before = engine.block_manager.num_free_blocks
    schema = {"type": "object", "properties": {"story": {"type": "string"}}, "required": ["story"]}
    request_id = engine.add_request(
        _prompt(llm), SamplingParams(max_tokens=200, structured=StructuredOutput.json_schema(schema))
    )
    [sequence] = engine._requests[request_id].sequences
    for _ in range(4):
        engine.step()
    final = engine.abort_request(request_id)
    assert final.finished and final.outputs[0].finish_reason == "abort"
    assert sequence.grammar is None
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.block_manager.num_free_blocks == free_before
    schema = JSON_SCHEMAS["string enum"]
    [output] = llm.generate(
        _prompt(llm),
        SamplingParams(temperature=0, max_tokens=20, structured=StructuredOutput.json_schema(schema)),
    )
    _validate(output.outputs[0].text, schema, "after an abort")


def test_the_constraint_ends_the_output_even_with_ignore_eos(llm: LLM) -> None:
    constraint = StructuredOutput.regex(r"[0-9]{2}")
    [output] = llm.generate(
        "Pick a number:", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, structured=constraint)
    )
    assert output.outputs[0].finish_reason == "stop"
    assert re.fullmatch("[0-9]{2}", output.outputs[0].text)


def test_sync_scheduling_and_preemption_give_the_same_tokens(llm: LLM) -> None:
    names = ["flat person", "nested object with pattern", "array of objects", "$defs and $ref"]
    prompts = [_prompt(llm)] * len(names)
    params = [
        SamplingParams(
            temperature=0.8, seed=40 + i, max_tokens=64, structured=StructuredOutput.json_schema(JSON_SCHEMAS[name])
        )
        for i, name in enumerate(names)
    ]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    engine = llm.engine
    engine.async_scheduling = False
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    finally:
        engine.async_scheduling = True
    # Too few cache blocks for all four at once: sequences are preempted and recomputed.
    with LLM(dtype="float32", num_blocks=14, prefix_caching=False) as tight:
        outputs = tight.generate(prompts, params)
        assert tight.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outputs] == expected
    for name, output in zip(names, outputs, strict=True):
        _validate(output.outputs[0].text, JSON_SCHEMAS[name], name)


def test_token_masks_set_disallowed_logits_to_minus_infinity() -> None:
    vocab = 70  # the masks cover 64 ids: ids past them (padded embedding rows) are disallowed too
    allowed = {0: [0, 31, 32, 63], 2: [5]}
    disallowed = torch.ones((3, 64), dtype=torch.bool)
    for row, ids in allowed.items():
        disallowed[row, ids] = False
    disallowed[1] = False  # row 1 may sample anything the masks cover
    for rows in ([0, 2], [0, 1, 2]):  # some rows constrained; all of them (the in-place path)
        logits = torch.randn(3, vocab)
        before = logits.clone()
        TokenMasks(rows=rows, disallowed=disallowed[rows]).apply(logits)
        for row, ids in allowed.items():
            assert torch.isfinite(logits[row]).nonzero().flatten().tolist() == ids
            assert torch.equal(logits[row, ids], before[row, ids])
        if rows == [0, 2]:
            assert torch.equal(logits[1], before[1])
        else:
            assert torch.equal(logits[1, :64], before[1, :64]) and torch.isinf(logits[1, 64:]).all()


def test_masks_are_computed_on_the_grammar_worker(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    structured = llm.engine.runner.structured
    threads: list[str] = []
    fill = type(structured)._fill

    def recording_fill(self, states, tokens, drafts):  # type: ignore[no-untyped-def]
        threads.append(threading.current_thread().name)
        fill(self, states, tokens, drafts)

    monkeypatch.setattr(type(structured), "_fill", recording_fill)
    schema = JSON_SCHEMAS["flat person"]
    [output] = llm.generate(
        _prompt(llm), SamplingParams(temperature=0, max_tokens=40, structured=StructuredOutput.json_schema(schema))
    )
    _validate(output.outputs[0].text, schema, "flat person")
    structured._worker.submit(lambda: None).result()  # the last job may still be queued
    # One job for the first mask, then one per sampled token, plus the moot token that the step
    # already in flight when EOS arrived samples (async scheduling).
    assert len(threads) == 2 + len(output.outputs[0].token_ids)
    assert all(name.startswith("powertrain-grammar") for name in threads), threads

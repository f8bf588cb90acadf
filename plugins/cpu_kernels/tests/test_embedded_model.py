"""The embedded SmolLM2-135M-Instruct (a Q4_1 GGUF) with its weights kept quantised,
through the native kernels, against the same model dequantised at load.

Both are real engines on the real file: ``quantization = "keep"`` (auto-selected
``cpu-native``) and ``quantization = "dequantize"`` (float32 weights, oneDNN-packed), one
after the other in this process. The dequantised engine is itself checked against HF
transformers in core/tests/test_engine_smollm2.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from powertrain import LLM, SamplingParams
from powertrain.layers.linear import Linear
from powertrain.testing.oracle import prefill_logits, relative_error
from powertrain_cpu_kernels.threads import openmp_team
from powertrain_cpu_kernels.torch_openmp import SWITCH, gomp_parallel_address

#: A fixed prompt set, greedy: the kept-quantised model must continue each exactly as the
#: dequantised one does.
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there lived a",
    "Water boils at",
    "List three primary colors:",
    "In machine learning, overfitting means",
]
GREEDY_TOKENS = 32
GREEDY = SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, min_tokens=GREEDY_TOKENS)
#: Largest |kept - dequantised| logit over the largest dequantised one. Both multiply the
#: same float32 weight values (dequantisation is exact), so only summation order differs:
#: the native kernel sums each 32-column group before scaling it, oneDNN sums whole rows.
#: Measured up to 2.8e-6 here; a wrong scale, offset or row order is of order 1.
LOGIT_TOLERANCE = 1e-4


#: The same for products of one to four rows, where the kept model rounds activations to
#: 16 bits on AVX2 (``activation_bits``; three and four rows with AVX-512 VNNI): measured
#: 3.6e-4 to 7.7e-4 here (3e-6 with ``activation_bits=32``). SmolLM2's activations have
#: outlier columns, and a group with one rounds its small values with the outlier's step. A
#: wrong code or scale is of order 1.
SHORT_LOGIT_TOLERANCE = 2e-3
SHORT_ROWS = (1, 2, 3, 4)


@pytest.fixture(scope="module")
def runs() -> dict[str, tuple[list[torch.Tensor], list[list[int]], dict]]:
    results = {}
    for mode in ("keep", "dequantize"):
        with engine(mode) as (llm, steps):
            ids = [llm.tokenizer.encode(prompt) for prompt in PROMPTS]
            logits = prefill_logits(llm, ids)
            tokens = greedy(llm)
            # One to four rows at a time: batch-1 decode's sizes, and short verifications'.
            short = [prefill_logits(llm, [prompt[:rows]])[0] for prompt in ids for rows in SHORT_ROWS]
            alone = [greedy(llm, [prompt])[0] for prompt in PROMPTS]
            modules = llm.engine.runner.model.modules()
            linears = [module.kernel for module in modules if isinstance(module, Linear)]
            extra = {
                "kernels": {type(kernel).__name__ for kernel in linears},
                "fused": type(llm.engine.runner.model.model.fused).__name__,
                "activation_bits": {getattr(kernel, "activation_bits", None) for kernel in linears},
                "steps": steps,
                "short": short,
                "alone": alone,
            }
            results[mode] = (logits, tokens, extra)
    return results


@contextlib.contextmanager
def engine(mode: str) -> Iterator[tuple[LLM, list[tuple[int, int]]]]:
    """The embedded model with ``quantization = mode``, built with torch on ``ENGINE_THREADS``
    (its device thread takes its creator's count), and (tokens, torch threads) of each of its
    steps from then on."""
    before = torch.get_num_threads()
    torch.set_num_threads(ENGINE_THREADS)
    try:
        with LLM(dtype="float32", quantization=mode, memory_gib=0.25) as llm:
            yield llm, _record_step_threads(llm.engine.runner.model)
    finally:
        torch.set_num_threads(before)


def greedy(llm: LLM, prompts: list[str] = PROMPTS) -> list[list[int]]:
    """The prompts' greedy continuations (the prompt set's by default), decoded together."""
    return [list(output.outputs[0].token_ids) for output in llm.generate(prompts, GREEDY)]


#: torch threads the engines are built with (two: enough to see a step run on one).
ENGINE_THREADS = 2


def _record_step_threads(model: torch.nn.Module) -> list[tuple[int, int]]:
    """(tokens, torch threads) of every forward from now on."""
    steps: list[tuple[int, int]] = []
    forward = model.forward

    def recording(input_ids: torch.Tensor, *args, **kwargs):
        steps.append((input_ids.numel(), torch.get_num_threads()))
        return forward(input_ids, *args, **kwargs)

    model.forward = recording
    return steps


def test_the_kept_model_multiplies_through_the_native_kernel(runs) -> None:
    """And its short steps run the fused decoder stack, so the greedy and logit checks below
    hold for it; the dequantised model runs its layers one by one."""
    assert runs["keep"][2]["kernels"] == {"NativeQuantizedLinear"}
    assert runs["dequantize"][2]["kernels"] == {"NoneType"}
    assert runs["keep"][2]["fused"] == "NativeDecoderStack"
    assert runs["dequantize"][2]["fused"] == "NoneType"


def test_every_step_keeps_torchs_threads_where_the_kernels_share_its_team(runs) -> None:
    """Where torch's OpenMP team is reachable the native kernels run on it, so no step needs
    torch on one thread (``own_pool_max_rows`` is 0)."""
    if not gomp_parallel_address():
        # Only a torch without libgomp (not Linux wheels: there
        # test_torch_openmp_runtime_is_found_where_torch_uses_libgomp fails instead) gets here;
        # its engines take the pool route, which the next test checks.
        pytest.skip("torch's OpenMP runtime is not reachable here: see the pool test below")
    for mode in ("keep", "dequantize"):
        assert {threads for _, threads in runs[mode][2]["steps"]} == {ENGINE_THREADS}, mode


def test_without_torchs_team_decode_steps_leave_the_cores_to_the_native_pool(runs, monkeypatch) -> None:
    """With the team switched off (``POWERTRAIN_CPU_OPENMP=0``, as where torch has no libgomp)
    steps of up to ``own_pool_max_rows`` tokens run torch's ops on one thread while the native
    kernels use their own pool; larger steps (batched prefill) keep torch's threads; greedy
    output stays the same."""
    from powertrain_cpu_kernels.tuning import POOL_MAX_ROWS

    monkeypatch.setenv(SWITCH, "0")
    gomp_parallel_address.cache_clear()
    try:
        assert openmp_team() == 0
        with engine("keep") as (llm, steps):
            tokens = greedy(llm)
    finally:
        monkeypatch.delenv(SWITCH)
        gomp_parallel_address.cache_clear()
    assert {n <= POOL_MAX_ROWS for n, _ in steps} == {True, False}  # both kinds ran
    for n, threads in steps:
        assert threads == (1 if n <= POOL_MAX_ROWS else ENGINE_THREADS), (n, threads)
    assert tokens == runs["keep"][1]


def test_logits_stay_within_tolerance_of_the_dequantized_model(runs) -> None:
    for prompt, kept, dense in zip(PROMPTS, runs["keep"][0], runs["dequantize"][0], strict=True):
        error = relative_error(kept, dense)
        assert error < LOGIT_TOLERANCE, f"{prompt!r}: relative logit error {error:.2e}"


def test_greedy_output_is_unchanged_on_the_prompt_set(runs) -> None:
    for prompt, kept, dense in zip(PROMPTS, runs["keep"][1], runs["dequantize"][1], strict=True):
        assert kept == dense, f"{prompt!r}: kept-quantised continuation differs"


def test_batch_one_decode_rounds_activations_to_16_bits_and_keeps_greedy_output(runs) -> None:
    """Each prompt decoded alone (one row per step): the kept model's 16-bit activations
    (on AVX2) leave logits within tolerance and every greedy continuation unchanged."""
    assert runs["keep"][2]["activation_bits"] == {16}
    for index, (kept, dense) in enumerate(zip(runs["keep"][2]["short"], runs["dequantize"][2]["short"], strict=True)):
        error = relative_error(kept, dense)
        prompt, rows = PROMPTS[index // len(SHORT_ROWS)], SHORT_ROWS[index % len(SHORT_ROWS)]
        assert error < SHORT_LOGIT_TOLERANCE, f"{prompt!r}, {rows} rows: relative logit error {error:.2e}"
    for prompt, kept, dense in zip(PROMPTS, runs["keep"][2]["alone"], runs["dequantize"][2]["alone"], strict=True):
        assert kept == dense, f"{prompt!r} alone: kept-quantised continuation differs"
    assert runs["keep"][2]["alone"] == runs["keep"][1], "decoding alone changed a continuation"

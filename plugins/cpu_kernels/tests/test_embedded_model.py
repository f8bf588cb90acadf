"""The embedded SmolLM2-135M-Instruct (a Q4_1 GGUF) with its weights kept quantised,
through the native kernels, against the same model dequantised at load.

Both are real engines on the real file: ``quantization = "keep"`` (auto-selected
``cpu-native``) and ``quantization = "dequantize"`` (float32 weights, oneDNN-packed), one
after the other in this process. The dequantised engine is itself checked against HF
transformers in core/tests/test_engine_smollm2.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import pytest
import torch

from powertrain import LLM, SamplingParams
from powertrain.interfaces import QuantizedWeight
from powertrain.layers.linear import Linear
from powertrain.testing.oracle import prefill_logits, relative_error
from powertrain.testing.quantized_linear import QuantizedLinearSuite, scaled_errors
from powertrain_cpu_kernels.quantized_linear import NativeQuantizedLinear, PreparedWeight
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
#: Each of a token's 211 products (7 per layer, 30 layers, the head) rounds its sum of up to
#: 1,536 terms: about sqrt(1536) * 2^-24 = 2.3e-6 of its size where the roundings' signs are
#: random, and the 211 add up like that too, sqrt(211) * 2.3e-6 = 3.4e-5; this is three times
#: that. Measured up to 2.8e-6 here; a wrong scale, offset or row order is of order 1.
LOGIT_TOLERANCE = 1e-4


#: Products of one to four rows, where the kept model rounds activations to 16 bits on AVX2
#: (``activation_bits``; three and four rows with AVX-512 VNNI), are checked in three steps,
#: each with a bound from the arithmetic instead of one measured end-to-end tolerance (2e-3,
#: over a measured 3.6e-4 to 7.7e-4): every product, on the model's own activations (outlier
#: columns included), within the kernel's rounding bound of its float64 product
#: (``scaled_errors``, the kit's float32 tolerance); the same layers with float32 activations
#: within LOGIT_TOLERANCE of the dequantised model; and the fused decoder stack within
#: ``fused_tolerance`` of those layers called one by one with 16-bit activations. Measured
#: (this EPYC): no product past its bound, float32 activations 4.9e-6 off, the fused stack at
#: most 0.73 of ``rounding`` (4.6e-4). The first check found the kit's bound wrong for Q4_1
#: (``activation_rounding_bound``); a fused stack whose attention scale is 5% off fails the
#: third at 2.8e-2 (allowed 1.3e-3).
SHORT_ROWS = (1, 2, 3, 4)
CHECKED_PROMPTS = 2
#: The kit's bound for one product: its float32 tolerance, beyond the activations' rounding bound.
PRODUCT_TOLERANCE = QuantizedLinearSuite.tolerances[torch.float32]


def fused_tolerance(rounding: float) -> float:
    """Fused against the same kernels layer by layer, both rounding activations to 16 bits:
    LOGIT_TOLERANCE for summation order, and twice what rounding moved the row by (the layers
    one by one with and without it): where the two paths' float32 values differ, an
    activation near a grid point rounds a whole step apart on them, at most twice the half
    step any rounding moves it by, and such flips are a few of the activations rounding
    moved (the argument of plugins/cpu_kernels/tests/test_decoder.py's
    ``layerwise_tolerance``)."""
    return LOGIT_TOLERANCE + 2 * rounding


@pytest.fixture(scope="module")
def runs() -> dict[str, tuple[list[torch.Tensor], list[list[int]], dict]]:
    results = {}
    for mode in ("keep", "dequantize"):
        with engine(mode) as (llm, steps):
            ids = [llm.tokenizer.encode(prompt) for prompt in PROMPTS]
            logits = prefill_logits(llm, ids)
            tokens = greedy(llm)
            # One to four rows at a time: batch-1 decode's sizes, and short verifications'.
            short = short_logits(llm, ids)
            alone = [greedy(llm, [prompt])[0] for prompt in PROMPTS]
            modules = llm.engine.runner.model.modules()
            linears = [module.kernel for module in modules if isinstance(module, Linear)]
            layers = {}
            if mode == "keep":
                layers = short_steps_layer_by_layer(llm, ids, {id(kernel): kernel for kernel in linears})
            extra = {
                "kernels": {type(kernel).__name__ for kernel in linears},
                "fused": type(llm.engine.runner.model.model.fused).__name__,
                "activation_bits": {getattr(kernel, "activation_bits", None) for kernel in linears},
                "steps": steps,
                "short": short,
                **layers,
                "alone": alone,
            }
            results[mode] = (logits, tokens, extra)
    return results


def short_logits(llm: LLM, ids: list[list[int]]) -> list[torch.Tensor]:
    """Each prompt's first one to four tokens, prefilled alone: batch-1 decode's sizes, and
    short verifications'."""
    return [prefill_logits(llm, [prompt[:rows]])[0] for prompt in ids for rows in SHORT_ROWS]


def short_steps_layer_by_layer(llm: LLM, ids: list[list[int]], kernels: dict[int, NativeQuantizedLinear]) -> dict:
    """``short_logits`` without the fused stack: with 16-bit activations (the first
    CHECKED_PROMPTS' products checked against their float64 oracle on the way: the worst
    scaled error beyond the rounding bound), and with float32 activations."""
    model = llm.engine.runner.model
    fused = model.model.fused
    model.use_fused_decoder(None)
    try:
        # Every product checked on two prompts (all four sizes; the float64 oracle of 211
        # products costs seconds per prompt); the other prompts' logits unchecked on the way.
        with checked_products(kernels) as worst:
            rounded = short_logits(llm, ids[:CHECKED_PROMPTS])
        rounded += short_logits(llm, ids[CHECKED_PROMPTS:])
        for kernel in kernels.values():
            kernel.activation_bits = 32
        unrounded = short_logits(llm, ids)
    finally:
        for kernel in kernels.values():
            kernel.activation_bits = 16
        model.use_fused_decoder(fused)
    return {"short_layers": rounded, "short_unrounded": unrounded, "worst_product": worst}


@contextlib.contextmanager
def checked_products(kernels: dict[int, NativeQuantizedLinear]) -> Iterator[dict]:
    """Every ``linear`` call of these kernels compared, as it happens, with the float64 product
    of the same activations and the weight dequantised (``scaled_errors``: what the rounding
    bound of the kernel's ``activation_bits`` does not explain); yields the worst, by name."""
    worst = {"error": 0.0, "what": ""}
    weights: dict[int, tuple[QuantizedWeight, torch.Tensor]] = {}

    def checking(kernel: NativeQuantizedLinear, linear: Callable) -> Callable:
        def call(x: torch.Tensor, prepared: PreparedWeight, bias: torch.Tensor | None) -> torch.Tensor:
            got = linear(x, prepared, bias)
            if id(prepared) not in weights:
                offsets = None if prepared.offsets is None else prepared.offsets.float()
                weight = QuantizedWeight(
                    prepared.codes, prepared.scales.float(), offsets, prepared.format, prepared.group
                )
                weights[id(prepared)] = weight, weight.dequantize(torch.float64)
            weight, dense = weights[id(prepared)]
            flat = x.reshape(-1, x.shape[-1]).double()
            want = flat @ dense.T + (0 if bias is None else bias.double())
            errors = scaled_errors(got.reshape(want.shape).double(), flat, weight, want, kernel.activation_bits)
            if float(errors.max()) > worst["error"]:
                worst.update(error=float(errors.max()), what=f"{prepared.what} [{len(flat)}x{dense.shape[1]}]")
            return got

        return call

    originals = {key: kernel.linear for key, kernel in kernels.items()}
    for key, kernel in kernels.items():
        kernel.linear = checking(kernel, originals[key])
    try:
        yield worst
    finally:
        for key, kernel in kernels.items():
            kernel.linear = originals[key]


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
    """Each prompt decoded alone (one row per step) and its first one to four tokens: the kept
    model's 16-bit activations (on AVX2) stay within their rounding bound in every product,
    the fused stack follows the same kernels called layer by layer, and every greedy
    continuation is unchanged."""
    kept, dense = runs["keep"][2], runs["dequantize"][2]
    assert kept["activation_bits"] == {16}
    worst = kept["worst_product"]
    assert worst["error"] < PRODUCT_TOLERANCE, f"{worst['what']}: scaled error {worst['error']:.2e} past rounding"
    rows = zip(kept["short"], kept["short_layers"], kept["short_unrounded"], dense["short"], strict=True)
    for index, (fused, layers, unrounded, reference) in enumerate(rows):
        where = f"{PROMPTS[index // len(SHORT_ROWS)]!r}, {SHORT_ROWS[index % len(SHORT_ROWS)]} rows"
        error = relative_error(unrounded, reference)
        assert error < LOGIT_TOLERANCE, f"{where}: float32 activations {error:.2e} off the dequantised model"
        error, allowed = relative_error(fused, layers), fused_tolerance(relative_error(layers, unrounded))
        assert error <= allowed, f"{where}: fused stack {error:.2e} off the layers one by one, allowed {allowed:.2e}"
    for prompt, ours, theirs in zip(PROMPTS, kept["alone"], dense["alone"], strict=True):
        assert ours == theirs, f"{prompt!r} alone: kept-quantised continuation differs"
    assert kept["alone"] == runs["keep"][1], "decoding alone changed a continuation"

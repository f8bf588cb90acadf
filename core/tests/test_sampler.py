"""The sampler against statistics and the definitions of each filter and penalty."""

from __future__ import annotations

import attrs
import pytest
import torch

from powertrain.engine.sampler import Sampler, SamplingInputs, apply_penalties
from powertrain.interfaces.errors import InvalidRequestError
from powertrain.interfaces.sampling import SamplingParams, race_noise, row_argmax
from powertrain.testing.base import fresh_seed

VOCAB = 12


def inputs(params: list[SamplingParams], generators=None, history=None, num_output=None, banned=None) -> SamplingInputs:
    rows = len(params)
    return SamplingInputs(
        params=params,
        generators=generators or [None] * rows,
        history=history or [[] for _ in range(rows)],
        num_output=num_output or [0] * rows,
        banned=banned or [() for _ in range(rows)],
    )


def frequencies(logits: torch.Tensor, params: SamplingParams, draws: int, seed: int) -> torch.Tensor:
    sampler = Sampler(seed)
    batch = logits.expand(draws, -1).clone()
    tokens = sampler(batch, inputs([params] * draws)).tokens
    return torch.bincount(tokens, minlength=VOCAB).double() / draws


def test_greedy_is_argmax() -> None:
    logits = torch.randn(5, VOCAB)
    out = Sampler()(logits.clone(), inputs([SamplingParams(temperature=0)] * 5))
    assert torch.equal(out.tokens, logits.argmax(-1))


def test_temperature_sampling_matches_the_softmax() -> None:
    seed = fresh_seed()
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed))
    expected = torch.softmax(logits.double() / 0.7, -1)
    observed = frequencies(logits, SamplingParams(temperature=0.7), 40000, seed)
    # 40k draws: each frequency within 5 standard errors of its probability.
    stderr = (expected * (1 - expected) / 40000).sqrt()
    assert ((observed - expected).abs() <= 5 * stderr + 1e-4).all(), (seed, observed, expected)


def test_race_noise_is_exponential_and_follows_its_generator() -> None:
    seed = fresh_seed()
    draws = race_noise(torch.empty(1_000_000), torch.Generator().manual_seed(seed))
    assert not draws.isnan().any() and (draws >= 0).all(), seed
    # Exp(1): P(q > x) = e^-x. 1M draws: each tail fraction within 5 standard errors.
    for x in (0.01, 0.5, 1.0, 3.0, 8.0):
        expected = torch.tensor(-x).exp().item()
        stderr = (expected * (1 - expected) / draws.numel()) ** 0.5
        assert abs((draws > x).double().mean().item() - expected) <= 5 * stderr, (seed, x)
    again = race_noise(torch.empty(1000), torch.Generator().manual_seed(seed))
    assert torch.equal(again, draws[:1000]), "a seeded generator must give the same draws"


def test_race_noise_is_finite_even_for_a_uniform_draw_of_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    """uniform_ returns 0 once in 2^24 entries; the race must still pick a one-hot's token."""
    monkeypatch.setattr(torch.Tensor, "uniform_", lambda self, **_: self.zero_())
    noise = race_noise(torch.empty(8))
    assert torch.isfinite(noise).all() and (noise > 0).all()
    one_hot = torch.zeros(8)
    one_hot[5] = 1
    assert int(row_argmax(one_hot / noise)) == 5


def test_top_k_top_p_min_p_supports_and_renormalises() -> None:
    seed = fresh_seed()
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)) * 2
    probs = torch.softmax(logits.double(), -1)
    order = probs.argsort(descending=True)

    observed = frequencies(logits, SamplingParams(top_k=3), 30000, seed)
    assert set(observed.nonzero().flatten().tolist()) == set(order[:3].tolist()), seed
    expected = probs[order[:3]] / probs[order[:3]].sum()
    assert torch.allclose(observed[order[:3]], expected, atol=0.02), seed

    cumulative = probs[order].cumsum(0)
    keep = int((cumulative - probs[order] < 0.6).sum())
    observed = frequencies(logits, SamplingParams(top_p=0.6), 30000, seed)
    assert set(observed.nonzero().flatten().tolist()) == set(order[:keep].tolist()), seed

    threshold = 0.2 * probs.max()
    observed = frequencies(logits, SamplingParams(min_p=0.2), 30000, seed)
    assert set(observed.nonzero().flatten().tolist()) == set((probs >= threshold).nonzero().flatten().tolist()), seed


def test_seeded_rows_do_not_depend_on_the_batch() -> None:
    seed = fresh_seed()
    logits = torch.randn(1, 500, generator=torch.Generator().manual_seed(seed))
    params = SamplingParams(temperature=1.0, seed=seed)

    def run(batch_rows: int) -> list[int]:
        generator = torch.Generator().manual_seed(seed)
        others = torch.randn(batch_rows - 1, 500)
        tokens = []
        for _ in range(20):
            batch = torch.cat([others, logits]) if batch_rows > 1 else logits.clone()
            rows = [SamplingParams()] * (batch_rows - 1) + [params]
            gens = [None] * (batch_rows - 1) + [generator]
            tokens.append(int(Sampler(fresh_seed())(batch, inputs(rows, generators=gens)).tokens[-1]))
        return tokens

    assert run(1) == run(7) == run(3)


def test_penalties_follow_their_definitions() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    history = [[0, 1, 1, 3, 3, 3]]  # the last 4 are output tokens: 1, 3, 3, 3
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    penalised = apply_penalties(logits.clone(), inputs([params], history=history, num_output=[4]))
    # token 0: seen in the prompt -> 2/2 = 1; token 1: seen, once in the output -> -1*2 - 0.25 - 0.5;
    # token 2: unseen -> 0.5; token 3: three times in the output -> 3/2 - 0.75 - 0.5
    assert torch.allclose(penalised, torch.tensor([[1.0, -2.75, 0.5, 0.25]]))
    # ... and the sampler acts on the penalised logits: greedy picks token 0 now, not 3.
    greedy = attrs.evolve(params, temperature=0)
    assert int(Sampler()(logits.clone(), inputs([greedy], history=history, num_output=[4])).tokens[0]) == 0


def test_banned_tokens_are_never_sampled() -> None:
    logits = torch.zeros(200, VOCAB)
    logits[:, 3] = 10.0
    out = Sampler()(logits, inputs([SamplingParams()] * 200, banned=[(3, 5)] * 200))
    assert not ((out.tokens == 3) | (out.tokens == 5)).any()


def test_logit_bias_moves_greedy_and_sampled_choices() -> None:
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(fresh_seed()))
    top, last = logits.argmax(-1), logits.argmin(-1)
    banned = [SamplingParams(temperature=0, logit_bias={int(top[r]): -100}) for r in range(3)]
    out = Sampler()(logits.clone(), inputs(banned))
    # -100 on the greedy token: the next best is chosen.
    assert torch.equal(out.tokens, logits.scatter(1, top[:, None], float("-inf")).argmax(-1))
    # +100 forces even the least likely token, when sampling at temperature 1 too.
    forced = [SamplingParams(logit_bias={int(last[r]): 100.0}) for r in range(3)] * 100
    out = Sampler(fresh_seed())(logits.repeat(100, 1), inputs(forced))
    assert torch.equal(out.tokens, last.repeat(100))
    # A small bias shifts the distribution by exp(bias): token 0 at +1 vs the unbiased softmax.
    seed = fresh_seed()
    row = logits[0]
    shifted = row.double().clone()
    shifted[0] += 1.0
    expected = torch.softmax(shifted, -1)
    observed = frequencies(row, SamplingParams(logit_bias={0: 1.0}), 40000, seed)
    stderr = (expected * (1 - expected) / 40000).sqrt()
    assert ((observed - expected).abs() <= 5 * stderr + 1e-4).all(), (seed, observed, expected)


def test_logit_bias_does_not_lift_a_ban() -> None:
    logits = torch.zeros(1, VOCAB)
    out = Sampler()(logits, inputs([SamplingParams(temperature=0, logit_bias={4: 100})], banned=[(4,)]))
    assert int(out.tokens[0]) != 4


def test_logprobs_are_the_models_log_softmax() -> None:
    logits = torch.randn(2, VOCAB)
    params = [SamplingParams(temperature=0, logprobs=3), SamplingParams(temperature=0)]
    out = Sampler()(logits.clone(), inputs(params))
    reference = torch.log_softmax(logits, -1)
    chosen = int(out.tokens[0])
    assert out.logprobs[1] is None
    assert out.logprobs[0][chosen] == pytest.approx(float(reference[0, chosen]), abs=1e-6)
    top = reference[0].topk(3)
    for value, index in zip(top.values, top.indices, strict=True):
        assert out.logprobs[0][int(index)] == pytest.approx(float(value), abs=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens must be >= 1"),
        ({"top_p": 0.0}, "top_p must be in (0, 1]"),
        ({"top_p": 1.5}, "top_p must be in (0, 1]"),
        ({"temperature": -1}, "temperature must be >= 0"),
        ({"n": 0}, "n must be an integer >= 1"),
        ({"stop": [""]}, "stop must be non-empty strings"),
        ({"logprobs": 50}, "logprobs must be between 0 and 20"),
        ({"top_k": -1}, "top_k must be >= 0"),
        ({"logit_bias": {3: 101}}, "logit_bias must map token ids >= 0 to biases in [-100, 100]"),
        ({"logit_bias": {-1: 1}}, "logit_bias must map"),
        ({"logit_bias": {"3": 1}}, "logit_bias must map"),
        ({"logit_bias": 5}, "logit_bias must map"),
    ],
)
def test_invalid_parameters_are_refused_clearly(kwargs, message) -> None:
    with pytest.raises(InvalidRequestError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_row_argmax_gives_torch_argmax_indices(dtype: torch.dtype) -> None:
    """The numpy route for CPU rows keeps torch's rules: the first of tied maxima, a NaN
    counting as the maximum (the first NaN), infinities; 1-d, 2-d, strided and 3-d inputs."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(6, 300, generator=gen).to(dtype)
    values[1, [17, 250]] = float("nan")
    values[2] = 1.0  # every entry tied
    values[3, [5, 9]] = float("inf")
    values[4] = float("-inf")
    values[5, 123] = values[5].max() + 1
    cases = [values, values[0], values[:, ::3], values.view(2, 3, 300), values[:0]]
    for case in cases:
        got = row_argmax(case)
        want = case.argmax(dim=-1)
        assert got.dtype == torch.int64 and torch.equal(got, want), f"seed={seed} {dtype} {list(case.shape)}"

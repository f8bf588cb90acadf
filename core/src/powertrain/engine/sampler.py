"""Turning logits into tokens, one row per sequence, each row on its own.

Every operation here is row-wise (penalties, temperature, top-k/top-p/min-p, the
draw), so a row's result never depends on what else is in the batch; a seeded row
draws its noise from its own generator, advanced once per token. Together with
batch-invariant logits that makes a seeded request reproducible in any batch.

Sampling uses the exponential race: ``argmax(p / q)`` with ``q ~ Exp(1)`` picks token
``i`` with probability ``p_i`` and needs one draw per vocabulary entry per row
(``race_noise``).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from powertrain.engine.structured import TokenMasks
from powertrain.interfaces.sampling import SamplingParams, filtered_probs, race_noise, row_argmax


@attrs.frozen(kw_only=True)
class SamplingInputs:
    """Per-row settings of one step, built on the CPU before the step runs."""

    params: list[SamplingParams]
    generators: list[torch.Generator | None]
    #: Tokens each row has seen (prompt + output so far), for the penalties.
    history: list[list[int]]
    #: How many of those are output tokens (the tail of ``history``).
    num_output: list[int]
    #: Token ids a row may not sample yet (EOS and stop ids before min_tokens).
    banned: list[tuple[int, ...]]

    @property
    def num_rows(self) -> int:
        return len(self.params)


@attrs.frozen(kw_only=True)
class SamplerOutput:
    tokens: torch.Tensor  # int64 [rows]
    #: Per row: {token id: logprob} for the chosen token and the requested top-k, or None.
    logprobs: list[dict[int, float] | None]


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        # For rows without a seed of their own; advanced once per unseeded step.
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, inputs: SamplingInputs, masks: TokenMasks | None = None) -> SamplerOutput:
        """``masks`` (structured output) says which tokens the constrained rows may sample."""
        logits = logits.float()
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(p.logprobs is not None for p in inputs.params) else None
        if masks is not None:
            masks.apply(logits)
        logits = apply_penalties(logits, inputs)
        apply_logit_bias(logits, inputs.params)
        for row, banned in enumerate(inputs.banned):
            if banned:
                logits[row, list(banned)] = float("-inf")

        temperature = torch.tensor([p.temperature for p in inputs.params], dtype=torch.float32)
        greedy = temperature == 0
        if greedy.all():  # no copy of the rows' logits (a batch of 64 copied 12 MB per step)
            tokens = row_argmax(logits)
        else:
            tokens = torch.empty(inputs.num_rows, dtype=torch.int64)
            if greedy.any():
                tokens[greedy] = row_argmax(logits[greedy])
            rows = (~greedy).nonzero().flatten().tolist()
            probs = filtered_probs(logits[rows] / temperature[rows, None], [inputs.params[r] for r in rows])
            noise = self._noise(probs.shape, [inputs.generators[r] for r in rows])
            tokens[rows] = row_argmax(probs / noise)
        return SamplerOutput(tokens=tokens, logprobs=_logprobs(raw_logprobs, tokens, inputs.params))

    def _noise(self, shape: torch.Size, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
        noise = torch.empty(shape, dtype=torch.float32)
        shared = [i for i, g in enumerate(generators) if g is None]
        if len(shared) == len(generators):
            return race_noise(noise, self.generator)
        if shared:
            noise[shared] = race_noise(torch.empty((len(shared), shape[1])), self.generator)
        for i, generator in enumerate(generators):
            if generator is not None:
                race_noise(noise[i], generator)
        return noise


def apply_penalties(logits: torch.Tensor, inputs: SamplingInputs) -> torch.Tensor:
    rows = [
        r for r, p in enumerate(inputs.params) if p.repetition_penalty != 1 or p.presence_penalty or p.frequency_penalty
    ]
    for r in rows:
        p = inputs.params[r]
        history = inputs.history[r]
        if p.repetition_penalty != 1 and history:
            seen = torch.tensor(sorted(set(history)), dtype=torch.long)
            values = logits[r, seen]
            logits[r, seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
        output = history[len(history) - inputs.num_output[r] :] if inputs.num_output[r] else []
        if output and (p.presence_penalty or p.frequency_penalty):
            counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=logits.shape[1]).float()
            logits[r] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
    return logits


def apply_logit_bias(logits: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    """OpenAI's logit_bias, in place: after the penalties (as OpenAI describes it, a bias
    on the final logits) and before the min_tokens bans, which it must not lift."""
    for row, p in enumerate(params):
        if p.logit_bias:
            ids, biases = zip(*p.logit_bias, strict=True)
            logits[row, list(ids)] += torch.tensor(biases, dtype=logits.dtype, device=logits.device)


def _logprobs(
    raw: torch.Tensor | None, tokens: torch.Tensor, params: list[SamplingParams]
) -> list[dict[int, float] | None]:
    if raw is None:
        return [None] * len(params)
    result: list[dict[int, float] | None] = []
    for row, p in enumerate(params):
        if p.logprobs is None:
            result.append(None)
            continue
        chosen = int(tokens[row])
        entry = {chosen: float(raw[row, chosen])}
        if p.logprobs:
            values, ids = raw[row].topk(p.logprobs)
            entry.update({int(i): float(v) for i, v in zip(ids, values, strict=True)})
        result.append(entry)
    return result

"""SamplingParams: how one request's tokens are chosen, validated on construction."""

from __future__ import annotations

from typing import Any

import attrs

from powertrain.engine.errors import InvalidRequestError
from powertrain.engine.structured import StructuredOutput


def _to_tuple(value: Any) -> tuple:
    if value is None:
        return ()
    if isinstance(value, str | int):
        return (value,)
    return tuple(value)


@attrs.frozen(kw_only=True)
class SamplingParams:
    """Sampling settings of one request (OpenAI/vLLM semantics).

    ``temperature=0`` is greedy. ``top_k=0`` and ``top_p=1`` disable those filters.
    ``seed`` makes the request's tokens reproducible whatever else is in the batch.
    ``logprobs=k`` returns the chosen token's logprob and the ``k`` most likely ones
    (from the model's distribution before temperature, penalties and constraints).
    ``structured`` constrains the output to a JSON schema, any JSON object, a regex or a
    Lark grammar (see ``StructuredOutput``); the output then ends when the constraint is
    complete, with an EOS token even if ``ignore_eos`` is set.
    """

    n: int = 1
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: tuple[str, ...] = attrs.field(default=(), converter=_to_tuple)
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_to_tuple)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    seed: int | None = None
    logprobs: int | None = None
    skip_special_tokens: bool = True
    structured: StructuredOutput | None = None

    def __attrs_post_init__(self) -> None:
        problems = []

        def need(ok: bool, message: str) -> None:
            if not ok:
                problems.append(message)

        need(_is_int(self.n) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}")
        need(_is_int(self.max_tokens) and self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens!r}")
        need(
            _is_int(self.min_tokens) and 0 <= self.min_tokens <= max(self.max_tokens, 0),
            f"min_tokens must be between 0 and max_tokens ({self.max_tokens}), got {self.min_tokens!r}",
        )
        need(
            _is_number(self.temperature) and self.temperature >= 0,
            f"temperature must be >= 0, got {self.temperature!r}",
        )
        need(_is_number(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}")
        need(_is_int(self.top_k) and self.top_k >= 0, f"top_k must be >= 0 (0 disables it), got {self.top_k!r}")
        need(_is_number(self.min_p) and 0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p!r}")
        need(
            _is_number(self.repetition_penalty) and self.repetition_penalty > 0,
            f"repetition_penalty must be > 0 (1 disables it), got {self.repetition_penalty!r}",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            need(_is_number(value) and -2 <= value <= 2, f"{name} must be in [-2, 2], got {value!r}")
        need(all(isinstance(s, str) and s for s in self.stop), f"stop must be non-empty strings, got {self.stop!r}")
        need(
            all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
            f"stop_token_ids must be token ids >= 0, got {self.stop_token_ids!r}",
        )
        need(self.seed is None or _is_int(self.seed), f"seed must be an integer, got {self.seed!r}")
        need(
            self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= 20),
            f"logprobs must be between 0 and 20, got {self.logprobs!r}",
        )
        need(
            self.structured is None or isinstance(self.structured, StructuredOutput),
            f"structured must be a StructuredOutput, got {type(self.structured).__name__}",
        )
        need(
            self.structured is None or self.min_tokens == 0,
            "min_tokens cannot be combined with structured output: the constraint decides where the output ends",
        )
        if problems:
            raise InvalidRequestError("invalid sampling parameters: " + "; ".join(problems))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value == value  # not NaN

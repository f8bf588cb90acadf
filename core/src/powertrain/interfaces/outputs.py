"""What the engine reports back for a request: its outputs after each step.

Part of the contract because a protocol adapter renders them (``render_response``) and
``LLM``/``AsyncEngine`` callers read them.
"""

from __future__ import annotations

import attrs


@attrs.define(kw_only=True)
class CompletionOutput:
    """One sampled continuation of a request."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort" or "error" (see RequestOutput.error)
    #: Per generated token: {token id: logprob} for the chosen token and the top-k.
    logprobs: list[dict[int, float]] | None = None


@attrs.define(kw_only=True)
class RequestOutput:
    """A request's state after a step: all text so far, and whether it is done."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    #: ``arrival_time`` (monotonic seconds) and, once a token came, ``time_to_first_token_s``.
    metrics: dict[str, float] = attrs.field(factory=dict)
    #: Why the request failed, when it did (the rank serving it died): it is finished, its
    #: completions end with finish reason "error", and the engine serves on.
    error: str | None = None

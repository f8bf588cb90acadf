"""The engine contract the front ends program against.

``LLM``, ``AsyncEngine``, the HTTP server and the CLI drive an engine only through
``Engine``: one process's ``LLMEngine`` and the multi-process front end
``ParallelEngine`` both implement it, and ``powertrain.deploy.start_engine`` returns
whichever the config asks for. An engine is not thread-safe: one thread drives it
(``AsyncEngine`` owns that thread for asyncio callers).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import attrs

from powertrain.interfaces.outputs import RequestOutput
from powertrain.interfaces.protocol import ModelTokenizer
from powertrain.interfaces.sampling import SamplingDefaults, SamplingParams


@attrs.frozen(kw_only=True)
class EngineStats:
    """A snapshot of the engine's load and cumulative counters (for metrics)."""

    running: int
    waiting: int
    kv_blocks_total: int
    kv_blocks_free: int
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    preemptions: int
    #: Speculative decoding: sequence-steps that could speculate, draft tokens verified
    #: and accepted in them (all 0 without a speculative policy).
    speculative_request_steps: int = 0
    speculative_verified_tokens: int = 0
    speculative_accepted_tokens: int = 0
    #: Prefill/decode disaggregation (the front end's counts; 0 elsewhere): prompts a
    #: prefill rank handed to a decode rank, those whose blocks did not reach the store
    #: (the decode rank computed them), and the seconds from sending each to its prefill
    #: rank to its blocks being in the store, summed.
    handoffs: int = 0
    handoff_failures: int = 0
    handoff_seconds: float = 0.0
    #: The tiers below the device cache, by tier name (all empty without tiers): of the
    #: prefix-cache hits, the tokens loaded back from each; the bytes written to and read
    #: from each; the seconds those took; the calls that failed (each a miss).
    prefix_cache_tier_hit_tokens: Mapping[str, int] = attrs.field(factory=dict)
    kv_tier_bytes_written: Mapping[str, int] = attrs.field(factory=dict)
    kv_tier_bytes_read: Mapping[str, int] = attrs.field(factory=dict)
    kv_tier_seconds: Mapping[str, float] = attrs.field(factory=dict)
    kv_tier_errors: Mapping[str, int] = attrs.field(factory=dict)

    @classmethod
    def total(cls, reports: Sequence[EngineStats]) -> EngineStats:
        """Several engines' counts added up (per tier for the by-tier ones)."""
        values: dict[str, Any] = {}
        for field in attrs.fields(cls):
            parts = [getattr(report, field.name) for report in reports]
            if isinstance(field.default, attrs.Factory):  # by tier name
                merged: dict[str, float] = {}
                for part in parts:
                    for name, value in part.items():
                        merged[name] = merged.get(name, 0) + value
                values[field.name] = merged
            else:
                values[field.name] = sum(parts)
        return cls(**values)


@runtime_checkable
class EngineTokenizer(ModelTokenizer, Protocol):
    """What the front ends use of the model's tokenizer (beyond what an adapter reads)."""

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]: ...

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """A conversation -> prompt text, with the model's chat template."""
        ...


@runtime_checkable
class Engine(Protocol):
    """Requests in, outputs out, one ``step`` at a time."""

    tokenizer: EngineTokenizer
    #: What the model is served as (``[model] path``).
    model_name: str
    #: The checkpoint's config (HF ``config.json`` semantics).
    model_config: Mapping[str, Any]
    #: Tokens per sequence, prompt and output together.
    max_model_len: int
    #: What a request leaves unset gets: the model's own sampling settings, or ours
    #: (``[model] generation_config``); ``add_request`` without params uses them.
    sampling_defaults: SamplingDefaults

    def add_request(
        self, prompt: str | Sequence[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        """Check and queue a request; returns its id. Bad input raises
        ``InvalidRequestError`` and leaves the engine as it was."""
        ...

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free what it holds; its final output (finish reason
        "abort"), or None for an unknown or finished id."""
        ...

    def step(self) -> list[RequestOutput]:
        """Run one step; the outputs of the requests it advanced or finished."""
        ...

    def has_unfinished_requests(self) -> bool: ...

    def stats(self) -> EngineStats:
        """Counts as of now; call on the thread that drives the engine."""
        ...

    def shutdown(self) -> None:
        """Stop, releasing devices, worker processes and process groups."""
        ...

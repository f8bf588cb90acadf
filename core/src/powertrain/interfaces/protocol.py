"""The protocol adapter contract: request bodies in, the parsed request the server runs,
and generated text back out as a protocol's JSON body or SSE frames.

The adapter parses, renders and tokenizes a request into a ``ParsedRequest``; the server
reads its typed fields (model, prompt tokens, sampling, output constraints, streaming)
and hands the record back to the adapter's other methods, which also read the
adapter's own parse (``native``: the conversation, tools, protocol extras).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

import attrs

from powertrain.interfaces.outputs import RequestOutput

if TYPE_CHECKING:
    import tokenizers

#: One event of a stream parser, as a JSON-like dict with a ``type`` (``text``,
#: ``reasoning``, ``tool_call_start``, ``stopped`` with its ``stop``, ...): the adapter's
#: parser writes them and its writer reads them; the server only passes them along.
ParserEvent = Mapping[str, Any]


@attrs.frozen(kw_only=True)
class RequestSampling:
    """What a request asks of the sampler, as its protocol said it; None: the engine's
    default (the server turns this into ``SamplingParams``)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    #: None: until the model stops or its context is full.
    max_tokens: int | None = None
    stop: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    seed: int | None = None
    n: int = 1
    #: Log-probabilities of the chosen tokens were asked for ...
    logprobs: bool = False
    #: ... with this many alternatives per position.
    top_logprobs: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    #: OpenAI's logit_bias as (token id, bias) pairs.
    logit_bias: tuple[tuple[int, float], ...] = attrs.field(default=(), converter=tuple)
    # vLLM's sampling extensions (Chat Completions).
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=tuple)
    #: Keep the matched stop string in the text instead of cutting it.
    include_stop_str_in_output: bool = False
    #: Leave special tokens (an end-of-turn token generated under ignore_eos) out of the text.
    skip_special_tokens: bool = True


@attrs.frozen(kw_only=True)
class ResponseFormat:
    """OpenAI's ``response_format``: free text, any JSON object, or JSON following ``schema``."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    #: The JSON schema as the client sent it (``StructuredOutput`` validates it).
    schema: Any = None


@attrs.frozen(kw_only=True)
class StructuredOutputsField:
    """The ``structured_outputs`` extension field (vLLM's keys): the output follows a
    JSON schema (``json``), a regular expression, a Lark grammar, or is one of several
    strings (``choice``)."""

    type: Literal["json", "regex", "grammar", "choice"]
    #: A schema, a pattern, a grammar text or a list of strings, as the client sent it.
    value: Any


@attrs.frozen(kw_only=True)
class ParsedRequest:
    """A request as the protocol adapter parsed, rendered and tokenized it."""

    #: The protocol it arrived in and must be answered in, as ``ProtocolAdapterRecord``
    #: spells it (``openai.chat``, ``openai.responses``, ``anthropic.messages``).
    protocol: str
    model: str
    #: The rendered prompt text, and its tokens (what the engine runs).
    prompt: str
    prompt_token_ids: list[int]
    sampling: RequestSampling = attrs.field(factory=RequestSampling)
    stream: bool = False
    response_format: ResponseFormat = attrs.field(factory=ResponseFormat)
    structured_outputs: StructuredOutputsField | None = None
    #: How many image parts the conversation carries: a model without a vision encoder
    #: (every ``CausalLM`` today: its ``forward`` takes token ids only) refuses them.
    image_count: int = 0
    #: The prompt positions those images take once each placeholder is expanded to its
    #: image's tokens (DeepSeek V4.1's image token specification).
    image_tokens: int = 0
    #: The adapter's own parse (conversation, tools, protocol extras), JSON-like: the
    #: server never reads it; the adapter's other methods do.
    native: Mapping[str, Any] = attrs.field(factory=dict)


class StreamParser(Protocol):
    """Splits one response's generated text into events as it streams in."""

    def push(self, text: str) -> list[ParserEvent]:
        """The events ``text`` completes (text held back while it may start markup)."""
        ...

    def finish(self) -> list[ParserEvent]:
        """The events of whatever is left once generation ends."""
        ...


class ResponseWriter(Protocol):
    """Turns one response's events into the protocol's SSE frames."""

    def start(self) -> list[str]:
        """The frames that open the stream."""
        ...

    def events(self, events: Sequence[ParserEvent]) -> list[str]:
        """The frames for ``events``."""
        ...

    def add_logprobs(self, entries: Sequence[Mapping[str, Any]]) -> None:
        """Log-probability entries (``ProtocolAdapter.token_logprobs``) of the tokens
        generated since the last call; they go out with the next frame that carries
        generated text, so streamed they add up to the non-streaming body's list."""
        ...

    def finish(
        self,
        reason: str,
        prompt_tokens: int,
        completion_tokens: int,
        cached_prompt_tokens: int = 0,
        reasoning_tokens: int = 0,
        stop_sequence: str | None = None,
    ) -> list[str]:
        """The frames that close the stream (``reason`` from ``finish_reason``), with usage."""
        ...


class ModelTokenizer(Protocol):
    """What an adapter's factory reads of the loaded model's tokenizer (the factory is
    called as ``factory(tokenizer, config.json dict)``)."""

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The HF ``tokenizers`` tokenizer (its tokenizer.json via ``to_str()``)."""
        ...

    @property
    def chat_template(self) -> str | None: ...

    @property
    def bos_token(self) -> str | None: ...

    @property
    def eos_token(self) -> str | None: ...


@runtime_checkable
class ProtocolAdapter(Protocol):
    """Request JSON -> conversation -> prompt tokens, and generated tokens -> response."""

    protocols: frozenset[str]

    def parse_request(self, protocol: str, body: bytes) -> ParsedRequest:
        """A request body -> the parsed request; invalid input raises an error carrying
        ``status`` and a protocol-shaped ``body``."""
        ...

    def render_response(self, protocol: str, request: ParsedRequest, output: RequestOutput) -> bytes:
        """A finished engine output -> the protocol's JSON response body."""
        ...

    def stream_parser(self, request: ParsedRequest, id_prefix: str | None = None) -> StreamParser:
        """A parser for this request's generated text (its stop sequences, its markup)."""
        ...

    def response_writer(
        self,
        protocol: str,
        request: ParsedRequest,
        request_id: str,
        created: int = 0,
        prompt_tokens: int = 0,
        choice_index: int = 0,
        ends_stream: bool = True,
    ) -> ResponseWriter:
        """The writer of one streamed response, or of choice ``choice_index`` of an
        ``n`` > 1 stream (only the last choice's writer ``ends_stream``)."""
        ...

    def token_logprobs(
        self, token_ids: Sequence[int], logprobs: Sequence[Mapping[int, float]], top: int
    ) -> list[dict[str, Any]]:
        """Each token's log-probability entry as the protocols write it (``token``,
        ``logprob``, ``bytes`` and the ``top`` most likely ``top_logprobs``), from the
        engine's per-position distributions."""
        ...

    def finish_reason(self, events: Sequence[ParserEvent], engine_reason: str | None) -> tuple[str, str | None]:
        """The writer's finish reason (and stop sequence) from a response's events and
        the engine's reason (``stop``, ``length``, ``abort``)."""
        ...

    def tool_call_grammar(self, request: ParsedRequest) -> str | None:
        """A Lark grammar (llguidance) that makes the model write the tool call the
        request requires, in its own markup; None when none is forced."""
        ...

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
class ImageFit:
    """An image's size once preprocessed for DeepSeek V4.1's vision encoder, and the token
    grid it becomes: ``rows`` rows of ``columns`` image tokens, each row ended by a newline
    token, the whole enclosed by a start and an end token (``tokens`` prompt positions)."""

    width: int
    height: int
    rows: int
    columns: int
    tokens: int


@attrs.frozen(kw_only=True)
class ImagePart:
    """One image of a request, in the order of the prompt's image placeholders.

    Inline data (a data URL, Anthropic's base64 source) comes with its decoded ``data``,
    its declared ``media_type``, its size from the header and its ``fit``, all checked by
    the adapter. A remote image (let through only when the server fetches images) has a
    ``url`` and nothing else until the server has fetched it and the adapter has checked
    the bytes (``ProtocolAdapter.check_image``).
    """

    #: The field in the request body the image came from (``messages[0].content[1].image_url.url``):
    #: errors found later (decoding, fetching) name it.
    path: str
    #: ``low``, ``high``, ``auto`` or ``original``, as the client asked (only ``low`` changes the fit).
    detail: str = "high"
    media_type: str | None = None
    data: bytes | None = attrs.field(default=None, repr=lambda data: f"<{len(data)} bytes>" if data else "None")
    #: The ``http(s)`` URL of a remote image; None for inline data.
    url: str | None = None
    #: The size in pixels its header gives (0 while a remote image is not fetched).
    width: int = 0
    height: int = 0
    #: V4.1's preprocessed size and token count (None while a remote image is not fetched).
    fit: ImageFit | None = None

    @property
    def is_remote(self) -> bool:
        """Whether this is a remote URL whose bytes are still to be fetched."""
        return self.data is None


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
    #: image's tokens (DeepSeek V4.1's image token specification); remote images count
    #: once fetched.
    image_tokens: int = 0
    #: The image parts, in placeholder order (``image_count`` of them).
    images: tuple[ImagePart, ...] = attrs.field(default=(), converter=tuple)
    #: The adapter's own parse (conversation, tools, protocol extras), JSON-like: the
    #: server never reads it; the adapter's other methods do.
    native: Mapping[str, Any] = attrs.field(factory=dict)

    @property
    def prompt_positions(self) -> int:
        """The prompt's length once each image placeholder token is expanded to its
        image's tokens: what usage reports as prompt tokens."""
        return len(self.prompt_token_ids) - self.image_count + self.image_tokens


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

    def parse_request(self, protocol: str, body: bytes, remote_images: bool = False) -> ParsedRequest:
        """A request body -> the parsed request; invalid input raises an error carrying
        ``status`` and a protocol-shaped ``body``. An ``http(s)`` image URL is such an
        error unless ``remote_images`` (the server fetches images): then it is an
        ``ImagePart`` with only its ``url``, for the server to fetch and ``check_image``."""
        ...

    def check_image(
        self, protocol: str, part: ImagePart, data: bytes, media_type: str, number: int, count: int
    ) -> ImagePart:
        """``part`` (image ``number``, from 1, of the ``count`` the request carries) with the
        ``data`` fetched for it, checked by the rules inline data is checked by (type agreeing
        with ``media_type``, size limits, the fit): the part with its data, size and fit.
        A refusal is an error carrying ``status`` and a protocol-shaped ``body``, naming
        ``part.path``."""
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

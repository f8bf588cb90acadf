"""The protocol adapter contract: request bodies in, the parsed request the server runs,
and generated text back out as a protocol's JSON body or SSE frames."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from powertrain.interfaces.outputs import RequestOutput

if TYPE_CHECKING:
    import tokenizers

#: One event of a stream parser, as a JSON-like dict with a ``type`` (``text``,
#: ``reasoning``, ``tool_call_start``, ``stopped`` with its ``stop``, ...): the adapter's
#: parser writes them and its writer reads them; the server only passes them along.
ParserEvent = Mapping[str, Any]


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

    def events(self, events: list[ParserEvent]) -> list[str]:
        """The frames for ``events``."""
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

    def parse_request(self, protocol: str, body: bytes) -> Mapping[str, Any]:
        """A request body -> the engine request (with ``prompt_token_ids``); invalid
        input raises an error carrying ``status`` and a protocol-shaped ``body``."""
        ...

    def render_response(self, protocol: str, request: Mapping[str, Any], output: RequestOutput) -> bytes:
        """A finished engine output -> the protocol's JSON response body."""
        ...

    def stream_parser(self, request: Mapping[str, Any], id_prefix: str | None = None) -> StreamParser:
        """A parser for this request's generated text (its stop sequences, its markup)."""
        ...

    def response_writer(
        self, protocol: str, request: Mapping[str, Any], request_id: str, created: int = 0, prompt_tokens: int = 0
    ) -> ResponseWriter:
        """The writer of one streamed response."""
        ...

    def finish_reason(self, events: list[ParserEvent], engine_reason: str | None) -> tuple[str, str | None]:
        """The writer's finish reason (and stop sequence) from a response's events and
        the engine's reason (``stop``, ``length``, ``abort``)."""
        ...

    def tool_call_grammar(self, request: Mapping[str, Any]) -> str | None:
        """A Lark grammar (llguidance) that makes the model write the tool call the
        request requires, in its own markup; None when none is forced."""
        ...

"""One streamed chat request, timed: TTFT, inter-token gaps, end-to-end latency, usage.

Failures (HTTP errors, malformed or cut-off streams, timeouts, refused connections)
come back as a result with `error` set, never as an exception: one bad answer must
not end a benchmark run, and the report counts them.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from powertrain.bench.sse import SSEParser


class StreamError(Exception):
    """The server's answer was not a well-formed chat completion stream."""


class ServerError(Exception):
    """The server could not be asked (listing models failed): a message for the user."""


@dataclass
class RequestResult:
    """What one request measured; times are seconds, `start` counts from the load point's start."""

    start: float
    error: str | None = None
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    e2e: float | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int | None = None  # None: the server did not report prompt_tokens_details
    usage_reported: bool = False
    text: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first: (e2e - ttft) / (output_tokens - 1)."""
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


class StreamReader:
    """Turns the `data` payloads of one stream into a RequestResult, timestamping tokens."""

    def __init__(self, sent_at: float) -> None:
        self.sent_at = sent_at
        self.token_times: list[float] = []
        self.pieces: list[str] = []
        self.usage: tuple[int, int, int | None] | None = None  # prompt, completion, cached tokens
        self.done = False

    def event(self, data: str, now: float) -> None:
        if self.done:
            raise StreamError(f"malformed stream: data after [DONE]: {_short(data)}")
        if data.strip() == "[DONE]":
            self.done = True
            return
        try:
            chunk = json.loads(data)
        except ValueError:
            raise StreamError(f"malformed stream: not JSON: {_short(data)}") from None
        if not isinstance(chunk, dict):
            raise StreamError(f"malformed stream: not a JSON object: {_short(data)}")
        if chunk.get("error"):
            raise StreamError(f"error in stream: {_error_message(chunk['error'])}")
        try:
            self._chunk(chunk, now)
        except (AttributeError, TypeError, ValueError) as exc:
            raise StreamError(f"malformed stream: unexpected chunk shape ({exc}): {_short(data)}") from None

    def _chunk(self, chunk: dict[str, Any], now: float) -> None:
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            content = delta.get("content") or ""
            # Reasoning models stream thinking first; it is output, so it times TTFT/ITL,
            # but a chat history resends only the content.
            if content or delta.get("reasoning_content") or delta.get("reasoning"):
                self.token_times.append(now)
                self.pieces.append(content)
        usage = chunk.get("usage")
        if usage:
            details = usage.get("prompt_tokens_details") or {}
            cached = details.get("cached_tokens")
            completion = int(usage.get("completion_tokens") or 0)
            self.usage = (int(usage.get("prompt_tokens") or 0), completion, None if cached is None else int(cached))

    def result(self, start: float, ended_at: float) -> RequestResult:
        if not self.done:
            raise StreamError("stream ended before data: [DONE]")
        result = RequestResult(start=start, e2e=ended_at - self.sent_at, text="".join(self.pieces))
        if self.token_times:
            result.ttft = self.token_times[0] - self.sent_at
            result.itl = [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]
        if self.usage is not None:
            result.usage_reported = True
            result.prompt_tokens, result.output_tokens, result.cached_tokens = self.usage
        else:  # no usage chunk: a content chunk is the best count of tokens there is
            result.output_tokens = len(self.token_times)
        return result


class ChatClient:
    """Streams chat completions from one OpenAI-compatible server."""

    def __init__(self, base_url: str, api_key: str | None, timeout: float) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # No connection cap: a pool limit would queue requests inside the client and
        # show up as server latency.
        self.http = httpx.AsyncClient(
            headers=headers,
            timeout=httpx.Timeout(timeout),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
        )

    async def __aenter__(self) -> ChatClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.http.aclose()

    async def first_model(self) -> str:
        """The first model GET /v1/models lists: the default when the user names none."""
        url = f"{self.base_url}/v1/models"
        try:
            response = await self.http.get(url)
            response.raise_for_status()
            models = response.json()["data"]
            return str(models[0]["id"])
        except (httpx.HTTPError, httpx.InvalidURL, OSError) as exc:
            raise ServerError(
                f"could not list models at {url}: {exc}; is the server running? (or pass --model)"
            ) from exc
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise ServerError(f"{url} did not list any model ({exc!r}); pass --model") from exc

    async def cache_counters(self) -> dict[str, float] | None:
        """The server's prefix-cache counters from its Prometheus /metrics: ``queried``
        tokens and the tokens each tier below the device served (``tier:<name>``); None
        when the server exposes none (another engine, metrics off)."""
        from prometheus_client.parser import text_string_to_metric_families

        try:
            response = await self.http.get(f"{self.base_url}/metrics")
            response.raise_for_status()
            families = list(text_string_to_metric_families(response.text))
        except (httpx.HTTPError, httpx.InvalidURL, OSError, ValueError):
            return None
        counters: dict[str, float] = {}
        for family in families:
            for sample in family.samples:
                if sample.name == "powertrain_prefix_cache_queries_total":
                    counters["queried"] = sample.value
                elif sample.name == "powertrain_prefix_cache_tier_hits_total":
                    counters[f"tier:{sample.labels['tier']}"] = sample.value
        return counters if "queried" in counters else None

    async def chat(self, body: dict[str, Any], started: float) -> RequestResult:
        """POST one streamed chat completion; `started` is the load point's perf_counter origin."""
        sent_at = time.perf_counter()
        start = sent_at - started
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        try:
            async with asyncio.timeout(self.timeout):
                return await self._stream(body, sent_at, start)
        except StreamError as exc:
            return RequestResult(start=start, error=str(exc))
        except TimeoutError:
            return RequestResult(start=start, error=f"timed out after {self.timeout:g} s")
        except UnicodeDecodeError:
            return RequestResult(start=start, error="malformed stream: not UTF-8")
        except (httpx.HTTPError, httpx.InvalidURL, OSError) as exc:
            return RequestResult(start=start, error=f"{type(exc).__name__}: {exc}")

    async def _stream(self, body: dict[str, Any], sent_at: float, start: float) -> RequestResult:
        async with self.http.stream("POST", f"{self.base_url}/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode("utf-8", "replace")
                return RequestResult(start=start, error=f"HTTP {response.status_code}: {_http_detail(detail)}")
            parser, reader = SSEParser(), StreamReader(sent_at)
            async for chunk in response.aiter_bytes():
                now = time.perf_counter()
                for data in parser.feed(chunk):
                    reader.event(data, now)
            now = time.perf_counter()
            for data in parser.close():
                reader.event(data, now)
            return reader.result(start, time.perf_counter())


def _short(text: str, limit: int = 120) -> str:
    text = " ".join(text.split())
    return repr(text if len(text) <= limit else text[:limit] + "...")


def _error_message(error: Any) -> str:
    if isinstance(error, dict) and error.get("message"):
        return str(error["message"])
    return _short(json.dumps(error))


def _http_detail(body: str) -> str:
    """The `error.message` of an OpenAI-style error body, else the start of the body."""
    try:
        return _error_message(json.loads(body)["error"])
    except (ValueError, KeyError, TypeError):
        return _short(body)

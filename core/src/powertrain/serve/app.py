"""The HTTP app: routes, limits, authentication and streaming around the engine.

Protocol work (parsing, prompt rendering, tokenizing, response JSON and SSE frames)
is the protocol adapter's; a request's errors before generation starts get the
protocol's status and error body, errors after a stream started end it with the
protocol's error event, and neither stops the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import structlog
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from powertrain.engine.async_engine import AsyncEngine
from powertrain.interfaces.errors import EngineDeadError, InvalidRequestError, RequestFailedError
from powertrain.interfaces.images import ImageInput, accepts_images
from powertrain.interfaces.protocol import ParsedRequest, ParserEvent, ProtocolAdapter
from powertrain.serve.completions import CompletionsEndpoint
from powertrain.serve.disconnect import unless_disconnected
from powertrain.serve.errors import ApiError, error_body
from powertrain.serve.generation import Generation, sampling_params
from powertrain.serve.images import ImageLoader
from powertrain.serve.metrics import ServerMetrics
from powertrain.serve.settings import ServeSettings

log = structlog.get_logger("powertrain.serve")
access_log = structlog.get_logger("powertrain.serve.access")

#: Route -> the protocol name adapters use.
GENERATION_ROUTES = {
    "/v1/chat/completions": "openai.chat",
    "/v1/responses": "openai.responses",
    "/v1/messages": "anthropic.messages",
}


def _json(status: int, body: bytes) -> Response:
    return Response(body, status_code=status, media_type="application/json")


class Server:
    """What every route shares: the engine, the adapter, settings and metrics."""

    def __init__(self, engine: AsyncEngine, adapter: ProtocolAdapter, settings: ServeSettings) -> None:
        self.engine = engine
        self.adapter = adapter
        self.settings = settings
        self.model_name = settings.served_model_name or engine.engine.model_name
        self.max_model_len = engine.engine.max_model_len
        self.sampling_defaults = engine.engine.sampling_defaults
        self.metrics = ServerMetrics(lambda: engine.stats)
        self.created = int(time.time())
        self.images = ImageLoader(adapter, settings.images)

    # ----------------------------------------------------------------------- checks

    def authenticate(self, request: Request) -> None:
        key = self.settings.api_key
        if key is None:
            return
        bearer = request.headers.get("authorization", "")
        offered = bearer[7:] if bearer.lower().startswith("bearer ") else request.headers.get("x-api-key", "")
        if not hmac.compare_digest(offered.encode(), key.encode()):
            raise ApiError(401, "missing or wrong API key: send it as 'Authorization: Bearer <key>' or 'x-api-key'")

    async def read_body(self, request: Request) -> bytes:
        """The request body, refused with 413 past the limit (before reading it all)."""
        limit = self.settings.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise ApiError(413, f"the request body has {declared} bytes; this server accepts at most {limit}")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"the request body is larger than this server's limit of {limit} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    def check_model(self, name: Any, param: str = "model") -> None:
        if name != self.model_name:
            raise ApiError(400, f"unknown model {name!r}; this server serves {self.model_name!r}", param)

    def check_prompt_length(self, num_tokens: int) -> None:
        if num_tokens >= self.max_model_len:
            raise ApiError(
                400,
                f"the prompt has {num_tokens} tokens, but this model's context holds {self.max_model_len} "
                "(prompt and output together); shorten the conversation",
                "messages",
            )

    # ----------------------------------------------------------------------- generation

    async def generate(self, protocol: str, request: Request) -> Response:
        body = await self.read_body(request)
        try:
            parsed = self.adapter.parse_request(protocol, body, **self._parse_options())
            parsed, images = await self._images(protocol, parsed)
        except Exception as exc:
            status = getattr(exc, "status", None)
            body_text = getattr(exc, "body", None)
            if status is None or body_text is None:
                raise
            return _json(status, str(body_text).encode())  # the adapter's protocol-shaped error
        self.check_prompt_length(parsed.prompt_positions)
        try:
            params = sampling_params(
                parsed, self.max_model_len, self.adapter.tool_call_grammar(parsed), self.sampling_defaults
            )
        except InvalidRequestError as exc:
            raise ApiError(400, str(exc)) from exc
        request_id = uuid.uuid4().hex[:24]
        generation = Generation(
            self.engine,
            self.metrics,
            request_id,
            list(parsed.prompt_token_ids),
            params,
            images=images,
            prompt_positions=parsed.prompt_positions,
        )
        if parsed.stream:
            return StreamingResponse(
                self._stream(protocol, parsed, generation),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        final = await unless_disconnected(request.receive, generation.final())
        if isinstance(final, Response):  # the client left: the request was aborted
            return final
        self.metrics.requests.labels(protocol, "200").inc()
        return _json(200, self.adapter.render_response(protocol, parsed, final))

    def _parse_options(self) -> dict[str, Any]:
        """``remote_images`` only where fetching is on: an adapter written before the
        keyword existed still parses every other request."""
        return {"remote_images": True} if self.settings.images.fetch else {}

    async def _images(self, protocol: str, parsed: ParsedRequest) -> tuple[ParsedRequest, list[ImageInput]]:
        """The request's model checked, then its images fetched and decoded for an engine
        that reads them (``interfaces.images.accepts_images``); for any other engine a
        request with images is a 400 naming the model, before anything is fetched."""
        self.check_model(parsed.model)
        if not parsed.image_count:
            return parsed, []
        if not accepts_images(self.engine.engine):
            known = all(part.fit is not None for part in parsed.images)
            tokens = f" ({parsed.image_tokens} prompt tokens once preprocessed for a vision encoder)" if known else ""
            raise ApiError(
                400,
                f"model {self.model_name!r} has no vision encoder and takes text only; "
                f"remove the {parsed.image_count} image part(s){tokens}",
                "messages" if protocol != "openai.responses" else "input",
            )
        return await self.images.load(protocol, parsed)

    async def _stream(self, protocol: str, parsed: ParsedRequest, generation: Generation) -> AsyncIterator[str]:
        """The SSE frames of one request: one parser and writer per choice (``n`` > 1 is
        Chat Completions only), token log-probabilities handed to each writer as they
        come, and the finish chunks, usage and terminator once every choice is done."""
        prompt_tokens = generation.prompt_positions
        n = generation.params.n
        created = int(time.time())
        writers = [
            self.adapter.response_writer(
                protocol,
                parsed,
                generation.request_id,
                created,
                prompt_tokens=prompt_tokens,
                choice_index=index,
                ends_stream=index == n - 1,
            )
            for index in range(n)
        ]
        parsers = [self.adapter.stream_parser(parsed, id_prefix=f"call_{generation.request_id}") for _ in range(n)]
        events: list[list[ParserEvent]] = [[] for _ in range(n)]
        top_logprobs = generation.params.logprobs
        logprobs_sent = [0] * n
        status = "200"
        try:
            for writer in writers:
                for frame in writer.start():
                    yield frame
            final = None
            async with contextlib.aclosing(generation.outputs()) as outputs:
                async for output, deltas in outputs:
                    final = output
                    for completion, delta in zip(output.outputs, deltas, strict=True):
                        index = completion.index
                        if top_logprobs is not None and completion.logprobs:
                            start, logprobs_sent[index] = logprobs_sent[index], len(completion.logprobs)
                            writers[index].add_logprobs(
                                self.adapter.token_logprobs(
                                    completion.token_ids[start:], completion.logprobs[start:], top_logprobs
                                )
                            )
                        if delta:
                            new = parsers[index].push(delta)
                            events[index] += new
                            for frame in writers[index].events(new):
                                yield frame
            completions = {c.index: c for c in final.outputs} if final is not None else {}
            completion_tokens = sum(len(c.token_ids) for c in completions.values())
            for index, (parser, writer) in enumerate(zip(parsers, writers, strict=True)):
                new = parser.finish()
                events[index] += new
                for frame in writer.events(new):
                    yield frame
                completion = completions.get(index)
                reason, stopped = self.adapter.finish_reason(
                    events[index], completion.finish_reason if completion else None
                )
                # Usage (written by the last choice's writer) counts every choice's tokens.
                for frame in writer.finish(
                    reason,
                    prompt_tokens,
                    completion_tokens,
                    cached_prompt_tokens=final.num_cached_tokens if final else 0,
                    stop_sequence=stopped,
                ):
                    yield frame
        except (GeneratorExit, asyncio.CancelledError):  # the client left; closing the generation aborted it
            status = "499"
            raise
        except Exception as exc:
            code = 503 if isinstance(exc, RequestFailedError) else 500  # 503: sent again, it is served
            status = str(code)
            log.error("stream failed", request_id=generation.request_id, error=f"{type(exc).__name__}: {exc}")
            yield _sse_error(protocol, code, f"generation failed: {type(exc).__name__}: {exc}")
        finally:
            self.metrics.requests.labels(protocol, status).inc()


def _sse_error(protocol: str, status: int, message: str) -> str:
    body = error_body(protocol, status, message).decode()
    return f"event: error\ndata: {body}\n\n" if protocol == "anthropic.messages" else f"data: {body}\n\n"


class AccessAndErrors:
    """Authentication, the engine's exceptions as JSON errors in each protocol's shape, and
    an access log line per request (its whole duration, streams included).

    Plain ASGI rather than ``@app.middleware("http")``: starlette's ``BaseHTTPMiddleware``
    passes every chunk of a streamed response through a memory stream and task of its own;
    at 64 streams its body stream alone held 8-9% of the event loop's samples (py-spy, the
    2-core Xeon VM), taken from the cores the engine's step runs on. HTTP/offline output
    tok/s at 64 streams went from 0.87-0.93 to 0.97-0.98 (``serve_vs_llamacpp.py``)."""

    def __init__(self, app: ASGIApp, server: Server) -> None:
        self.app = app
        self.server = server

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        path = scope["path"]
        protocol = GENERATION_ROUTES.get(path, "openai.completions")
        status: int | None = None

        async def send_noting_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            try:
                if path.startswith("/v1/"):
                    self.server.authenticate(Request(scope))
                await self.app(scope, receive, send_noting_status)
            except Exception as exc:
                if status is not None:  # the response has started: too late for another one
                    raise
                await _error_response(protocol, path, exc)(scope, receive, send_noting_status)
        finally:  # a request that ended in an exception is logged too
            if status != 200 and path in (*GENERATION_ROUTES, "/v1/completions"):
                self.server.metrics.requests.labels(protocol, str(status)).inc()
            client = scope.get("client")
            access_log.info(
                "request",
                method=scope["method"],
                path=path,
                status=status,
                duration_ms=round(1000 * (time.perf_counter() - started), 2),
                client=client[0] if client else None,
            )


def _error_response(protocol: str, path: str, exc: Exception) -> Response:
    """The error response for an exception raised before a response started."""
    if isinstance(exc, ApiError):
        return _json(exc.status, error_body(protocol, exc.status, exc.message, exc.param))
    if isinstance(exc, InvalidRequestError):  # refused by the engine (e.g. a grammar that does not compile)
        return _json(400, error_body(protocol, 400, str(exc)))
    if isinstance(exc, (EngineDeadError, RequestFailedError)):  # RequestFailedError: sent again, it is served
        return _json(503, error_body(protocol, 503, str(exc)))
    log.exception("request failed", path=path)  # a bug or an engine failure fails this request only
    return _json(500, error_body(protocol, 500, f"internal error: {type(exc).__name__}: {exc}"))


def create_app(engine: AsyncEngine, adapter: ProtocolAdapter, settings: ServeSettings | None = None) -> FastAPI:
    """The FastAPI app serving ``engine``; the caller owns the engine's lifetime."""
    server = Server(engine, adapter, settings or ServeSettings())
    completions = CompletionsEndpoint(server)
    app = FastAPI(title="powertrain", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server

    app.add_middleware(AccessAndErrors, server=server)
    app.router.add_event_handler("shutdown", server.images.aclose)

    for path, protocol in GENERATION_ROUTES.items():

        async def route(request: Request, protocol: str = protocol) -> Response:
            return await server.generate(protocol, request)

        app.add_api_route(path, route, methods=["POST"])

    @app.post("/v1/completions")
    async def legacy_completions(request: Request) -> Response:
        return await completions.handle(request)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        model = {"id": server.model_name, "object": "model", "created": server.created, "owned_by": "powertrain"}
        return JSONResponse({"object": "list", "data": [model]})

    @app.get("/health")
    async def health() -> JSONResponse:
        alive = engine.is_alive()
        return JSONResponse({"status": "ok" if alive else "engine stopped"}, status_code=200 if alive else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.exposition(), media_type="text/plain; version=0.0.4")

    return app

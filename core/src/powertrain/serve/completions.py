"""OpenAI's legacy ``POST /v1/completions``: raw prompt in, raw text out.

There is no conversation to render, so the protocol adapter has nothing to do here
(it covers chat-shaped protocols); this module reads the small request shape itself
and refuses what it does not implement instead of ignoring it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from powertrain.interfaces.errors import InvalidRequestError
from powertrain.interfaces.sampling import SamplingParams
from powertrain.serve.disconnect import unless_disconnected
from powertrain.serve.errors import ApiError
from powertrain.serve.generation import Generation

if TYPE_CHECKING:
    from powertrain.serve.app import Server

PROTOCOL = "openai.completions"
_SAMPLING = ("max_tokens", "temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "n")
#: vLLM's sampling extensions, so clients written for vLLM work unchanged: passed to
#: SamplingParams as they are, which checks each and names it in its error.
_VLLM = (
    "top_k",
    "min_p",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
    "stop_token_ids",
    "include_stop_str_in_output",
    "skip_special_tokens",
)
#: Accepted only at the value that means "off".
_OFF = {"logprobs": (None,), "echo": (False,), "suffix": (None, "")}
_KNOWN = {"model", "prompt", "stream", "stream_options", "stop", "user", "best_of", "logit_bias"}
_KNOWN |= {*_SAMPLING, *_OFF, *_VLLM}


class CompletionsEndpoint:
    def __init__(self, server: Server) -> None:
        self.server = server

    async def handle(self, request: Request) -> Response:
        server = self.server
        body = _object(await server.read_body(request))
        server.check_model(body.get("model"))
        prompt = self._prompt(body.get("prompt"))
        params = self._params(body)
        ids = prompt if isinstance(prompt, list) else server.engine.engine.tokenizer.encode(prompt)
        server.check_prompt_length(len(ids))
        request_id = f"cmpl-{uuid.uuid4().hex[:24]}"
        generation = Generation(server.engine, server.metrics, request_id, ids, params)
        if body.get("stream"):
            options = body.get("stream_options") or {}
            return StreamingResponse(
                self._stream(generation, body["model"], bool(options.get("include_usage"))),
                media_type="text/event-stream",
            )
        final = await unless_disconnected(request.receive, generation.final())
        if isinstance(final, Response):  # the client left: the request was aborted
            return final
        choices = [
            {"index": c.index, "text": c.text, "logprobs": None, "finish_reason": c.finish_reason}
            for c in final.outputs
        ]
        server.metrics.requests.labels(PROTOCOL, "200").inc()
        usage = _usage(ids, [t for c in final.outputs for t in c.token_ids])
        return Response(
            json.dumps(self._chunk(request_id, body["model"], choices, usage)), media_type="application/json"
        )

    @staticmethod
    def _prompt(prompt: Any) -> str | list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str) and prompt:
            return prompt
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and t >= 0 for t in prompt):
            return prompt
        raise ApiError(
            400, "prompt must be a non-empty string or a list of token ids (one prompt per request)", "prompt"
        )

    def _params(self, body: dict[str, Any]) -> SamplingParams:
        unknown = sorted(set(body) - _KNOWN)
        if unknown:
            raise ApiError(400, f"unknown or unsupported field {unknown[0]!r}", unknown[0])
        for field, allowed in _OFF.items():
            if field in body and body[field] is not None and body[field] not in allowed:
                raise ApiError(400, f"{field}={body[field]!r} is not supported by this server", field)
        best_of = body.get("best_of")
        if best_of is not None and best_of != body.get("n", 1):
            # Ranking candidates needs their log-probabilities, which this endpoint does not return.
            raise ApiError(
                400, f"best_of={best_of!r} is supported only equal to n (every candidate returned)", "best_of"
            )
        stop = body.get("stop")
        if stop is not None and not (
            isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop))
        ):
            raise ApiError(400, "stop must be a string or a list of strings", "stop")
        values = {key: body[key] for key in _SAMPLING if body.get(key) is not None}
        values |= _vllm_extensions(body)
        try:
            return self.server.sampling_defaults.params(
                **values, stop=stop, logit_bias=_logit_bias(body.get("logit_bias"))
            )
        except InvalidRequestError as exc:
            raise ApiError(400, str(exc)) from exc

    async def _stream(self, generation: Generation, model: str, include_usage: bool) -> AsyncIterator[str]:
        status = "200"
        try:
            final = None
            finished: set[int] = set()
            async with contextlib.aclosing(generation.outputs()) as outputs:
                async for output, deltas in outputs:
                    final = output
                    for completion, delta in zip(output.outputs, deltas, strict=True):
                        reason = completion.finish_reason if completion.index not in finished else None
                        if reason:
                            finished.add(completion.index)
                        if delta or reason:
                            choice = {"index": completion.index, "text": delta, "logprobs": None}
                            choice["finish_reason"] = reason
                            yield _sse(self._chunk(generation.request_id, model, [choice]))
            if include_usage and final is not None:
                usage = _usage(generation.prompt_ids, [t for c in final.outputs for t in c.token_ids])
                yield _sse(self._chunk(generation.request_id, model, [], usage))
            yield "data: [DONE]\n\n"
        except (GeneratorExit, asyncio.CancelledError):  # the client left
            status = "499"
            raise
        finally:
            self.server.metrics.requests.labels(PROTOCOL, status).inc()

    @staticmethod
    def _chunk(request_id: str, model: str, choices: list[dict], usage: dict | None = None) -> dict[str, Any]:
        chunk: dict[str, Any] = {
            "id": request_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": model,
            "choices": choices,
        }
        if usage is not None:
            chunk["usage"] = usage
        return chunk


def _logit_bias(value: Any) -> dict[int, Any]:
    """OpenAI's ``{"token id": bias}`` with integer keys (SamplingParams checks the biases)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ApiError(
            400, f"logit_bias must be an object mapping token ids to biases, got {json.dumps(value)}", "logit_bias"
        )
    bias = {}
    for key, amount in value.items():
        if not key.isdecimal():
            raise ApiError(400, f"logit_bias keys must be token ids (decimal integers), got {key!r}", "logit_bias")
        bias[int(key)] = amount
    return bias


def _vllm_extensions(body: dict[str, Any]) -> dict[str, Any]:
    """The vLLM fields present (null means absent), with vLLM's older ``top_k: -1`` for off."""
    values = {field: body[field] for field in _VLLM if body.get(field) is not None}
    if values.get("top_k") == -1 and not isinstance(values["top_k"], bool):
        values["top_k"] = 0
    return values


def _object(body: bytes) -> dict[str, Any]:
    try:
        value = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return value


def _usage(prompt_ids: list[int], token_ids: list[int]) -> dict[str, int]:
    return {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": len(token_ids),
        "total_tokens": len(prompt_ids) + len(token_ids),
    }


def _sse(value: dict[str, Any]) -> str:
    return f"data: {json.dumps(value)}\n\n"

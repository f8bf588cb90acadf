"""One generation request through the engine: the adapter's request -> SamplingParams,
then either the whole response body or its SSE events as tokens arrive."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator, Sequence

from powertrain.engine.async_engine import AsyncEngine
from powertrain.interfaces.images import ImageInput
from powertrain.interfaces.outputs import RequestOutput
from powertrain.interfaces.protocol import ParsedRequest
from powertrain.interfaces.sampling import SamplingDefaults, SamplingParams, StructuredOutput
from powertrain.serve.errors import ApiError
from powertrain.serve.metrics import ServerMetrics


def sampling_params(
    request: ParsedRequest,
    max_model_len: int,
    tool_call_grammar: str | None = None,
    defaults: SamplingDefaults | None = None,
) -> SamplingParams:
    """The engine's settings for a parsed request; what the server cannot honour is a 400.
    ``tool_call_grammar`` (from the adapter) forces the tool call the request requires;
    ``defaults`` (the model's own sampling settings) fill what the request leaves unset."""
    sampling = request.sampling
    logprobs = None
    if sampling.logprobs:
        if request.protocol not in ("openai.chat", "openai.responses"):
            raise ApiError(400, "logprobs are supported for Chat Completions and Responses only", "logprobs")
        logprobs = sampling.top_logprobs or 0
    prompt_tokens = len(request.prompt_token_ids)
    max_tokens = sampling.max_tokens
    if max_tokens is None:  # until the model stops or the context is full
        max_tokens = max(1, max_model_len - prompt_tokens)
    values = {
        "max_tokens": max_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "seed": sampling.seed,
        "presence_penalty": sampling.presence_penalty,
        "frequency_penalty": sampling.frequency_penalty,
        "min_p": sampling.min_p,
        "repetition_penalty": sampling.repetition_penalty,
        "min_tokens": sampling.min_tokens,
        "logprobs": logprobs,
        "n": sampling.n,
    }
    return (defaults or SamplingDefaults()).params(
        **values,
        # The engine stops at a stop string but keeps it: the adapter's parser cuts the text
        # and reports which one matched (Anthropic's stop_sequence).
        stop=sampling.stop,
        stop_token_ids=sampling.stop_token_ids,
        ignore_eos=sampling.ignore_eos,
        logit_bias=sampling.logit_bias,
        include_stop_str_in_output=True,
        skip_special_tokens=sampling.skip_special_tokens,
        structured=structured_output(request, tool_call_grammar),
    )


def structured_output(request: ParsedRequest, tool_call_grammar: str | None) -> StructuredOutput | None:
    """The request's one output constraint: a JSON response format, the structured_outputs
    extension field, or a forced tool call (two of them at once is a 400)."""
    found: list[tuple[str, StructuredOutput]] = []
    response_format = request.response_format
    if response_format.type == "json_schema":
        found.append(("response_format", StructuredOutput("json_schema", response_format.schema)))
    elif response_format.type == "json_object":
        found.append(("response_format", StructuredOutput("json_object")))
    extension = request.structured_outputs
    if extension is not None:
        kind, value = extension.type, extension.value
        if kind == "json":
            constraint = StructuredOutput("json_schema", value)
        elif kind == "regex":
            constraint = StructuredOutput("regex", value)
        elif kind == "grammar":
            constraint = StructuredOutput("lark", value)
        else:  # choice: exactly one of the strings
            constraint = StructuredOutput("lark", "start: " + " | ".join(json.dumps(c) for c in value) + "\n")
        found.append(("structured_outputs", constraint))
    if tool_call_grammar is not None:
        found.append(("tool_choice", StructuredOutput("lark", tool_call_grammar)))
    if len(found) > 1:
        raise ApiError(
            400, f"{found[0][0]} and {found[1][0]} both constrain the output; a request may use one", found[1][0]
        )
    if not found:
        return None
    constraint = found[0][1]
    constraint.check()  # refuse it now (400), not halfway through a stream
    return constraint


class Generation:
    """Runs one request on the engine and keeps the per-request metrics. ``images``: the
    decoded images of the prompt's placeholders, for an engine that reads them;
    ``prompt_positions``: the prompt's length with them expanded (default: its ids)."""

    def __init__(
        self,
        engine: AsyncEngine,
        metrics: ServerMetrics,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        images: Sequence[ImageInput] = (),
        prompt_positions: int | None = None,
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.images = list(images)
        self.prompt_positions = len(prompt_ids) if prompt_positions is None else prompt_positions
        self.arrival = time.monotonic()
        self._last_token_time: float | None = None
        self._tokens_seen = 0

    async def outputs(self) -> AsyncIterator[tuple[RequestOutput, list[str]]]:
        """Each engine output with the text it added to each of its completions (the
        ``n`` choices, in index order)."""
        texts = [""] * self.params.n
        images = {"images": self.images} if self.images else {}
        async for output in self.engine.generate(self.prompt_ids, self.params, request_id=self.request_id, **images):
            self._observe(output)
            deltas = []
            for completion in output.outputs:
                deltas.append(completion.text[len(texts[completion.index]) :])
                texts[completion.index] = completion.text
            yield output, deltas
        self.metrics.prompt_tokens.inc(self.prompt_positions)

    async def final(self) -> RequestOutput:
        """Run to the end; the last output (a 503 if the server aborted it on shutdown)."""
        final = None
        async with contextlib.aclosing(self.outputs()) as outputs:
            async for output, _ in outputs:
                final = output
        if final is None or any(completion.finish_reason == "abort" for completion in final.outputs):
            raise ApiError(503, "the request was aborted: the server is shutting down")
        return final

    def _observe(self, output: RequestOutput) -> None:
        now = time.monotonic()
        count = sum(len(completion.token_ids) for completion in output.outputs)
        new = count - self._tokens_seen
        if new <= 0:
            return
        if self._last_token_time is None:
            self.metrics.time_to_first_token.observe(now - self.arrival)
            new -= 1  # the first token has no gap before it
        else:
            gap = (now - self._last_token_time) / new
            for _ in range(new):
                self.metrics.inter_token_latency.observe(gap)
        self.metrics.generation_tokens.inc(count - self._tokens_seen)
        self._tokens_seen = count
        self._last_token_time = now

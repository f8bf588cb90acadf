"""The adapter object the server and engine hold for one model."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

from powertrain.interfaces import (
    ImageFit,
    ImagePart,
    ModelTokenizer,
    ParsedRequest,
    ParserEvent,
    RequestOutput,
    RequestSampling,
    ResponseFormat,
    StructuredOutputsField,
)
from powertrain_recipe._native import PromptEncoder, ResponseWriter, StreamParser, check_image, parse_request_json
from powertrain_recipe.grammar import forced_call, tool_call_grammar, tool_syntax

#: Protocol names as the core's ProtocolAdapterRecord spells them -> the native names.
PROTOCOLS = {
    "openai.chat": "chat_completions",
    "openai.responses": "responses",
    "anthropic.messages": "anthropic_messages",
}


#: The native names -> the core's (a parsed request is answered in the core's name).
CORE_PROTOCOLS = {native: core for core, native in PROTOCOLS.items()}


def _native_protocol(protocol: str) -> str:
    return PROTOCOLS.get(protocol, protocol)


def image_part(native: Mapping[str, Any]) -> ImagePart:
    """The core's record of one of a native parse's ``image_parts``."""
    fit = native.get("fit")
    return ImagePart(
        path=native["path"],
        detail=native["detail"],
        media_type=native.get("media_type"),
        data=native.get("data"),
        url=native.get("url"),
        width=native["width"],
        height=native["height"],
        fit=None if fit is None else ImageFit(**fit),
    )


def parsed_request(native: dict[str, Any], prompt: str, prompt_token_ids: list[int]) -> ParsedRequest:
    """The core's typed record of a native parse (``parse_request``'s dict) and its prompt.
    The image parts (with their decoded bytes) move out of ``native`` into ``images``."""
    images = tuple(image_part(part) for part in native.pop("image_parts", ()))
    sampling = native["sampling"]
    response_format = native.get("response_format") or {"type": "text"}
    extension = native.get("structured_outputs")
    return ParsedRequest(
        protocol=CORE_PROTOCOLS[native["protocol"]],
        model=native["model"],
        prompt=prompt,
        prompt_token_ids=prompt_token_ids,
        image_count=native.get("images", 0),
        image_tokens=sum(fit["tokens"] for fit in native.get("image_fits", ())),
        images=images,
        sampling=RequestSampling(
            temperature=sampling.get("temperature"),
            top_p=sampling.get("top_p"),
            top_k=sampling.get("top_k"),
            max_tokens=sampling.get("max_tokens"),
            stop=tuple(sampling.get("stop") or ()),
            seed=sampling.get("seed"),
            n=sampling.get("n", 1),
            logprobs=bool(sampling.get("logprobs")),
            top_logprobs=sampling.get("top_logprobs"),
            presence_penalty=sampling.get("presence_penalty"),
            frequency_penalty=sampling.get("frequency_penalty"),
            logit_bias=tuple((token, bias) for token, bias in sampling.get("logit_bias") or ()),
            min_p=sampling.get("min_p"),
            repetition_penalty=sampling.get("repetition_penalty"),
            min_tokens=sampling.get("min_tokens"),
            ignore_eos=bool(sampling.get("ignore_eos")),
            stop_token_ids=tuple(sampling.get("stop_token_ids") or ()),
            include_stop_str_in_output=bool(sampling.get("include_stop_str_in_output")),
            skip_special_tokens=bool(sampling.get("skip_special_tokens", True)) and not _may_call_tools(native),
        ),
        stream=bool(native.get("stream")),
        response_format=ResponseFormat(type=response_format["type"], schema=response_format.get("schema")),
        structured_outputs=None
        if extension is None
        else StructuredOutputsField(type=extension["type"], value=extension["value"]),
        native=native,
    )


def _may_call_tools(native: Mapping[str, Any]) -> bool:
    """Whether the answer may hold tool-call markup, which the parser must see whole: some
    tokenizers mark tool-call tokens special, so skipping special tokens would erase the
    calls (vLLM's tool parsers keep special tokens for such requests too)."""
    conversation = native.get("conversation") or {}
    return bool(conversation.get("tools")) and (conversation.get("tool_choice") or {}).get("type") != "none"


def parse_request(protocol: str, body: bytes | str) -> dict[str, Any]:
    """A request body -> the engine request as a dict (raises RecipeError with .status/.path/.body)."""
    data = body.encode() if isinstance(body, str) else body
    return json.loads(parse_request_json(_native_protocol(protocol), data))


def output_format(model_config: Mapping[str, Any]) -> str:
    """Which markup the model writes, from its config.json."""
    model_type = str(model_config.get("model_type", ""))
    architectures = " ".join(model_config.get("architectures") or [])
    if model_type in ("deepseek_v4", "deepseek_v41", "deepseek_v32") or any(
        name in architectures for name in ("DeepseekV4", "DeepseekV32")
    ):
        return "deepseek_v4"
    if model_type in ("deepseek_v3", "deepseek_v2") or "Deepseek" in architectures:
        return "deepseek_v3"
    return "plain"


class RecipeAdapter:
    """Implements ``powertrain.interfaces.ProtocolAdapter`` for one model.

    Built from what a loaded checkpoint has: its tokenizer.json text, tokenizer
    config (chat template, bos/eos) and config.json.
    """

    protocols = frozenset(PROTOCOLS)

    def __init__(self, tokenizer_json: str, tokenizer_config: Mapping[str, Any], model_config: Mapping[str, Any]):
        self.encoder = PromptEncoder(tokenizer_json, json.dumps(dict(tokenizer_config)), json.dumps(dict(model_config)))
        self.output_format = output_format(model_config)
        #: How a plain model writes a tool call (its chat template's form, else vLLM's JSON).
        self.tool_syntax = tool_syntax(_chat_template_text(tokenizer_config.get("chat_template")))
        self._tokenizer_json = tokenizer_json
        self._token_texts: dict[int, str] = {}
        self._decoder: Any = None  # a tokenizers.Tokenizer, built when logprobs are first asked for

    @classmethod
    def for_tokenizer(cls, tokenizer: ModelTokenizer, model_config: Mapping[str, Any]) -> RecipeAdapter:
        """From the loaded model's tokenizer and config.json."""
        config = {
            "chat_template": tokenizer.chat_template,
            "bos_token": tokenizer.bos_token,
            "eos_token": tokenizer.eos_token,
        }
        return cls(tokenizer.backend.to_str(), config, model_config)

    def parse_request(self, protocol: str, body: bytes, remote_images: bool = False) -> ParsedRequest:
        """Parse, render and tokenize: the request, its prompt and the prompt's tokens.
        ``remote_images``: an ``http(s)`` image URL becomes a part to fetch, not a 400."""
        native, prompt, ids = self.encoder.prompt(_native_protocol(protocol), body, remote_images=remote_images)
        return parsed_request(native, prompt, ids)

    @staticmethod
    def check_image(protocol: str, part: ImagePart, data: bytes, media_type: str, number: int, count: int) -> ImagePart:
        """A fetched remote image checked by the rules inline data is checked by
        (``check_image`` in Rust); raises RecipeError naming ``part.path``."""
        checked = check_image(
            _native_protocol(protocol), data, media_type, part.path, part.detail, number=number, count=count
        )
        return ImagePart(
            path=part.path,
            detail=part.detail,
            media_type=media_type,
            data=data,
            url=part.url,
            width=checked["width"],
            height=checked["height"],
            fit=ImageFit(**checked["fit"]),
        )

    def stream_parser(self, request: ParsedRequest, id_prefix: str | None = None) -> StreamParser:
        """A parser for this request's generated text (its stop sequences), starting where
        the prompt left the answer: in reasoning when it opened a thinking block, in a
        tool-call block when it opened one; a plain model's output read as the tool call
        the request forced, in the form ``tool_call_grammar`` held it to. With
        include_stop_str_in_output the parser is given no stop strings, so it leaves the
        matched one in the text."""
        sampling = request.sampling
        forced, tool_name = forced_call(self.output_format, self.tool_syntax, request.native) or (None, None)
        return StreamParser(
            self.output_format,
            [] if sampling.include_stop_str_in_output else list(sampling.stop),
            id_prefix=id_prefix,
            prompt=request.prompt,
            forced_call=forced,
            tool_name=tool_name,
        )

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
        """The writer of one response: its JSON body, or its SSE events as text arrives."""
        return ResponseWriter(
            _native_protocol(protocol),
            request_id,
            request.model,
            created,
            include_usage=bool(request.native.get("include_usage", False)),
            prompt_tokens=prompt_tokens,
            reasoning_summary=request.native.get("reasoning_summary") is not None,
            choice_index=choice_index,
            ends_stream=ends_stream,
        )

    def tool_call_grammar(self, request: ParsedRequest) -> str | None:
        """A Lark grammar forcing the tool call the request requires, in this model's syntax,
        its arguments following the tool's schema (see ``grammar``); None when nothing is
        forced (or, for DeepSeek-V3 with ``auto`` and strict tools, a grammar that keeps a
        call well formed)."""
        return tool_call_grammar(self.output_format, request.native, prompt=request.prompt, syntax=self.tool_syntax)

    def token_logprobs(
        self, token_ids: Sequence[int], logprobs: Sequence[Mapping[int, float]], top: int
    ) -> list[dict[str, Any]]:
        """Each generated token with its logprob and the ``top`` most likely tokens (the
        model's distribution, as the engine reports it): Chat Completions'
        ``logprobs.content`` and Responses' ``output_text.logprobs`` share this shape."""
        content = []
        for token, candidates in zip(token_ids, logprobs, strict=False):
            ranked = sorted(candidates.items(), key=lambda item: -item[1])[:top]
            content.append(
                {
                    **self._token_entry(token, candidates[token]),
                    "top_logprobs": [self._token_entry(t, lp) for t, lp in ranked],
                }
            )
        return content

    def _token_entry(self, token: int, logprob: float) -> dict[str, Any]:
        text = self._token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    def _token_text(self, token: int) -> str:
        """One token's text as the tokenizer decodes it alone (cached)."""
        text = self._token_texts.get(token)
        if text is None:
            if self._decoder is None:
                from tokenizers import Tokenizer

                self._decoder = Tokenizer.from_str(self._tokenizer_json)
            text = self._token_texts[token] = self._decoder.decode([token], skip_special_tokens=False)
        return text

    @staticmethod
    def finish_reason(events: Sequence[ParserEvent], engine_reason: str | None) -> tuple[str, str | None]:
        return finish_reason(events, engine_reason)

    def render_response(self, protocol: str, request: ParsedRequest, output: RequestOutput) -> bytes:
        """A finished engine output -> the protocol's JSON body.

        Every completion of the output becomes one choice (``n`` > 1, Chat Completions
        only); usage counts the prompt once and the completion tokens of all choices.
        """
        native = _native_protocol(protocol)
        # The engine reports the prompt as sent, one placeholder token per image: usage
        # counts the positions each image's tokens take instead.
        prompt_tokens = len(output.prompt_token_ids) - request.image_count + request.image_tokens
        cached = output.num_cached_tokens
        bodies = []
        for completion in output.outputs:
            parser = self.stream_parser(request, id_prefix=f"call_{output.request_id}")
            events = parser.push(completion.text) + parser.finish()
            writer = self.response_writer(
                protocol, request, str(output.request_id), int(time.time()), prompt_tokens=prompt_tokens
            )
            writer.events(events)
            if request.sampling.logprobs and completion.logprobs:
                top = request.sampling.top_logprobs or 0
                writer.add_logprobs(self.token_logprobs(completion.token_ids, completion.logprobs, top))
            reason, stopped = finish_reason(events, completion.finish_reason)
            body = writer.response(
                reason,
                prompt_tokens,
                len(completion.token_ids),
                cached_prompt_tokens=cached,
                stop_sequence=stopped,
            )
            bodies.append(json.loads(body))
        if len(bodies) == 1:
            return json.dumps(bodies[0]).encode()
        if native != "chat_completions":
            raise ValueError(f"{protocol} has one output per response, got {len(bodies)}")
        merged = bodies[0]
        merged["choices"] = [{**body["choices"][0], "index": i} for i, body in enumerate(bodies)]
        usage = merged["usage"]
        usage["completion_tokens"] = sum(body["usage"]["completion_tokens"] for body in bodies)
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        return json.dumps(merged).encode()


def _chat_template_text(template: Any) -> str | None:
    """The chat template the encoder renders with: tokenizer_config.json's ``chat_template``
    string, or from a list of named templates the one named "default", else the first."""
    if isinstance(template, str):
        return template
    if isinstance(template, list):
        named = [item for item in template if isinstance(item, Mapping) and isinstance(item.get("template"), str)]
        chosen = next((item for item in named if item.get("name") == "default"), named[0] if named else None)
        return chosen["template"] if chosen else None
    return None


def finish_reason(events: Sequence[ParserEvent], engine_reason: str | None) -> tuple[str, str | None]:
    """The writer's finish reason from all of a response's parser events and the engine's
    reason ("stop", "length", "abort"); with the stop sequence that ended it, if any."""
    stopped = next((e["stop"] for e in events if e["type"] == "stopped"), None)
    if stopped is not None:
        return "stop_sequence", stopped
    if engine_reason == "length":
        return "length", None
    if any(e["type"] == "tool_call_start" for e in events):
        return "tool_calls", None
    return "stop", None

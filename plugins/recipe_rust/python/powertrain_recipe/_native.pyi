"""Type stubs of the Rust extension (src/python.rs)."""

from typing import Any

class RecipeError(Exception):
    status: int
    path: str
    body: str

def parse_request_json(protocol_name: str, body: bytes) -> str: ...
def image_fit(width: int, height: int, detail: str = "high") -> tuple[int, int, int]: ...
def image_tokens(width: int, height: int) -> int: ...
def check_image(
    protocol_name: str,
    data: bytes,
    media_type: str,
    path: str,
    detail: str = "high",
    number: int = 1,
    count: int = 1,
) -> dict[str, Any]: ...

class PromptEncoder:
    def __init__(self, tokenizer_json: str, tokenizer_config_json: str, model_config_json: str = "{}") -> None: ...
    def prompt(
        self, protocol_name: str, body: bytes, add_generation_prompt: bool = True, remote_images: bool = False
    ) -> tuple[dict[str, Any], str, list[int]]: ...
    def render_request(self, request_json: str, add_generation_prompt: bool = True) -> tuple[str, list[int]]: ...
    def special_tokens(self) -> list[str]: ...
    def special_token_ids(self) -> list[int]: ...

class StreamParser:
    def __init__(
        self,
        format: str,
        stop: list[str] = ...,
        id_prefix: str | None = None,
        prompt: str | None = None,
        forced_call: str | None = None,
        tool_name: str | None = None,
    ) -> None: ...
    def push(self, text: str) -> list[dict[str, Any]]: ...
    def push_bytes(self, data: bytes) -> list[dict[str, Any]]: ...
    def finish(self) -> list[dict[str, Any]]: ...

class ResponseWriter:
    def __init__(
        self,
        protocol_name: str,
        id: str,
        model: str,
        created: int,
        include_usage: bool = False,
        prompt_tokens: int = 0,
        cached_prompt_tokens: int = 0,
        reasoning_summary: bool = False,
        choice_index: int = 0,
        ends_stream: bool = True,
    ) -> None: ...
    def start(self) -> list[str]: ...
    def add_logprobs(self, entries: list[dict[str, Any]]) -> None: ...
    def events(self, events: list[dict[str, Any]]) -> list[str]: ...
    def finish(
        self,
        reason: str,
        prompt_tokens: int,
        completion_tokens: int,
        cached_prompt_tokens: int = 0,
        reasoning_tokens: int = 0,
        stop_sequence: str | None = None,
    ) -> list[str]: ...
    def response(
        self,
        reason: str,
        prompt_tokens: int,
        completion_tokens: int,
        cached_prompt_tokens: int = 0,
        reasoning_tokens: int = 0,
        stop_sequence: str | None = None,
    ) -> str: ...

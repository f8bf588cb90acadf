"""Errors the server itself raises (auth, limits, unknown model), in each protocol's shape.

Request validation errors come from the protocol adapter with their body already
shaped; these are the few the server decides on its own.
"""

from __future__ import annotations

import json

#: HTTP status -> (OpenAI error type, Anthropic error type).
_TYPES = {
    400: ("invalid_request_error", "invalid_request_error"),
    401: ("authentication_error", "authentication_error"),
    404: ("not_found_error", "not_found_error"),
    413: ("invalid_request_error", "request_too_large"),
    500: ("server_error", "api_error"),
    503: ("server_error", "overloaded_error"),
}


class ApiError(Exception):
    """An HTTP error with a message for the client and, optionally, the field at fault."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def error_body(protocol: str, status: int, message: str, param: str | None = None) -> bytes:
    """The JSON error body ``protocol`` clients expect (Anthropic's for
    anthropic.messages, OpenAI's for everything else)."""
    openai_type, anthropic_type = _TYPES.get(status, ("server_error", "api_error"))
    if protocol == "anthropic.messages":
        body: dict = {"type": "error", "error": {"type": anthropic_type, "message": message}}
    else:
        body = {"error": {"message": message, "type": openai_type, "param": param, "code": None}}
    return json.dumps(body).encode()

"""Errors a caller can cause, and the engine's own death. Each says what was wrong and
what to do instead. Part of the contract: a protocol adapter, a server or a plugin's
tool tells them apart (a refused request is a 400, a dead engine a 503)."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request the engine refuses (bad parameters, empty or too long prompt).

    Raised before the request enters the engine, so other requests are unaffected.
    """


class EngineDeadError(RuntimeError):
    """The engine loop failed; no further requests can be served by this engine."""


class RequestFailedError(RuntimeError):
    """One request failed where it ran (the rank serving it died); the engine serves on,
    and the same request sent again is served by another rank."""

"""Errors a caller can cause. Each says what was wrong and what to do instead."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request the engine refuses (bad parameters, empty or too long prompt).

    Raised before the request enters the engine, so other requests are unaffected.
    """


class EngineDeadError(RuntimeError):
    """The engine loop failed; no further requests can be served by this engine."""

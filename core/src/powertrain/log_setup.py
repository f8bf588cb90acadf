"""Configuring structlog, for entry points only (the CLI, benchmark scripts, spawned
worker processes): library code, ``LLM`` included, just calls
``structlog.get_logger(__name__)`` and leaves the configuration to the application."""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

#: The level last configured here (worker processes start with the same).
current_level = "warning"


def configure_logging(level: str = "warning", *, only_if_unconfigured: bool = False, json: bool | None = None) -> None:
    """Pretty logs on a terminal, JSON lines otherwise (or as ``json`` says); always on stderr.

    ``only_if_unconfigured`` leaves an application's own structlog setup alone.
    """
    global current_level
    if only_if_unconfigured and structlog.is_configured():
        return
    current_level = level
    pretty = sys.stderr.isatty() if json is None else not json
    renderer: Any = structlog.dev.ConsoleRenderer() if pretty else structlog.processors.JSONRenderer()
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[level.upper()]),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=False,
    )

"""Start-up phases, timed: one info line each, and a transient status line on a terminal.

A first answer should come in seconds; when it does not, ``--log-level info`` says which
phase took the time (``startup phase`` lines with ``seconds``), and a user at a terminal sees
which phase is running instead of a silent wait.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import structlog

log = structlog.get_logger(__name__)


@contextlib.contextmanager
def phase(name: str, *, status: bool = True, **fields: Any) -> Iterator[None]:
    """Time the ``with`` body as start-up phase ``name`` (extra ``fields`` go on its log line).

    ``status=False`` for a phase that draws its own progress bar (one live display at a time).
    """
    started = time.perf_counter()
    with _status(name) if status else contextlib.nullcontext():
        yield
    log.info("startup phase", phase=name, seconds=round(time.perf_counter() - started, 3), **fields)


def since_process_start() -> float | None:
    """Wall seconds since this process started (interpreter start-up and imports included),
    or None where the OS does not say (read from /proc on Linux)."""
    try:
        with open(f"/proc/{os.getpid()}/stat") as stat:
            start_ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as uptime:
            uptime_s = float(uptime.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return uptime_s - start_ticks / os.sysconf("SC_CLK_TCK")


def _status(name: str) -> contextlib.AbstractContextManager[Any]:
    if not sys.stderr.isatty():
        return contextlib.nullcontext()
    from rich.console import Console

    return Console(file=sys.stderr).status(f"{name}…", spinner="dots")

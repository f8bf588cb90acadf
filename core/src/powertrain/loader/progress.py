"""A progress bar around weight loading: long loads should not look like a hang."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

T = TypeVar("T")


def with_progress(items: Iterable[T], *, total: int, description: str) -> Iterator[T]:
    """Yield ``items`` while a transient bar on stderr counts them.

    Only drawn when stderr is a terminal: logs and pipes get no control characters.
    """
    console = Console(file=sys.stderr)
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=not console.is_terminal,
    )
    with progress:
        task = progress.add_task(description, total=total)
        for item in items:
            yield item
            progress.advance(task)

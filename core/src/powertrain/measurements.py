"""Per-machine measurements kept in small JSON files in the user's cache folder (which
linear runs a weight shape, from how many rows a kernel's dense route wins): read without
being trusted, replaced atomically. A file that cannot be read or is not in the format
asked for is measured over, with a warning; one that cannot be written only costs
measuring again next time."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import structlog

log = structlog.get_logger(__name__)


def cache_folder() -> Path:
    """``$POWERTRAIN_CACHE_DIR``, else ``$XDG_CACHE_HOME/powertrain``, else ``~/.cache/powertrain``."""
    root = os.environ.get("POWERTRAIN_CACHE_DIR")
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME")
        root = str(Path(xdg if xdg else Path.home() / ".cache") / "powertrain")
    return Path(root)


@attrs.frozen
class MeasurementFile:
    """One file of measurements in ``cache_folder()``: ``{"format": version, "choices":
    {key: entry}}``, each key naming what its entry's timing depends on (CPU, torch, threads,
    shape...). ``valid`` says whether an entry is one this format holds; ``what`` names the
    file in log lines."""

    name: str
    version: int
    valid: Callable[[Any], bool]
    what: str

    @property
    def path(self) -> Path:
        return cache_folder() / self.name

    def entries(self, wanted: Mapping[str, Callable[[], Any]]) -> tuple[dict[str, Any], bool]:
        """Each key of ``wanted`` with its entry: the cached one, else measured now by its
        callable (the new entries are written together); and whether any was measured."""
        path = self.path
        cached = self._read(path)
        fresh = {key: measure() for key, measure in wanted.items() if key not in cached}
        if fresh:
            self._write(path, {**cached, **fresh})
        return {key: fresh[key] if key in fresh else cached[key] for key in wanted}, bool(fresh)

    def _read(self, path: Path) -> dict[str, Any]:
        """The file's entries, or none when it is missing, unreadable, of another format, or
        holds an entry ``valid`` refuses."""
        try:
            text = path.read_text()
        except (FileNotFoundError, NotADirectoryError):  # nothing cached yet (writing says if it cannot be)
            return {}
        except (OSError, UnicodeDecodeError) as error:
            log.warning(f"{self.what} unreadable; measuring again", path=str(path), error=str(error))
            return {}
        try:
            data = json.loads(text)
            entries = data["choices"]
            if data.get("format") != self.version or not isinstance(entries, dict):
                raise ValueError(f"not a format-{self.version} {self.what}")
            if not all(self.valid(entry) for entry in entries.values()):
                raise ValueError("an entry without a known choice and its times")
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            log.warning(f"{self.what} corrupt; ignoring it and measuring again", path=str(path), error=str(error))
            return {}
        return entries

    def _write(self, path: Path, entries: dict[str, Any]) -> None:
        """Replace the file atomically (a reader sees the old file or the new one)."""
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
            try:
                with os.fdopen(fd, "w") as file:
                    json.dump({"format": self.version, "choices": entries}, file, indent=1, sort_keys=True)
                os.replace(tmp, path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        except OSError as error:
            log.warning(f"{self.what} not written; measuring again next time", path=str(path), error=str(error))

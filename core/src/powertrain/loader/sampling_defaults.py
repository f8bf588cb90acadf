"""The sampling defaults a model brings ([model] generation_config): what a request that
leaves temperature, top_p, top_k, min_p or repetition_penalty unset gets.

vLLM reads a checkpoint's ``generation_config.json`` this way unless told not to; a
model's authors pick those values for it, and the sampler's plain defaults (temperature
1, no filter) make a small model ramble.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import structlog

from powertrain.interfaces.errors import InvalidRequestError
from powertrain.interfaces.sampling import SamplingDefaults
from powertrain.loader.checkpoint import Checkpoint
from powertrain.loader.errors import CorruptCheckpointError, LoadError
from powertrain.loader.hf import read_json

log = structlog.get_logger(__name__)

#: ``[model] generation_config`` values that are not paths.
FROM_CHECKPOINT, OFF = "auto", "none"


def sampling_defaults(setting: str, checkpoint: Checkpoint) -> SamplingDefaults:
    """``setting``: "auto" (the checkpoint's own: an HF folder's generation_config.json, a
    GGUF file's ``general.sampling.*``, an embedded model's recommended settings), "none"
    (``SamplingParams``' defaults) or the path of a generation_config.json (or its folder).
    Logged at info: which values, from where."""
    if setting == OFF:
        defaults = SamplingDefaults(source='powertrain\'s defaults ([model] generation_config = "none")')
    elif setting == FROM_CHECKPOINT and not checkpoint.generation_config:
        defaults = SamplingDefaults(source="powertrain's defaults (the checkpoint recommends no sampling settings)")
    elif setting == FROM_CHECKPOINT:
        defaults = _checked(checkpoint.generation_config, checkpoint.generation_source)
    else:
        path = Path(setting).expanduser()
        if path.is_dir():
            path = path / "generation_config.json"
        if not path.is_file():
            raise LoadError(
                f"[model] generation_config = {setting!r}: {path} is not a file. Give a generation_config.json "
                'or the folder holding one, "auto" for the checkpoint\'s own settings, or "none".'
            )
        defaults = _checked(read_json(path, required=True), str(path))
    log.info("sampling defaults", source=defaults.source, **defaults.values)
    return defaults


def _checked(config: Mapping[str, Any], source: str) -> SamplingDefaults:
    try:
        return SamplingDefaults.from_generation_config(config, source)
    except InvalidRequestError as exc:
        raise CorruptCheckpointError(
            f'{exc}. Fix the file, or set [model] generation_config = "none" to use powertrain\'s defaults.'
        ) from exc

"""powertrain: an open, pluggable LLM inference engine.

The public API: ``LLM``, ``SamplingParams`` and ``StructuredOutput`` for offline generation,
``AsyncEngine`` for streaming, ``hookimpl`` for plugin authors (with the records in
``powertrain.components`` and the hot-path contracts in ``powertrain.interfaces``).
The engine names are imported on first use, so ``import powertrain`` stays cheap
for plugins and the CLI.
"""

from importlib import import_module
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from powertrain.hookspecs import HOOK_API_VERSION, hookimpl

try:
    __version__ = version("powertrain")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0"

_LAZY = {
    "LLM": "powertrain.llm",
    "SamplingParams": "powertrain.engine.sampling_params",
    "StructuredOutput": "powertrain.engine.structured",
    "RequestOutput": "powertrain.engine.sequence",
    "CompletionOutput": "powertrain.engine.sequence",
    "AsyncEngine": "powertrain.engine.async_engine",
    "InvalidRequestError": "powertrain.engine.errors",
}

__all__ = ["HOOK_API_VERSION", "__version__", "hookimpl", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'powertrain' has no attribute {name!r}")

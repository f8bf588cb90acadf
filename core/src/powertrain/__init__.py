"""powertrain: an open, pluggable LLM inference engine.

The public API: ``LLM`` (configured by keywords or an ``EngineConfig``), ``SamplingParams``
and ``StructuredOutput`` for offline generation, ``AsyncEngine`` for streaming, the typed
errors ``InvalidRequestError``, ``RequestFailedError`` and ``EngineDeadError``, and ``hookimpl`` for plugin authors
(with the records in ``powertrain.components`` and the contracts in ``powertrain.interfaces``).
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
    "EngineConfig": "powertrain.config",
    "SamplingParams": "powertrain.interfaces.sampling",
    "StructuredOutput": "powertrain.interfaces.sampling",
    "RequestOutput": "powertrain.interfaces.outputs",
    "CompletionOutput": "powertrain.interfaces.outputs",
    "AsyncEngine": "powertrain.engine.async_engine",
    "InvalidRequestError": "powertrain.interfaces.errors",
    "EngineDeadError": "powertrain.interfaces.errors",
    "RequestFailedError": "powertrain.interfaces.errors",
}

__all__ = ["HOOK_API_VERSION", "__version__", "hookimpl", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'powertrain' has no attribute {name!r}")

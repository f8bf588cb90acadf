"""powertrain: an open, pluggable LLM inference engine.

The public API. Plugin authors need ``hookimpl`` and the records in
``powertrain.components``; the hot-path contracts are in ``powertrain.interfaces``.
"""

from importlib.metadata import PackageNotFoundError, version

from powertrain.hookspecs import HOOK_API_VERSION, hookimpl

try:
    __version__ = version("powertrain")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0"

__all__ = ["HOOK_API_VERSION", "__version__", "hookimpl"]

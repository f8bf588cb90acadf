"""``powertrain serve``: the engine behind OpenAI- and Anthropic-compatible HTTP APIs.

Requests are parsed, rendered and tokenized, and responses and SSE streams written,
by the protocol adapter (powertrain-recipe); this package does HTTP, streaming,
limits, authentication and metrics around it.
"""

from powertrain.serve.app import create_app
from powertrain.serve.settings import ServeSettings

__all__ = ["ServeSettings", "create_app"]

"""What the server is configured with (CLI flags, environment)."""

from __future__ import annotations

import attrs

from powertrain.config import ImagesConfig

#: The environment variable that holds the API key when --api-key is not given.
API_KEY_ENV = "POWERTRAIN_API_KEY"


@attrs.frozen(kw_only=True)
class ServeSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    #: Requests must carry it (``Authorization: Bearer`` or ``x-api-key``) when set.
    api_key: str | None = None
    #: The model name clients send and /v1/models lists (default: the engine's model).
    served_model_name: str | None = None
    #: Larger request bodies are refused with 413.
    max_body_bytes: int = 4 * 2**20
    #: In-flight requests get this long to finish on shutdown before they are aborted.
    graceful_shutdown_s: float = 10.0
    #: How image parts are fetched and decoded (engine.toml's ``[server.images]``).
    images: ImagesConfig = ImagesConfig()

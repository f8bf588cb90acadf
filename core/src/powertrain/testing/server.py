"""A real ``powertrain serve`` app on a free localhost port, in a background thread,
for end-to-end tests that talk HTTP to it (SDK clients, the serving benchmark)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

import uvicorn

from powertrain.engine.async_engine import AsyncEngine
from powertrain.serve.app import create_app
from powertrain.serve.settings import ServeSettings


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def running_server(engine: AsyncEngine, adapter: Any, settings: ServeSettings | None = None) -> Iterator[str]:
    """Serve ``engine`` (owned by the caller) until the block ends; yields the base URL."""
    settings = settings or ServeSettings()
    port = free_port()
    app = create_app(engine, adapter, settings)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host="127.0.0.1",
            port=port,
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=settings.graceful_shutdown_s,
        )
    )
    thread = threading.Thread(target=server.run, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the test server on port {port} did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@contextlib.contextmanager
def serving(overrides: Mapping[str, Any], settings: ServeSettings | None = None) -> Iterator[str]:
    """An engine built from ``EngineConfig`` with ``overrides`` (``LLM``'s keywords), its
    protocol adapter and a server on it, for the block; yields the base URL."""
    from powertrain.assemble import build_engine
    from powertrain.config import EngineConfig
    from powertrain.llm import apply_overrides
    from powertrain.plugins import PluginManager
    from powertrain.serve.run import protocol_adapter

    config = apply_overrides(EngineConfig(), overrides)
    plugins = PluginManager.load(config.plugins)
    engine = AsyncEngine(build_engine(config, plugins))
    try:
        adapter = protocol_adapter(plugins, engine.engine.tokenizer, engine.engine.model_config)
        with running_server(engine, adapter, settings) as url:
            yield url
    finally:
        engine.shutdown()

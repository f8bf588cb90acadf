"""``powertrain serve``: build the engine, pick the protocol adapter, run uvicorn."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import structlog
import uvicorn

from powertrain.config import EngineConfig
from powertrain.engine.async_engine import AsyncEngine
from powertrain.interfaces.protocol import ModelTokenizer, ProtocolAdapter
from powertrain.plugins import PluginManager
from powertrain.serve.app import GENERATION_ROUTES, create_app
from powertrain.serve.settings import ServeSettings

log = structlog.get_logger("powertrain.serve")


class NoProtocolAdapterError(RuntimeError):
    pass


def protocol_adapter(
    plugins: PluginManager, tokenizer: ModelTokenizer, model_config: Mapping[str, Any]
) -> ProtocolAdapter:
    """The highest-priority protocol adapter that speaks every generation protocol."""
    needed = set(GENERATION_ROUTES.values())
    candidates = [p for p in plugins.records("protocol") if needed <= set(p.record.protocols)]
    if not candidates:
        raise NoProtocolAdapterError(
            f"no installed protocol adapter covers {sorted(needed)}; install powertrain-recipe "
            "(pip install powertrain-recipe)"
        )
    chosen = max(candidates, key=lambda p: p.record.priority)
    log.info("protocol adapter", name=chosen.record.name, plugin=chosen.plugin.name)
    return chosen.record.factory(tokenizer, model_config)


def serve(config: EngineConfig, settings: ServeSettings) -> None:
    """Serve until interrupted; in-flight requests get ``graceful_shutdown_s`` to finish."""
    from powertrain.deploy.launch import start_engine

    plugins = PluginManager.load(config.plugins)
    engine = start_engine(config, plugins)
    async_engine = AsyncEngine(engine)
    try:
        adapter = protocol_adapter(plugins, engine.tokenizer, engine.model_config)
        app = create_app(async_engine, adapter, settings)
        server = uvicorn.Server(
            uvicorn.Config(
                app,
                host=settings.host,
                port=settings.port,
                access_log=False,  # our structured access log replaces uvicorn's
                log_config=None,
                timeout_graceful_shutdown=settings.graceful_shutdown_s,
            )
        )
        log.info("serving", url=f"http://{settings.host}:{settings.port}", model=app.state.server.model_name)
        server.run()
    finally:
        async_engine.shutdown()

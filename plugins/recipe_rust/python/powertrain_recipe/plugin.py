"""Registers the recipe as powertrain's protocol adapter (entry point ``recipe``)."""

from __future__ import annotations

from typing import Any

from powertrain import hookimpl
from powertrain.components import ProtocolAdapterRecord

POWERTRAIN_HOOK_API = 1


def build(tokenizer: Any, model_config: Any) -> Any:
    """``factory(tokenizer, model_config)``: the adapter for one loaded model."""
    from powertrain_recipe.adapter import RecipeAdapter

    return RecipeAdapter.for_tokenizer(tokenizer, model_config)


@hookimpl
def powertrain_protocol_adapters() -> list[ProtocolAdapterRecord]:
    return [
        ProtocolAdapterRecord(
            name="recipe",
            factory=build,
            protocols={"openai.chat", "openai.responses", "anthropic.messages"},
            priority=100,
            description="Rust protocol adapter: Chat Completions, Responses, Anthropic Messages <-> prompt tokens",
        )
    ]

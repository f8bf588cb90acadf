"""powertrain's protocol adapter: request bodies -> prompt token ids, generated text -> responses.

The work happens in Rust (``_native``): parsing OpenAI Chat Completions, OpenAI
Responses and Anthropic Messages into one conversation, rendering it with the
model's chat template (or DeepSeek-V4's native encoder), tokenizing it so that text
from users and tools can never become a control token, and turning generated text
back into each protocol's JSON body or SSE frames. This package adds the Python
conveniences and the plugin registration (``powertrain_recipe.plugin``).
"""

from __future__ import annotations

from powertrain_recipe._native import PromptEncoder, RecipeError, ResponseWriter, StreamParser, parse_request_json
from powertrain_recipe.adapter import PROTOCOLS, RecipeAdapter, parse_request

__all__ = [
    "PROTOCOLS",
    "PromptEncoder",
    "RecipeAdapter",
    "RecipeError",
    "ResponseWriter",
    "StreamParser",
    "parse_request",
    "parse_request_json",
]

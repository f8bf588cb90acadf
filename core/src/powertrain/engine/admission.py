"""The checks a request passes before any engine queues it.

Shared by ``LLMEngine.add_request`` and the data-parallel front end
(``deploy.frontend``), which must refuse bad input itself: once a request has left
for a worker process, an error there could only reach the caller late and indirectly.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence
from typing import Any

import attrs

from powertrain.interfaces.errors import InvalidRequestError
from powertrain.interfaces.sampling import SamplingParams
from powertrain.tokenizer import Tokenizer


def checked_params(params: object) -> SamplingParams:
    params = params or SamplingParams()
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError(f"params must be a SamplingParams, got {type(params).__name__}")
    return params


def tokenize_prompt(tokenizer: Tokenizer, prompt: str | Sequence[int]) -> tuple[str | None, list[int]]:
    """``(text or None, token ids)``; token ids must be ints in the vocabulary."""
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequestError("the prompt is empty; send at least one character")
        return prompt, tokenizer.encode(prompt)
    token_ids = list(prompt)
    if not token_ids:
        raise InvalidRequestError("the prompt has no tokens; send at least one token id")
    vocab = tokenizer.vocab_size
    bad = [t for t in token_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
    if bad:
        raise InvalidRequestError(f"prompt token ids must be ints in [0, {vocab}); got {bad[:5]}")
    return None, token_ids


def check_logit_bias(params: SamplingParams, vocab: int) -> None:
    """Biased token ids are in the vocabulary (the sampler indexes the logits with them)."""
    outside = [token for token, _ in params.logit_bias if token >= vocab]
    if outside:
        raise InvalidRequestError(f"logit_bias token ids must be in [0, {vocab}); got {outside[:5]}")


def check_length(num_prompt_tokens: int, params: SamplingParams, max_model_len: int, cache_tokens: int) -> None:
    """The prompt fits the model, and prompt + output fit the whole KV cache."""
    if num_prompt_tokens >= max_model_len:
        raise InvalidRequestError(
            f"the prompt has {num_prompt_tokens} tokens; this engine serves at most "
            f"{max_model_len} tokens per sequence (prompt + output); shorten the prompt"
        )
    needed = min(num_prompt_tokens + params.max_tokens, max_model_len)
    if needed > cache_tokens:
        raise InvalidRequestError(
            f"prompt ({num_prompt_tokens} tokens) + max_tokens ({params.max_tokens}) needs {needed} "
            f"cache slots, but the whole KV cache holds {cache_tokens}; lower max_tokens or raise [cache] memory_gib"
        )


def start_grammars(structured: Any, params: SamplingParams) -> list[Any]:
    """One matcher per sequence of a constrained request (none for an unconstrained one);
    a constraint that does not compile raises InvalidRequestError."""
    if params.structured is None:
        return []
    if structured is None:
        raise InvalidRequestError("this engine was built without structured output; send no constraint")
    return structured.start(params.structured, params.n)


@attrs.frozen
class Admitted:
    """A request that passed every check, ready to queue."""

    request_id: str
    params: SamplingParams
    text: str | None
    token_ids: list[int]
    #: One grammar matcher per sequence of a constrained request, else empty.
    grammars: list[Any]


def admit(
    tokenizer: Tokenizer,
    prompt: str | Sequence[int],
    params: object,
    request_id: str | None,
    *,
    in_use: Container[str],
    new_id: Callable[[], str],
    max_model_len: int,
    cache_tokens: int,
    structured: Callable[[], Any],
) -> Admitted:
    """Every check, in order; the first that fails raises InvalidRequestError.
    ``structured()`` gives the grammar compiler, asked only for a constrained request."""
    params = checked_params(params)
    request_id = request_id if request_id is not None else new_id()
    if request_id in in_use:
        raise InvalidRequestError(f"request id {request_id!r} is already in use")
    text, token_ids = tokenize_prompt(tokenizer, prompt)
    check_logit_bias(params, tokenizer.vocab_size)
    check_length(len(token_ids), params, max_model_len, cache_tokens)
    grammars = start_grammars(structured(), params) if params.structured is not None else []
    return Admitted(request_id, params, text, token_ids, grammars)

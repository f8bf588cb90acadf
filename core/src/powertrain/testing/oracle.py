"""Comparing a powertrain model with HF transformers, the oracle of every model test.

The reference is HF's own full forward over the whole token list, one per generated
token (its stateless path: no KV cache of its own whose rounding or statefulness could
differ), and differences are measured relative to the largest reference logit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from powertrain.interfaces import AttentionMetadata


def hf_logits(hf: Any, tokens: Sequence[int]) -> torch.Tensor:
    """float32 ``[len(tokens), vocab]`` logits of an HF causal LM over ``tokens``."""
    with torch.inference_mode():
        return hf(input_ids=torch.tensor([list(tokens)])).logits[0].float()


def hf_greedy(hf: Any, prompt: Sequence[int], steps: int) -> list[int]:
    """HF's argmax continuation, one full forward per token, EOS ignored (as ``ignore_eos``)."""
    tokens = list(prompt)
    for _ in range(steps):
        tokens.append(int(hf_logits(hf, tokens)[-1].argmax()))
    return tokens[len(prompt) :]


def top_two_gap(row: torch.Tensor) -> float:
    """How far a greedy pick is from a tie: (largest - second largest logit) / max |logit|."""
    top = row.double().topk(2).values
    return ((top[0] - top[1]) / row.double().abs().max()).item()


def assert_greedy_agrees(
    got: Sequence[int],
    expected: Sequence[int],
    oracle_row: Any,
    tolerance: float,
    what: str = "greedy tokens",
) -> int | None:
    """``got`` equals the oracle's greedy ``expected`` tokens, or first departs from them where
    the oracle's own pick was a tie within ``tolerance``: there, rounding at the tolerance the
    logits are checked to may pick either token, and the paths differ from then on, so the rest
    is not compared. ``oracle_row(i)`` gives the oracle's logits for token ``i`` along its own
    path (``expected[:i]`` generated). Returns the index of such a tie, or None.

    A departure where the oracle's top two differ by more than ``tolerance`` fails, saying so."""
    index = next((i for i, (a, b) in enumerate(zip(got, expected, strict=True)) if a != b), None)
    if index is None:
        return None
    gap = top_two_gap(oracle_row(index))
    assert gap <= tolerance, (
        f"{what} depart from the oracle's at token {index} ({got[index]} instead of {expected[index]}) where the "
        f"oracle's top two logits are {gap:.2e} of the largest apart, more than the tolerance {tolerance:.0e}: "
        f"not a rounding tie.\n got      {list(got)}\n expected {list(expected)}"
    )
    print(f"{what}: a tie at token {index} (top two {gap:.2e} apart); compared up to it")
    return index


def hf_greedy_row(hf: Any, prompt: Sequence[int], expected: Sequence[int]) -> Any:
    """``oracle_row`` for ``assert_greedy_agrees`` with an HF model: its logits after ``expected[:i]``."""
    return lambda i: hf_logits(hf, [*prompt, *expected[:i]])[-1]


def assert_same_greedy(
    got: Sequence[Sequence[int]],
    expected: Sequence[Sequence[int]],
    prompts: Sequence[Sequence[int]],
    hf: Any,
    tolerance: float,
    what: str = "greedy tokens",
) -> None:
    """Each request's tokens are ``expected`` (e.g. plain decoding's, the same engine run
    another way), or depart from them only at a tie within ``tolerance`` of the transformers
    model ``hf``'s logits along the expected path (``assert_greedy_agrees``): two correct runs
    whose batches differ in shape round differently, and may pick either side of a tie."""
    for prompt, tokens, reference in zip(prompts, got, expected, strict=True):
        assert_greedy_agrees(list(tokens), list(reference), hf_greedy_row(hf, prompt, list(reference)), tolerance, what)


def prefill_logits(llm: Any, prompts: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """All prompts in one ragged flat batch through an ``LLM``'s model (in this process): float32
    logits at every position, from fresh caches shaped like the engine's."""
    model = llm.engine.runner.model
    block_size = llm.engine.block_manager.block_size
    tables, next_block = [], 0
    for prompt in prompts:
        count = -(-len(prompt) // block_size)
        tables.append(list(range(next_block, next_block + count)))
        next_block += count
    # Fresh caches shaped like the engine's (blocks first), just big enough for these prompts.
    caches = [
        {name: torch.empty((next_block, *t.shape[1:]), dtype=t.dtype) for name, t in layer.items()}
        for layer in llm.engine.runner.kv_caches
    ]
    metadata = AttentionMetadata.build(
        query_lens=[len(p) for p in prompts],
        seq_lens=[len(p) for p in prompts],
        block_tables=tables,
        block_size=block_size,
    )
    ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.tensor([i for p in prompts for i in range(len(p))])
    with torch.inference_mode():
        logits = model.compute_logits(model.forward(ids, positions, caches, metadata))
    return list(logits.split([len(p) for p in prompts]))


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    """``max |ours - reference| / max |reference|``."""
    return ((ours - reference).abs().max() / reference.abs().max()).item()


def startup_event(model: str | Path, event: str, timeout: float = 300) -> dict[str, Any]:
    """The JSON log ``event`` (e.g. "kv cache") that ``powertrain generate`` prints at
    startup for ``model``, run as a user would (the console script, plugins not autoloaded)."""
    script = Path(sys.executable).with_name("powertrain")
    proc = subprocess.run(
        [str(script), "--log-level", "info", "generate", "--model", str(model), "--max-tokens", "4", "hello"],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "POWERTRAIN_DISABLE_PLUGIN_AUTOLOAD": "1"},
    )
    if proc.returncode != 0:
        raise AssertionError(f"powertrain generate failed:\n{proc.stderr}")
    events = [json.loads(line) for line in proc.stderr.splitlines() if line.startswith("{")]
    return next(e for e in events if e["event"] == event)

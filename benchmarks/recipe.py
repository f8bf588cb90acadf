"""Request -> prompt token ids: the Rust recipe against transformers' apply_chat_template.

1,000 chat requests (1-8 turns, optional system prompt, random words; fixed seed) go
through powertrain-recipe (parse the Chat Completions JSON body, render SmolLM2's
chat template, tokenize with injection-safe encoding) and through transformers
(json.loads of the same body, then ``apply_chat_template(..., tokenize=True)`` with
the same tokenizer and template). Both must produce identical ids; the script prints
requests/s for each and the ratio.

    uv run python benchmarks/recipe.py
"""

from __future__ import annotations

import argparse
import json
import random
import time

from common import report

from powertrain.loader import load_checkpoint, resolve_model_path
from powertrain_recipe import RecipeAdapter

WORDS = "the model reads a prompt and writes an answer about weather code music rivers cities numbers".split()


def conversation(rng: random.Random) -> list[dict[str, str]]:
    def sentence() -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 40))).capitalize() + "."

    messages = [{"role": "system", "content": sentence()}] if rng.random() < 0.5 else []
    for turn in range(rng.randint(1, 8)):
        messages.append({"role": "user", "content": sentence()})
        if turn < 7 and rng.random() < 0.8:
            messages.append({"role": "assistant", "content": sentence()})
    if messages[-1]["role"] == "assistant":
        messages.append({"role": "user", "content": sentence()})
    return messages


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    rng = random.Random(args.seed)
    bodies = [json.dumps({"model": "smollm2", "messages": conversation(rng)}).encode() for _ in range(args.requests)]
    checkpoint = load_checkpoint("smollm2-135m")
    adapter = RecipeAdapter.for_tokenizer(checkpoint.tokenizer, checkpoint.config)
    from transformers import AutoTokenizer

    path = resolve_model_path("smollm2-135m").path
    hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)

    started = time.perf_counter()
    ours = [adapter.parse_request("openai.chat", body).prompt_token_ids for body in bodies]
    ours_s = time.perf_counter() - started

    started = time.perf_counter()
    theirs = []
    for body in bodies:
        ids = hf.apply_chat_template(json.loads(body)["messages"], tokenize=True, add_generation_prompt=True)
        theirs.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    theirs_s = time.perf_counter() - started

    mismatches = sum(a != b for a, b in zip(ours, theirs, strict=True))
    report(
        "request -> prompt token ids, smollm2 chat template",
        {
            "requests": args.requests,
            "mean prompt tokens": sum(map(len, ours)) / len(ours),
            "id mismatches": mismatches,
            "powertrain-recipe requests/s": args.requests / ours_s,
            "transformers apply_chat_template requests/s": args.requests / theirs_s,
            "ratio recipe / transformers": theirs_s / ours_s,
        },
    )


if __name__ == "__main__":
    main()

"""Request -> prompt token ids: the Rust recipe against transformers' apply_chat_template.

1,000 chat requests (1-8 turns, optional system prompt, random words; fixed seed) go
through powertrain-recipe (parse the Chat Completions JSON body, render SmolLM2's
chat template, tokenize with injection-safe encoding) and through transformers
(json.loads of the same body, then ``apply_chat_template(..., tokenize=True)`` with
the same tokenizer and template). Both must produce identical ids; the script prints
requests/s for each and the ratio.

Second, when DeepSeek's own adapter (``deepseek-recipe``, a dev dependency) is
installed: the parity test's seeded corpus of Chat / Responses / Messages requests
(``plugins/recipe_rust/tests/official_corpus.py``) goes through both adapters for
the V4 and V4.1 encodings (request JSON -> prompt token ids, tiny test tokenizer),
timed side by side: requests/s and the ratio.

    uv run python benchmarks/recipe.py
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import random
import time
from pathlib import Path
from typing import Any

from common import report

from powertrain.loader import load_checkpoint, resolve_model_path
from powertrain_recipe import RecipeAdapter, RecipeError

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
    against_official(args.requests * 3, args.seed)


def official_corpus() -> Any:
    path = Path(__file__).resolve().parent.parent / "plugins" / "recipe_rust" / "tests" / "official_corpus.py"
    spec = importlib.util.spec_from_file_location("official_corpus", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def against_official(requests: int, seed: int) -> None:
    """Our adapter against deepseek-recipe on the parity corpus, both V4-family encodings."""
    try:
        import deepseek_recipe
    except ImportError:
        print("# deepseek-recipe is not installed (uv sync installs the dev group): official adapter not timed")
        return
    from powertrain.testing.checkpoints import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    corpus = official_corpus()
    tokenizer.add_special_tokens(list(corpus.V4_CONTROL_TOKENS))
    tokenizer_json = tokenizer.to_str()
    request_types = {
        "openai.chat": deepseek_recipe.ChatCompletionRequest,
        "openai.responses": deepseek_recipe.ResponsesRequest,
        "anthropic.messages": deepseek_recipe.MessagesRequest,
    }
    for model, encoding_type, extra in (
        ("DeepSeek-V4-Pro", deepseek_recipe.DeepseekV4Encoding, {}),
        ("DeepSeek-V4.1-Flash", deepseek_recipe.DeepseekV41Encoding, {"_name_or_path": "DeepSeek-V4.1-Flash"}),
    ):
        bodies = [(protocol, json.dumps(body).encode()) for protocol, body, _ in corpus.corpus(seed, requests, model)]
        encoding = encoding_type().with_tokenizer(deepseek_recipe.Tokenizer.from_str(tokenizer_json))
        options = deepseek_recipe.ConversionOptions()
        adapter = RecipeAdapter(tokenizer_json, {}, {"model_type": "deepseek_v4", **extra})

        started = time.perf_counter()
        for protocol, body in bodies:
            with contextlib.suppress(deepseek_recipe.ConversionError, ValueError):  # a refused request
                encoding.encode(request_types[protocol](body).convert(options).conversation)
        theirs_s = time.perf_counter() - started
        started = time.perf_counter()
        for protocol, body in bodies:
            with contextlib.suppress(RecipeError):  # a refused request
                adapter.parse_request(protocol, body)
        ours_s = time.perf_counter() - started
        report(
            f"request JSON -> prompt token ids, {model} encoding, parity corpus",
            {
                "requests": requests,
                "powertrain-recipe requests/s": requests / ours_s,
                "deepseek-recipe requests/s": requests / theirs_s,
                "ratio recipe / deepseek-recipe": theirs_s / ours_s,
            },
        )


if __name__ == "__main__":
    main()

"""Image sizes and token counts against DeepSeek's own adapter (``deepseek-recipe``).

The official adapter preprocesses each image for V4.1's vision encoder (OpenCV, WebP)
and counts the prompt tokens it takes (``MultiModalData.image_token_adjustment``). Ours
computes the same sizes and counts from the image header (``image_fit``). Three checks,
each on fresh seeded inputs:
- token counts of already-sized images, over sizes from 1 to 40,000 pixels a side;
- preprocessed sizes of real PNG images at every detail level;
- whole requests: the fits our parser hands the engine equal the official resolver's.
"""

from __future__ import annotations

import base64
import io
import json
import math
import random

import pytest

deepseek_recipe = pytest.importorskip("deepseek_recipe")
Image = pytest.importorskip("PIL.Image")

from powertrain_recipe import _native  # noqa: E402

DETAILS = ("low", "high", "auto", "original")


def official_tokens(width: int, height: int) -> int | None:
    """The official count of an image already at this size; None where it refuses."""
    info = deepseek_recipe.ImageInfo(b"x", width, height)
    try:
        return 1 + deepseek_recipe.MultiModalData([info]).image_token_adjustment()
    except deepseek_recipe.CalcResizeError:
        return None


def our_tokens(width: int, height: int) -> int | None:
    try:
        return _native.image_tokens(width, height)
    except ValueError:
        return None


def random_side(rng: random.Random, largest: int) -> int:
    return max(1, int(math.exp(rng.uniform(0, math.log(largest)))))


def png(width: int, height: int, rng: random.Random) -> bytes:
    image = Image.new("RGB", (width, height), tuple(rng.randrange(256) for _ in range(3)))
    out = io.BytesIO()
    image.save(out, format="PNG", compress_level=1)
    return out.getvalue()


def test_token_counts_equal_the_official_ones() -> None:
    rng = random.Random(20261203)
    sizes = [(random_side(rng, 40_000), random_side(rng, 40_000)) for _ in range(6000)]
    sizes += [(w, h) for w in range(1, 200, 13) for h in range(1, 4000, 97)]
    sizes += [(n, n) for n in range(500, 1400, 7)]
    counts = []
    for width, height in sizes:
        expected = official_tokens(width, height)
        assert our_tokens(width, height) == expected, (width, height)
        counts.append(expected)
    # Sizes scaled up to the minimum area and sizes held to the budget are both here.
    assert min(filter(None, counts)) < 184 < 1024 == max(filter(None, counts))


def test_preprocessed_sizes_equal_the_official_ones() -> None:
    rng = random.Random(20261204)
    preprocessor = deepseek_recipe.OpenCvImagePreprocessor()
    cases = 0
    while cases < 160:
        width, height = random_side(rng, 8192), random_side(rng, 8192)
        if width * height > 3_000_000:
            continue
        data = png(width, height, rng)
        detail = rng.choice(DETAILS)
        options = deepseek_recipe.PreprocessOptions(detail, 8192, 512)
        try:
            official = preprocessor.preprocess(data, options)
            expected: tuple[int, int, int] | None = (
                official.width,
                official.height,
                1 + deepseek_recipe.MultiModalData([official]).image_token_adjustment(),
            )
        except (deepseek_recipe.ImageError, deepseek_recipe.CalcResizeError):
            expected = None
        try:
            mine: tuple[int, int, int] | None = _native.image_fit(width, height, detail)
        except ValueError:
            mine = None
        assert mine == expected, (width, height, detail)
        cases += 1


def test_requests_hand_the_engine_the_official_fits() -> None:
    """Chat requests with several inline images: the fits our parser reports equal
    what the official resolver produces for the same request."""
    rng = random.Random(20261205)
    resolver = deepseek_recipe.ImageResolver(
        deepseek_recipe.ReqwestImageFetcher(), deepseek_recipe.OpenCvImagePreprocessor()
    )
    for _ in range(12):
        parts: list[dict] = [{"type": "text", "text": "Compare these."}]
        for _ in range(rng.randint(1, 4)):
            width, height = random_side(rng, 3000), random_side(rng, 3000)
            url = "data:image/png;base64," + base64.b64encode(png(width, height, rng)).decode()
            image_url = {"url": url}
            if rng.random() < 0.7:
                image_url["detail"] = rng.choice(["low", "high", "auto"])
            parts.append({"type": "image_url", "image_url": image_url})
        body = {"model": "DeepSeek-V4.1-Flash", "messages": [{"role": "user", "content": parts}]}

        converted = deepseek_recipe.ChatCompletionRequest(body).convert(deepseek_recipe.ConversionOptions())
        rendered = deepseek_recipe.DeepseekV41Encoding().render_conversation(converted.conversation)
        resolved = resolver.resolve(rendered.image_sources, deepseek_recipe.ImageQuota())
        official = [(i.width, i.height) for i in resolved.images]

        native = json.loads(_native.parse_request_json("chat_completions", json.dumps(body).encode()))
        fits = native["image_fits"]
        assert [(f["width"], f["height"]) for f in fits] == official
        assert sum(f["tokens"] - 1 for f in fits) == resolved.image_token_adjustment()
        assert native["images"] == len(official)

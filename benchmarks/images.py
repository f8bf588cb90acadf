"""Images through DeepSeek-V4.1's vision tower on this machine: images per second through
preprocessing and the tower at 224, 1024 and 4096 pixels, and the time to first token of an
image chat against a text chat of the same prompt length.

The tower has the release's shape (DeepSeek-V4.1-Flash's ``config.json``: 32 ViT layers of
width 1024 with 16 heads and an MLP of 2816, 14-pixel patches merged 3x3, a 1,024-token
budget, images under 544 x 544 pixels of area scaled up) with random weights; ``--layers``
runs fewer (the layers' time is proportional to their count; the aligner, a 9216 -> 5120 ->
5120 MLP per token, comes on top). Square random RGB images: 224 px is scaled up to the
minimum area (a 13 x 13 token grid: 184 prompt positions with the row ends, start and end),
1024 px to a 25 x 25 grid (652), 4096 px down to the budget (31 x 31: 994). Per size: the
prompt positions and ViT patches,
preprocessing ms (Pillow resize and pad, normalisation, patches), tower seconds (ViT and
aligner), and images per second through both (median of ``--repeats``).

Time to first token: an engine on the tiny V4.1 language model (``write_tiny_deepseek_v41``)
with the release-shaped tower (its aligner projecting into the tiny model's width), prefix
caching off. An image chat (a few text tokens and one ``--ttft-side`` image) and a text chat
of the same number of prompt positions take turns, ``--repeats`` times each; printed: the
median TTFT of each and their ratio (what the tower adds to a prefill of that length).

    uv run python benchmarks/images.py                  # the release's 32 layers
    uv run python benchmarks/images.py --layers 4       # a quick look
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from common import engine_of, prefill, report

from powertrain import LLM
from powertrain.interfaces.images import ImageInput
from powertrain.models.deepseek_v41_vision import DeepseekV41Vision, VisionArgs
from powertrain.testing.deepseek_v41 import RELEASE_IMAGE_SIZING, vision_weights, write_tiny_deepseek_v41

#: The release's ``vision_*`` settings (DeepSeek-V4.1-Flash ``config.json``), as ``vision_config``.
RELEASE_TOWER = {
    "num_hidden_layers": 32,
    "hidden_size": 1024,
    "num_attention_heads": 16,
    "intermediate_size": 2816,
    "patch_size": 14,
    "rope_theta": 10000.0,
    "downsample_ratio": 3,
    **RELEASE_IMAGE_SIZING,
    "max_wh_ratio": None,
}
#: The release's language model width (the aligner's output).
RELEASE_TEXT_WIDTH = 5120


def tower_of(vision_config: dict, text_width: int, dtype: torch.dtype) -> DeepseekV41Vision:
    args = VisionArgs.from_config({"vision_config": vision_config, "image_token_id": 1, "hidden_size": text_width})
    assert args is not None
    tower = DeepseekV41Vision(args)
    tower.load_state_dict(vision_weights(vision_config, text_width, seed=0))
    return tower.to(dtype).eval()


def random_image(side: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)


def time_sizes(tower: DeepseekV41Vision, sides: list[int], repeats: int) -> dict[str, object]:
    results: dict[str, object] = {}
    for side in sides:
        prepare_s, encode_s = [], []
        for repeat in range(repeats):
            pixels = random_image(side, repeat)
            started = time.perf_counter()
            prepared = tower.prepare(pixels, "auto")
            prepared_at = time.perf_counter()
            rows = tower.encode(prepared)
            encode_s.append(time.perf_counter() - prepared_at)
            prepare_s.append(prepared_at - started)
        prep, encode = statistics.median(prepare_s), statistics.median(encode_s)
        results[f"{side}px"] = {
            "tokens": prepared.tokens,
            "patches": prepared.patches.shape[0],
            "span_rows": list(rows.shape),
            "preprocess_ms": round(1e3 * prep, 1),
            "tower_s": round(encode, 3),
            "images_per_s": round(1 / (prep + encode), 4),
        }
        print(f"{side}px: {results[f'{side}px']}", flush=True)
    return results


def time_to_first_token(vision_config: dict, side: int, repeats: int, dtype: str) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as scratch:
        folder = write_tiny_deepseek_v41(
            Path(scratch) / "v41", seed=0, vision=vision_config, image_token="<｜image｜>", max_position_embeddings=4096
        )
        with LLM(str(folder), dtype=dtype, prefix_caching=False) as llm:
            encoder = engine_of(llm).runner.image_encoder
            image_token = encoder.image_token_id
            positions = encoder.image_tokens(side, side, "auto")
            rng = np.random.default_rng(1)
            text_ids = [int(t) for t in rng.integers(3, 500, 5)]
            image_chat = [*text_ids, image_token]
            text_chat = [int(t) for t in rng.integers(3, 500, len(text_ids) + positions)]
            images = [ImageInput.of_pixels(random_image(side, 7))]
            image_s, text_s = [], []
            prefill(llm, text_chat[:32], 1)  # warm the engine up
            for _ in range(repeats):
                image_s.append(prefill(llm, image_chat, 1, images))
                text_s.append(prefill(llm, text_chat, 1))
                engine_of(llm).runner.encoded_images.clear()  # the next image chat encodes again
    image, text = statistics.median(image_s), statistics.median(text_s)
    return {
        "prompt_positions": len(text_chat),
        "image_chat_ttft_s": round(image, 3),
        "text_chat_ttft_s": round(text, 3),
        "image_over_text": round(image / text, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sides", type=int, nargs="+", default=[224, 1024, 4096])
    parser.add_argument("--layers", type=int, default=RELEASE_TOWER["num_hidden_layers"])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--ttft-side", type=int, default=1024, help="the image chat's image side (0 skips TTFT)")
    args = parser.parse_args()
    vision_config = {**RELEASE_TOWER, "num_hidden_layers": args.layers}
    tower = tower_of(vision_config, RELEASE_TEXT_WIDTH, getattr(torch, args.dtype))
    results: dict[str, object] = {
        "layers": args.layers,
        "dtype": args.dtype,
        "tower_parameters": sum(p.numel() for p in tower.parameters()),
    }
    with torch.inference_mode():
        results |= time_sizes(tower, args.sides, args.repeats)
    del tower
    if args.ttft_side:
        results["ttft"] = time_to_first_token(vision_config, args.ttft_side, args.repeats, args.dtype)
    report("V4.1 vision tower: images per second, and image-chat TTFT against a text chat", results)


if __name__ == "__main__":
    main()

"""Images through the engine (``engine.images``) on the tiny V4.1 with its vision tower: the
first step of an image prompt against the logits DeepSeek's official code computed
(``fixtures/deepseek_v41_vision``), however the prompt is scheduled (one step, chunks that
split spans, beside text requests, after preemption); the tower runs once per image of a
request and only on the step's images; the prefix cache shares blocks between requests with
the same image and never between different images; bad image input is refused and the engine
keeps serving."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from powertrain import LLM, SamplingParams
from powertrain.builtin.reference_attention import TorchReferenceAttention
from powertrain.engine.images import EncodedImages, lay_out_images
from powertrain.interfaces.errors import InvalidRequestError
from powertrain.interfaces.images import ImageInput, ImageRows
from powertrain.interfaces.protocol import ImageFit, ImagePart
from powertrain.testing.deepseek_v41 import fixture_image_pixels, load_tiny_v41, write_tiny_deepseek_v41
from powertrain.testing.oracle import assert_greedy_agrees
from powertrain.testing.paged import PagedRunner

#: Log-probabilities against the official exact logits: those are within 1e-4 of the row's
#: largest |logit| (test_deepseek_v41_vision's TOLERANCE: float32 sums of at most 1,024 terms,
#: 1,024 * 2**-24 = 6.1e-5), and a log-softmax moves by at most twice the largest logit error
#: (the logit's own and the log-sum-exp's). Measured: below 1e-6.
LOGPROB_TOLERANCE = 2e-4
#: Greedy paths of two schedules may part only where the top two logits are this close
#: (relative to the largest): each is within TOLERANCE of the exact value.
TIE = 2e-4
BLOCK = 4


@pytest.fixture(scope="module")
def image_token(v41_vision_checkpoint: Path) -> int:
    return json.loads((v41_vision_checkpoint / "config.json").read_text())["image_token_id"]


def given_prompt(golden: dict, provenance: dict, prompt: str, image_token: int) -> tuple[list[int], list[ImageInput]]:
    """A fixture prompt as a client sends it: one placeholder per image, and the images."""
    tokens = golden[f"{prompt}.tokens"].tolist()
    names = [part for part in provenance["prompts"][prompt] if isinstance(part, str)]
    lengths = [golden[f"{name}.span_rows"].shape[0] for name in names]
    given, last = [], 0
    for start, length in zip(golden[f"{prompt}.image_starts"].tolist(), lengths, strict=True):
        given += tokens[last:start] + [image_token]
        last = start + length
    given += tokens[last:]
    images = [ImageInput.of_pixels(fixture_image_pixels(provenance, name), path=name) for name in names]
    return given, images


def expected_logprobs(golden: dict, prompt: str) -> torch.Tensor:
    return torch.log_softmax(golden[f"{prompt}.exact_prefill_logits"][-1].float(), -1)


def assert_first_step_matches(output: Any, golden: dict, prompt: str) -> None:
    expected = expected_logprobs(golden, prompt)
    first = output.outputs[0].logprobs[0]
    assert len(first) >= 5
    for token, logprob in first.items():
        assert abs(logprob - float(expected[token])) <= LOGPROB_TOLERANCE, (prompt, token, logprob)
    # The oracle's top five are ours too, but for one that ties with our fifth within the tolerance.
    missing = set(expected.topk(5).indices.tolist()) - set(first)
    assert all(float(expected[t]) <= min(first.values()) + 2 * LOGPROB_TOLERANCE for t in missing), prompt


class EncodeCounter:
    """Records every image the model's vision tower encodes (the real tower still runs)."""

    def __init__(self, llm: LLM) -> None:
        self.encoder = llm.engine.runner.image_encoder
        self.shapes: list[tuple[int, ...]] = []
        original = self.encoder.encode_image

        def counting(pixels: np.ndarray, detail: str) -> torch.Tensor:
            self.shapes.append(pixels.shape)
            return original(pixels, detail)

        self.encoder.encode_image = counting


@pytest.fixture
def llm(v41_vision_checkpoint: Path) -> Iterator[LLM]:
    with LLM(str(v41_vision_checkpoint), dtype="float32", block_size=BLOCK, num_blocks=256) as engine:
        yield engine


def first_steps(llm: LLM, prompts: list[list[int]], images: list[list[ImageInput]]) -> list[Any]:
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5, ignore_eos=True)
    return llm.generate(prompts, params, images=images)


# --------------------------------------------------------------------------- against the official code


@pytest.mark.parametrize("chunk", [None, 7], ids=["one-step", "chunks-of-7"])
def test_image_prompts_through_the_engine_match_the_official_first_step(
    v41_vision_checkpoint: Path,
    v41_vision_golden: dict,
    v41_vision_provenance: dict,
    image_token: int,
    chunk: int | None,
) -> None:
    """Both fixture prompts (two images, then one) in one batch; with chunks of 7 tokens the
    spans are split across steps. The first token's log-probabilities equal the official
    exact math's, the reported prompt is the one given, and each image was encoded once."""
    settings = {} if chunk is None else {"max_num_batched_tokens": chunk}
    with LLM(str(v41_vision_checkpoint), dtype="float32", block_size=BLOCK, num_blocks=256, **settings) as llm:
        assert llm.engine.accepts_images
        counter = EncodeCounter(llm)
        given = [given_prompt(v41_vision_golden, v41_vision_provenance, p, image_token) for p in ("p1", "p2")]
        outputs = first_steps(llm, [g for g, _ in given], [i for _, i in given])
        launched = llm.engine.launched_steps
    for output, prompt, (prompt_ids, _) in zip(outputs, ("p1", "p2"), given, strict=True):
        assert_first_step_matches(output, v41_vision_golden, prompt)
        assert output.prompt_token_ids == prompt_ids
    names = ("small", "tall", "wide")
    assert sorted(counter.shapes) == sorted(fixture_image_pixels(v41_vision_provenance, n).shape for n in names)
    total = sum(v41_vision_golden[f"{p}.tokens"].shape[0] for p in ("p1", "p2"))
    assert launched == (1 if chunk is None else -(-total // chunk))


def test_the_tower_runs_once_on_the_one_image_of_a_busy_step(
    llm: LLM, v41_vision_golden: dict, v41_vision_provenance: dict, image_token: int
) -> None:
    """Ten text requests and one image request, all in one step: the tower runs once, on that image."""
    counter = EncodeCounter(llm)
    rng = np.random.default_rng(5)
    texts = [rng.integers(0, 500, int(rng.integers(3, 12))).tolist() for _ in range(10)]
    given, images = given_prompt(v41_vision_golden, v41_vision_provenance, "p2", image_token)
    outputs = first_steps(llm, [*texts, given], [[]] * 10 + [images])
    assert llm.engine.launched_steps == 1
    assert counter.shapes == [fixture_image_pixels(v41_vision_provenance, "wide").shape]
    assert_first_step_matches(outputs[-1], v41_vision_golden, "p2")
    assert all(output.finished and len(output.outputs[0].token_ids) == 1 for output in outputs)


# --------------------------------------------------------------------------- the prefix cache


def assert_logprobs_close(ours: Any, theirs: Any) -> None:
    mine, other = ours.outputs[0].logprobs[0], theirs.outputs[0].logprobs[0]
    assert set(mine) == set(other)
    assert all(abs(mine[t] - other[t]) <= LOGPROB_TOLERANCE for t in mine), (mine, other)


def test_the_same_image_shares_cached_blocks_and_a_different_one_never_does(
    v41_vision_checkpoint: Path, llm: LLM, v41_vision_golden: dict, v41_vision_provenance: dict, image_token: int
) -> None:
    """p2 (5 text tokens, a 20-position span at 5..24, 3 text tokens) again with the same image
    hits every full block but the last token's and runs no tower; with another image of the same
    size it hits only the block before the span, and its first step is that image's own (as a
    fresh engine computes it)."""
    given, images = given_prompt(v41_vision_golden, v41_vision_provenance, "p2", image_token)
    counter = EncodeCounter(llm)
    first_steps(llm, [given], [images])
    again = first_steps(llm, [given], [images])[0]
    assert counter.shapes == [images[0].pixels.shape]
    length = v41_vision_golden["p2.tokens"].shape[0]
    assert again.num_cached_tokens == (length - 1) // BLOCK * BLOCK
    assert_first_step_matches(again, v41_vision_golden, "p2")
    other = [ImageInput.of_pixels(np.random.default_rng(9).integers(0, 256, images[0].pixels.shape, dtype=np.uint8))]
    different = first_steps(llm, [given], [other])[0]
    assert different.num_cached_tokens == 5 // BLOCK * BLOCK
    assert len(counter.shapes) == 2
    with LLM(str(v41_vision_checkpoint), dtype="float32", block_size=BLOCK, num_blocks=256) as fresh:
        alone = first_steps(fresh, [given], [other])[0]
    assert_logprobs_close(different, alone)
    assert different.outputs[0].logprobs[0] != again.outputs[0].logprobs[0]


# --------------------------------------------------------------------------- preemption


def oracle_row(model: Any, golden: dict, provenance: dict, prompt: str, expected: list[int]) -> Any:
    """``assert_greedy_agrees``'s oracle: the model's logits along ``expected`` after the
    expanded prompt, its image rows from the tower (one paged forward, reference attention)."""
    tokens = golden[f"{prompt}.tokens"].tolist()
    names = [part for part in provenance["prompts"][prompt] if isinstance(part, str)]
    spans = [
        (start, model.vision_tower.encode_image(fixture_image_pixels(provenance, name), "auto"))
        for start, name in zip(golden[f"{prompt}.image_starts"].tolist(), names, strict=True)
    ]

    def row(i: int) -> torch.Tensor:
        runner = PagedRunner(model, TorchReferenceAttention(), dtype=torch.float32, block_size=BLOCK, num_blocks=64)
        return runner.step([("s", tokens + expected[:i])], image_rows=ImageRows.of_spans(spans))[0][-1]

    return row


def test_preempted_image_requests_recompute_their_images_and_agree(
    v41_vision_checkpoint: Path, v41_vision_golden: dict, v41_vision_provenance: dict, image_token: int
) -> None:
    """20 blocks of 4 tokens hold p1 (41 + 24 tokens) or p2 (28 + 24) alone, not both: one is
    preempted and recomputed (no prefix cache, so its spans are computed again, from the rows
    the store of encoded images still holds: no image is encoded twice). Its greedy tokens are
    those of a roomy run, or part from them only at a rounding tie."""
    given = [given_prompt(v41_vision_golden, v41_vision_provenance, p, image_token) for p in ("p1", "p2")]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    runs = {}
    for name, blocks in (("roomy", 256), ("tight", 20)):
        with LLM(
            str(v41_vision_checkpoint), dtype="float32", block_size=BLOCK, num_blocks=blocks, prefix_caching=False
        ) as llm:
            counter = EncodeCounter(llm)
            outputs = llm.generate([g for g, _ in given], params, images=[i for _, i in given])
            runs[name] = ([list(o.outputs[0].token_ids) for o in outputs], llm.engine.stats().preemptions)
        assert len(counter.shapes) == 3
    assert runs["roomy"][1] == 0 and runs["tight"][1] > 0
    model = load_tiny_v41(v41_vision_checkpoint)
    for prompt, tight, roomy in zip(("p1", "p2"), runs["tight"][0], runs["roomy"][0], strict=True):
        assert_greedy_agrees(
            tight, roomy, oracle_row(model, v41_vision_golden, v41_vision_provenance, prompt, roomy), TIE, prompt
        )


# --------------------------------------------------------------------------- refusals


def test_bad_image_input_is_refused_and_the_engine_keeps_serving(
    v41_vision_checkpoint: Path,
    llm: LLM,
    v41_vision_golden: dict,
    v41_vision_provenance: dict,
    image_token: int,
    tmp_path: Path,
) -> None:
    given, images = given_prompt(v41_vision_golden, v41_vision_provenance, "p1", image_token)
    engine = llm.engine
    with pytest.raises(InvalidRequestError, match=r"2 image placeholder\(s\) .* but 1 image\(s\)"):
        engine.add_request(given, images=images[:1])
    with pytest.raises(InvalidRequestError, match=r"^tall: pixels must be RGB uint8"):
        floats = ImageInput.of_pixels(images[1].pixels.astype(np.float32), path="tall")
        engine.add_request(given, images=[images[0], floats])
    with pytest.raises(InvalidRequestError, match=r"^small: pixels must be RGB uint8 .* \[23, 37, 4\]"):
        rgba = np.concatenate([images[0].pixels, images[0].pixels[..., :1]], axis=-1)
        engine.add_request(given, images=[ImageInput.of_pixels(rgba, path="small"), images[1]])
    fit = ImageFit(width=42, height=42, rows=1, columns=1, tokens=4)
    lying = ImagePart(path="messages[0].content[1]", detail="auto", fit=fit)
    with pytest.raises(InvalidRequestError, match=r"^messages\[0\]\.content\[1\]: the protocol adapter .* 4 .* as 5"):
        engine.add_request(given, images=[ImageInput(part=lying, pixels=images[0].pixels), images[1]])
    medium = ImageInput(part=ImagePart(path="small", detail="medium"), pixels=images[0].pixels)
    with pytest.raises(InvalidRequestError, match=r"^small: unknown image detail"):
        engine.add_request(given, images=[medium, images[1]])
    with pytest.raises(InvalidRequestError, match="one list per prompt"):
        llm.generate([given], images=[images, images])
    assert not engine.has_unfinished_requests()
    assert_first_step_matches(first_steps(llm, [given], [images])[0], v41_vision_golden, "p1")
    # The length check counts the expanded prompt (41 positions), not the 11 tokens sent.
    short = LLM(str(v41_vision_checkpoint), dtype="float32", block_size=BLOCK, num_blocks=64, max_model_len=32)
    with short, pytest.raises(InvalidRequestError, match="the prompt has 41 tokens"):
        short.engine.add_request(given, images=images)
    text_only = write_tiny_deepseek_v41(tmp_path / "text", seed=0)
    with LLM(str(text_only), dtype="float32", block_size=BLOCK, num_blocks=64) as plain:
        assert not plain.engine.accepts_images
        with pytest.raises(InvalidRequestError, match=r"has no vision encoder and takes text only"):
            plain.engine.add_request(given, images=images)
        assert len(plain.generate([given], SamplingParams(max_tokens=2))[0].outputs[0].token_ids) == 2


def test_the_store_of_encoded_images_keeps_the_most_recent_within_its_bytes(
    v41_vision_checkpoint: Path, v41_vision_provenance: dict, image_token: int
) -> None:
    """Room for the larger of two images' rows: encoding the other drops the first, which is
    then encoded again; an image over the whole capacity is encoded for its step, not kept."""
    tower = load_tiny_v41(v41_vision_checkpoint).vision_tower
    small, wide = (
        ImageInput.of_pixels(fixture_image_pixels(v41_vision_provenance, n), path=n) for n in ("small", "wide")
    )
    _, (a, b) = lay_out_images([1, image_token, 2, image_token], [small, wide], tower)
    size = max(tower.encode_image(i.pixels, "auto").numel() * 4 for i in (small, wide))
    store = EncodedImages(tower, capacity_bytes=size)
    assert torch.equal(store.rows_for(a), store.rows_for(a)) and store.encodings == 1
    store.rows_for(b)
    store.rows_for(a)
    assert store.encodings == 3
    tiny = EncodedImages(tower, capacity_bytes=16)
    tiny.rows_for(a)
    tiny.rows_for(a)
    assert tiny.encodings == 2

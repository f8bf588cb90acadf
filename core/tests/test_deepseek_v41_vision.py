"""DeepSeek-V4.1's vision tower against DeepSeek's official code (``fixtures/deepseek_v41_vision``,
see its README): preprocessing bit for bit, the span rows and the prefill logits of prompts
holding images; the sizes and token counts against the recipe's ``image_fit``; and what needs no
fixture (placeholder expansion, chunked prefill across an image span, refusals) on fresh inputs."""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from powertrain.builtin.reference_attention import TorchReferenceAttention
from powertrain.images import decode_image
from powertrain.models.deepseek_v41 import DeepseekV41ForCausalLM
from powertrain.models.deepseek_v41_vision import (
    ImageRows,
    VisionArgs,
    expand_image_placeholders,
    fit_image,
    plan_step,
    prepare_image,
    span_length,
)
from powertrain.testing.deepseek_v41 import (
    TINY_DEEPSEEK_V41_VISION_CONFIG,
    checkpoint_digest,
    fixture_image_pixels,
    load_tiny_v41,
    write_tiny_deepseek_v41,
)
from powertrain.testing.images import sample_images
from powertrain.testing.oracle import top_two_gap
from powertrain.testing.paged import PagedRunner

FIXTURES = Path(__file__).parent / "fixtures" / "deepseek_v41_vision"
#: The prefill logits against the official exact math, per row, relative to the row's largest
#: logit: test_deepseek_v41_model's TOLERANCE (float32 in another order; the widest sum is the
#: mHC mix over hc_mult * hidden = 1,024 terms, 1,024 * 2**-24 = 6.1e-5, so 1e-4). Measured: 1.6e-6.
TOLERANCE = 1e-4
#: A greedy pick departs from the oracle's only at a tie that close.
TIE = 2 * TOLERANCE
#: Span rows in float32 against the official exact record, relative to the row's largest value:
#: the same float32 arithmetic in another order. A float32 sum of K terms is off by at most
#: K * 2**-24 relative; the widest here is the patch embedding's 3 * 14 * 14 = 588 terms
#: (3.5e-5), so 1e-4. Measured: 3.2e-7.
ROW_TOLERANCE = 1e-4
#: The bfloat16 tower against the official bfloat16 one: both end by rounding to bfloat16, so
#: where a CPU's bfloat16 kernels sum in another order than the one that made the fixture (an
#: AVX-512-BF16/AMX Xeon against the AVX2 EPYC that made it) a row lands up to one bfloat16
#: step of its largest value apart: bfloat16 keeps 8 significant bits, so a step at x is at most
#: 2**-7 |x|. Measured: equal on AVX2; 6.1e-3 and 7.0e-3 (two of three images) on a Xeon with
#: AMX. Mutation: the tower's RMSNorms in bfloat16 instead of float32 give 8.3e-3 to 1.1e-2.
BF16_ROW_TOLERANCE = 2**-7
IMAGE_SEED = 3


@pytest.fixture(scope="module")
def model(v41_vision_checkpoint: Path):
    return load_tiny_v41(v41_vision_checkpoint)


def runner_of(model: DeepseekV41ForCausalLM, dtype: torch.dtype = torch.float32) -> PagedRunner:
    return PagedRunner(model, TorchReferenceAttention(), dtype=dtype, block_size=4, num_blocks=64)


def row_errors(ours: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    return (ours - reference.float()).abs().amax(-1) / reference.float().abs().amax(-1)


def images_of(prompt: str, provenance: dict) -> list[str]:
    return [part for part in provenance["prompts"][prompt] if isinstance(part, str)]


def relative(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return float(((ours.float() - reference.float()).abs().amax(-1) / reference.float().abs().amax(-1)).max())


def image_rows_of(model, golden: dict, provenance: dict, prompt: str, offset: int = 0) -> ImageRows:
    starts = golden[f"{prompt}.image_starts"].tolist()
    spans = []
    for start, name in zip(starts, images_of(prompt, provenance), strict=True):
        prepared = prepare_image(fixture_image_pixels(provenance, name), "auto", model.vision_args)
        spans.append((offset + start, model.vision_tower.encode(prepared)))
    return ImageRows.of_spans(spans)


def assert_logits_match(ours: torch.Tensor, reference: torch.Tensor, what: str) -> None:
    errors = row_errors(ours, reference)
    print(f"{what}: {len(errors)} rows, max |diff| / max |logit| = {errors.max():.2e}")
    assert errors.max() <= TOLERANCE, f"{what}: row {int(errors.argmax())} off by {errors.max():.2e}"
    for row, (mine, theirs) in enumerate(zip(ours, reference, strict=True)):
        if int(mine.argmax()) != int(theirs.argmax()):
            assert top_two_gap(theirs) <= TIE, f"{what}: row {row} picks another token away from a tie"


# --------------------------------------------------------------------------- provenance


def test_the_fixtures_say_where_they_came_from(v41_vision_provenance: dict, v41_vision_checkpoint: Path) -> None:
    files = v41_vision_provenance["reference"]["files"]
    for name in ("model.py", "vision.py", "image_processor.py", "engram.py", "kernel_cpu.py"):
        assert len(files[name]["commit"]) == 40 and len(files[name]["sha256"]) == 64, name
    assert v41_vision_provenance["default_dtype"] == "bfloat16" and v41_vision_provenance["torch"]
    assert checkpoint_digest(v41_vision_checkpoint) == v41_vision_provenance["checkpoint"]["checkpoint_sha256"], (
        "write_tiny_deepseek_v41(vision=True) no longer writes the checkpoint the fixtures ran on: "
        "regenerate them as their README says"
    )
    for name, record in v41_vision_provenance["images"].items():
        digest = hashlib.sha256(fixture_image_pixels(v41_vision_provenance, name).tobytes()).hexdigest()
        assert digest == record["pixels_sha256"], f"numpy draws image {name} differently now"
    assert "`make_fixtures.py`" in (FIXTURES / "README.md").read_text(encoding="utf-8")


# --------------------------------------------------------------------------- preprocessing


def test_preprocessing_equals_the_official_bit_for_bit(
    v41_vision_golden: dict, v41_vision_provenance: dict, model
) -> None:
    """Padding (aspect kept, grey bars), the resize, the normalisation and its bfloat16 rounding,
    and the patch order: every value equal."""
    for name in v41_vision_provenance["images"]:
        prepared = prepare_image(fixture_image_pixels(v41_vision_provenance, name), "auto", model.vision_args)
        n_vit_h, n_vit_w, n_llm_h, n_llm_w = v41_vision_golden[f"{name}.grid"].tolist()
        assert (prepared.patch_rows, prepared.patch_columns) == (n_vit_h, n_vit_w), name
        assert (prepared.fit.rows, prepared.fit.columns) == (n_llm_h, n_llm_w), name
        assert prepared.tokens == span_length(n_llm_h, n_llm_w) == v41_vision_golden[f"{name}.span_rows"].shape[0]
        assert prepared.patches.dtype == torch.bfloat16
        assert torch.equal(
            prepared.patches.view(torch.int16), v41_vision_golden[f"{name}.patches"].view(torch.int16)
        ), name


def release_vision_args() -> VisionArgs:
    """The release's tower (DeepSeek-V4.1-Flash ``inference/config.json``: ``vision_*``)."""
    args = VisionArgs.from_config(
        {
            "vision_config": {
                "num_hidden_layers": 32,
                "hidden_size": 1024,
                "num_attention_heads": 16,
                "intermediate_size": 2816,
            },
            "image_token_id": 129264,
            "hidden_size": 5120,
        }  # fmt: skip
    )
    assert args is not None and (args.max_n_token, args.min_pixels, args.patch_size) == (1024, 544**2, 14)
    return args


def test_decoding_and_preprocessing_equal_the_official_on_120_mixed_images() -> None:
    """``sample_images``: PNG (RGB, RGBA, grey, grey + alpha, palette, palette with a transparent
    index, 16-bit grey, bilevel), JPEG (RGB, grey, CMYK, every EXIF orientation), WebP (lossless,
    lossy with alpha) and two-frame GIFs, 1 to 2,600 pixels a side, against what the official
    ``image_processor.load_image`` made of the same bytes (``preprocessing.json``, see the README).

    Where one pass of the official plan already gives the size DeepSeek's serving adapter settles
    on (117 of the 120), our patches are the official ones bit for bit. Where it does not (3: long
    strips whose first plan is off by one patch), the adapter resizes the image to its settled size
    before the model's preprocessor sees it, and we pad to that size as it does: the token grid
    (what the prompt and usage count) is the official one, the patch grid one patch longer."""
    fixture = json.loads((FIXTURES / "preprocessing.json").read_text(encoding="utf-8"))
    args = release_vision_args()
    samples = sample_images(fixture["seed"], fixture["count"])
    kinds, unsettled = set(), []
    for sample, record in zip(samples, fixture["images"], strict=True):
        assert hashlib.sha256(sample.data).hexdigest() == record["bytes_sha256"], (
            f"sample_images wrote other bytes for image {record['name']} ({record['description']}): a changed "
            "Pillow encoder or generator; regenerate preprocessing.json as the README says"
        )
        official_patches, official_tokens = record["grid"][:2], record["grid"][2:]
        one_pass = plan_step(sample.width, sample.height, args)
        assert [one_pass.height // 14, one_pass.width // 14] == official_patches, record
        prepared = prepare_image(decode_image(sample.data, sample.media_type, record["name"]), "auto", args)
        assert [prepared.fit.rows, prepared.fit.columns] == official_tokens, record
        kinds.add(record["description"].split(" orientation")[0])
        if [prepared.patch_rows, prepared.patch_columns] != official_patches:
            assert (prepared.fit.width, prepared.fit.height) != (one_pass.width, one_pass.height)
            longer = [ours - theirs for ours, theirs in zip([prepared.patch_rows, prepared.patch_columns],
                                                             official_patches, strict=True)]  # fmt: skip
            assert sorted(longer) == [0, 1], record
            unsettled.append(record["name"])
            continue
        digest = hashlib.sha256(prepared.patches.contiguous().view(torch.int16).numpy().tobytes()).hexdigest()
        assert digest == record["patches_sha256"], record
    print(f"{len(samples) - len(unsettled)} bit for bit; settled by the adapter's rule: {unsettled}")
    assert len(kinds) == 15 and len(samples) - len(unsettled) >= 100


def test_sizes_and_token_counts_equal_the_recipes_image_fit() -> None:
    """With the release's constants, the preprocessed size and token count of every detail
    level equal what the protocol side reports (``powertrain_recipe``'s ``image_fit``, itself
    checked against DeepSeek's adapter)."""
    native = pytest.importorskip("powertrain_recipe._native")
    release = release_vision_args()
    rng = random.Random(20261207)
    sizes = [(max(1, int(np.exp(rng.uniform(0, np.log(40_000))))), max(1, int(np.exp(rng.uniform(0, np.log(40_000))))))
             for _ in range(3000)]  # fmt: skip
    sizes += [(w, h) for w in (1, 13, 14, 42, 543, 544, 545, 2000) for h in (1, 29, 500, 544, 9000, 16_400)]
    compared = 0
    for width, height in sizes:
        for detail in ("low", "high", "auto", "original"):
            try:
                theirs = native.image_fit(width, height, detail)
            except ValueError:
                theirs = None
            try:
                fit = fit_image(width, height, detail, release)
                ours = (fit.width, fit.height, fit.tokens)
            except ValueError:
                ours = None
            assert ours == theirs, (width, height, detail)
            compared += theirs is not None
    assert compared > 10_000


# --------------------------------------------------------------------------- the tower and the prompt


def test_span_rows_match_the_official_exact_math(v41_vision_golden: dict, v41_vision_provenance: dict, model) -> None:
    for name in v41_vision_provenance["images"]:
        rows = model.vision_tower.encode_image(fixture_image_pixels(v41_vision_provenance, name), "auto")
        error = relative(rows, v41_vision_golden[f"{name}.exact_span_rows"])
        print(f"{name}: span rows {list(rows.shape)}, max |diff| / max |row| = {error:.2e}")
        assert error <= ROW_TOLERANCE, name


def test_the_bfloat16_tower_matches_the_official_bfloat16_one(
    v41_vision_golden: dict, v41_vision_provenance: dict, v41_vision_checkpoint: Path
) -> None:
    model = load_tiny_v41(v41_vision_checkpoint, torch.bfloat16)
    for name in v41_vision_provenance["images"]:
        rows = model.vision_tower.encode_image(fixture_image_pixels(v41_vision_provenance, name), "auto")
        assert rows.dtype == torch.bfloat16
        assert relative(rows, v41_vision_golden[f"{name}.span_rows"]) <= BF16_ROW_TOLERANCE, name


def test_prefill_of_prompts_with_images_matches_the_official_exact_math(
    v41_vision_golden: dict, v41_vision_provenance: dict, model
) -> None:
    """Both prompts in one step (p1: two images with text between and after them; p2: the wide
    one): image rows in place of the embeddings, their router bias, Engram stopping at them."""
    runner = runner_of(model)
    chunks, spans = [], []
    for prompt in v41_vision_provenance["prompts"]:
        offset = sum(len(tokens) for _, tokens in chunks)
        chunks.append((prompt, v41_vision_golden[f"{prompt}.tokens"].tolist()))
        rows = image_rows_of(model, v41_vision_golden, v41_vision_provenance, prompt, offset)
        spans.append(rows)
    image_rows = ImageRows(torch.cat([r.rows for r in spans]), torch.cat([r.embeds for r in spans]))
    outputs = runner.step(chunks, image_rows=image_rows)
    for (prompt, _), logits in zip(chunks, outputs, strict=True):
        assert_logits_match(logits, v41_vision_golden[f"{prompt}.exact_prefill_logits"], f"{prompt} prefill")
        # The rule against the official bfloat16 run (FP8 activations): no further from it
        # than the official exact math is.
        official = v41_vision_golden[f"{prompt}.prefill_logits"].float()
        allowed = row_errors(v41_vision_golden[f"{prompt}.exact_prefill_logits"], official) + TOLERANCE
        assert bool((row_errors(logits, official) <= allowed).all()), prompt


def test_chunked_prefill_across_image_spans_matches(
    v41_vision_golden: dict, v41_vision_provenance: dict, model
) -> None:
    """p1 in chunks of 7 (an image span split across chunks, text after a span in a later
    chunk than the span: Engram's n-grams read the cached image positions as dead), then the
    greedy token fed back as a decode step checks nothing breaks after the prompt."""
    runner = runner_of(model)
    tokens = v41_vision_golden["p1.tokens"].tolist()
    everything = image_rows_of(model, v41_vision_golden, v41_vision_provenance, "p1")
    rows = []
    for start in range(0, len(tokens), 7):
        here = (everything.rows >= start) & (everything.rows < start + 7)
        chunk_rows = ImageRows(everything.rows[here] - start, everything.embeds[here])
        rows.append(runner.step([("p1", tokens[start : start + 7])], image_rows=chunk_rows)[0])
    assert_logits_match(torch.cat(rows), v41_vision_golden["p1.exact_prefill_logits"], "p1 in chunks of 7")
    decode = runner.step([("p1", [int(rows[-1][-1].argmax())])])[0]
    assert decode.shape == (1, 512) and bool(torch.isfinite(decode).all())


def test_a_misplaced_newline_or_the_text_router_bias_is_caught(
    v41_vision_golden: dict, v41_vision_provenance: dict, v41_vision_checkpoint: Path, model
) -> None:
    """The checks above would fail if the newline rows went at the start of each token row
    instead of the end, or if image rows routed with the text bias."""
    prompt = "p2"
    name = images_of(prompt, v41_vision_provenance)[0]
    prepared = prepare_image(fixture_image_pixels(v41_vision_provenance, name), "auto", model.vision_args)
    rows = model.vision_tower.encode(prepared)
    r, c = prepared.fit.rows, prepared.fit.columns
    body = rows[1:-1].view(r, c + 1, -1)
    moved = torch.cat((rows[:1], torch.cat((body[:, -1:], body[:, :-1]), dim=1).flatten(0, 1), rows[-1:]))
    assert relative(moved, v41_vision_golden[f"{name}.exact_span_rows"]) > 100 * ROW_TOLERANCE
    tokens = v41_vision_golden[f"{prompt}.tokens"].tolist()
    start = int(v41_vision_golden[f"{prompt}.image_starts"][0])
    reference = v41_vision_golden[f"{prompt}.exact_prefill_logits"]
    moved_logits = runner_of(model).step([(prompt, tokens)], image_rows=ImageRows.of_spans([(start, moved)]))[0]
    assert row_errors(moved_logits, reference).max() > 100 * TOLERANCE
    text_biased = load_tiny_v41(v41_vision_checkpoint)
    for layer in text_biased.layers:
        layer.image_router_bias.copy_(layer.ffn.experts.e_score_correction_bias)
    logits = runner_of(text_biased).step([(prompt, tokens)], image_rows=ImageRows.of_spans([(start, rows)]))[0]
    assert row_errors(logits, reference).max() > 100 * TOLERANCE


# --------------------------------------------------------------------------- no fixture needed


def test_placeholders_expand_to_their_spans() -> None:
    rng = random.Random(11)
    image = 99
    for _ in range(50):
        counts = [rng.randint(5, 40) for _ in range(rng.randint(0, 4))]
        ids: list[int] = []
        for _ in counts:
            ids += [rng.randint(0, 98) for _ in range(rng.randint(0, 5))] + [image]
        ids += [rng.randint(0, 98) for _ in range(rng.randint(0, 5))]
        expanded, spans = expand_image_placeholders(ids, image, counts)
        assert len(expanded) == len(ids) - len(counts) + sum(counts)
        assert [length for _, length in spans] == counts
        assert [t for t in expanded if t != image] == [t for t in ids if t != image]
        for start, length in spans:
            assert expanded[start : start + length] == [image] * length
        assert sum(t == image for t in expanded) == sum(counts)
    with pytest.raises(ValueError, match=r"2 image placeholder\(s\) \(token \d+\) but 1 image\(s\)"):
        expand_image_placeholders([1, image, 2, image], image, [5])


def test_every_fit_is_a_settled_budgeted_grid_of_whole_patches() -> None:
    """Fresh sizes at the tiny tower's constants (a small budget and area): the fit is whole
    patches, within the budget, and preprocessing a random image gives that many patches."""
    args = VisionArgs.from_config(
        {"vision_config": dict(TINY_DEEPSEEK_V41_VISION_CONFIG), "image_token_id": 510, "hidden_size": 256}
    )
    assert args is not None
    rng = np.random.default_rng(IMAGE_SEED + 100)
    for _ in range(40):
        width, height = (int(v) for v in rng.integers(1, 700, 2))
        fit = fit_image(width, height, "auto", args)
        assert fit.width % 14 == 0 and fit.height % 14 == 0 and 3 <= fit.tokens <= args.max_n_token
        assert fit_image(fit.width, fit.height, "auto", args) == fit
        prepared = prepare_image(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "high", args)
        assert prepared.patches.shape == ((fit.width // 14) * (fit.height // 14), 3 * 14 * 14)


def test_images_are_refused_where_they_cannot_go(model, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="uint8"):
        prepare_image(np.zeros((10, 10, 4), dtype=np.uint8), "auto", model.vision_args)
    with pytest.raises(ValueError, match="unknown image detail"):
        fit_image(10, 10, "medium", model.vision_args)
    with pytest.raises(ValueError, match="int64"):
        ImageRows(torch.tensor([0], dtype=torch.int32), torch.zeros(1, 256))
    runner = runner_of(model)
    with pytest.raises(ValueError, match="index the batch"):
        runner.step([("a", [5, 6, 7])], image_rows=ImageRows(torch.tensor([3]), torch.zeros(1, 256)))
    text_only = load_tiny_v41(write_tiny_deepseek_v41(tmp_path / "text", seed=0))
    assert text_only.vision_tower is None
    with pytest.raises(ValueError, match="no vision tower"):
        runner_of(text_only).step([("a", [5, 6, 7])], image_rows=ImageRows(torch.tensor([1]), torch.zeros(1, 256)))

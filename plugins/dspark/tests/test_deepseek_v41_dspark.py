"""DeepSeek-V4.1's own DSpark drafter (the checkpoint's ``mtp.*``, the target's ``model.dspark``)
drafting through the block drafter.

Against DeepSeek's official code: the V4.1 golden fixtures (``core/tests/fixtures/deepseek_v41``,
README) record ``Transformer.forward_spec`` in exact float32 math after decode steps along two
paths: prompt ``a``'s (40 tokens, the window of 16 context entries always full) and a short
prompt ``c``'s (6 tokens, the window filling up as it decodes). Our float32 drafter gives the
same draft logits, drafts and confidences within the tolerance those fixtures' README derives
(1e-4 of the largest logit: float32 sums in another order), at the model and through the engine.

Against plain decoding: greedy speculation with the drafter keeps plain decoding's tokens
through chunked prefill, a neighbour, a prefix hit and preemption (its context entries are
written from accepted rows only, so a rejected draft leaves nothing it reads)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from safetensors.torch import load_file

from powertrain import LLM, SamplingParams
from powertrain.builtin.reference_attention import TorchReferenceAttention
from powertrain.config import EngineConfig
from powertrain.interfaces import AttentionMetadata, TapRecorder
from powertrain.llm import apply_overrides
from powertrain.models.deepseek_v41 import DeepseekV41ForCausalLM
from powertrain.testing.deepseek_v41 import load_tiny_v41, write_tiny_deepseek_v41
from powertrain.testing.drafters import spy_on_block_drafts
from powertrain.testing.paged import PagedRunner

FIXTURES = Path(__file__).parents[3] / "core" / "tests" / "fixtures" / "deepseek_v41"
#: As the V4.1 fixtures' README derives it: our float32 against the official exact math, relative
#: to the largest logit (the widest float32 sum, the mHC mix over 1,024 terms, is off by at most
#: 6.1e-5 relative).
TOLERANCE = 1e-4
#: Entries per block: a multiple of the largest compress ratio (2).
BLOCK = 4


@pytest.fixture(scope="module")
def golden() -> dict[str, torch.Tensor]:
    return load_file(FIXTURES / "golden.safetensors")


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_deepseek_v41(tmp_path_factory.mktemp("v41"), seed=0)


def relative(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return float(((ours - reference).abs().amax(-1) / reference.abs().amax(-1)).max())


def test_the_checkpoints_drafter_is_loaded_and_reads_the_streams_entering_its_target_layers(folder: Path) -> None:
    model = load_tiny_v41(folder)
    assert model.dspark is not None and "DSpark's drafter (speculative decoding)" not in model.not_used
    assert [(tap.layer, tap.form) for tap in model.dspark.taps] == [(4, "streams_mean_in"), (5, "streams_mean_in")]
    assert (model.dspark.block_size, model.dspark.mask_token_id) == (2, 511)
    (spec,) = model.dspark.attention_layers
    assert spec.kind == "custom" and [g.sliding_window for g in spec.cache_groups] == [None]


class DraftOracle:
    """The drafter outside the engine, over one sequence: the target over all of ``path`` in one
    forward (its taps of every position), every context entry written, then a block from any
    anchor position over the entries before it."""

    def __init__(self, model: DeepseekV41ForCausalLM, path: list[int]) -> None:
        self.dspark, self.path = model.dspark, path
        target = PagedRunner(model, TorchReferenceAttention(), block_size=BLOCK, num_blocks=64)
        model.taps = TapRecorder(self.dspark.taps)
        target.step([("s", path)])
        taps = model.taps.taken()
        model.taps = None
        layers = self.dspark.attention_layers
        self.runner = PagedRunner(
            self.dspark, TorchReferenceAttention(), block_size=BLOCK, num_blocks=64, layers=layers
        )
        metadata, positions = self.runner.metadata([("s", path)])
        with torch.inference_mode():
            self.dspark.write_context(self.dspark.context(taps), positions, self.runner.caches, metadata)

    @torch.inference_mode()
    def block(self, anchor: int, token: int, previous: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Markov-corrected logits ``[block, vocab]`` and raw confidences of the block drafted from
        ``token`` at position ``anchor``, each draft's Markov bias from ``previous``'s token."""
        size = self.dspark.block_size
        metadata = AttentionMetadata.build(
            query_lens=[size], seq_lens=[anchor + size], block_tables=[self.runner.blocks["s"]], block_size=BLOCK
        )
        ids = torch.tensor([token] + [self.dspark.mask_token_id] * (size - 1))
        hidden = self.dspark.block(ids, torch.arange(anchor, anchor + size), self.runner.caches, metadata)
        logits = self.dspark.corrected_logits(self.dspark.base_logits(hidden), previous, hidden)
        return logits, self.dspark.confidence_logit(hidden, previous)

    def greedy(self, anchor: int, count: int) -> tuple[list[int], list[float]]:
        """The greedy drafts from the path's token at ``anchor`` and their confidences (sigmoid)."""
        size, drafts = self.dspark.block_size, [self.path[anchor]]
        for k in range(count):  # each draft's Markov bias needs the one before (the rest unused)
            logits, confidence = self.block(anchor, self.path[anchor], torch.tensor((drafts + [0] * size)[:size]))
            drafts.append(int(logits[k].argmax()))
        return drafts[1:], torch.sigmoid(confidence[:count]).tolist()


@pytest.mark.parametrize("key", ["main.a", "main.c"])
def test_draft_logits_and_confidences_equal_the_official_forward_spec(
    key: str, folder: Path, golden: dict[str, torch.Tensor]
) -> None:
    """One block per recorded step: the anchor path[p + 1] and the noise token at p + 1 on, over
    the context entries of positions <= p. The Markov-corrected logits along the official greedy
    drafts, the drafts themselves and the raw confidences."""
    path = torch.cat([golden[f"{key}.prompt"], golden[f"{key}.tokens"]]).tolist()
    oracle = DraftOracle(load_tiny_v41(folder), path)
    worst = {"logits": 0.0, "confidence": 0.0}
    steps = golden[f"{key}.dspark_positions"].tolist()
    for step, position in enumerate(steps):
        anchor = golden[f"{key}.dspark_anchors"][step]
        assert int(anchor) == path[position + 1]
        drafted = golden[f"{key}.dspark_drafts"][step]
        logits, confidence = oracle.block(position + 1, int(anchor), torch.cat([anchor[None], drafted[:-1]]))
        worst["logits"] = max(worst["logits"], relative(logits, golden[f"{key}.dspark_logits"][step]))
        reference = golden[f"{key}.dspark_confidence"][step]
        worst["confidence"] = max(
            worst["confidence"], float((confidence - reference).abs().max() / reference.abs().max())
        )
        assert logits.argmax(-1).tolist() == drafted.tolist(), f"{key}: drafts after position {position}"
    print(f"{key}: {len(steps)} blocks, max relative differences {worst}")
    assert worst["logits"] <= TOLERANCE and worst["confidence"] <= TOLERANCE, worst


def engine_config(folder: Path, speculative: str = "fixed-k", **settings: Any) -> EngineConfig:
    dspark = {"drafter": "block", "max_draft_tokens": 2, "profile_sequences": [1], **settings.pop("dspark", {})}
    base = {"path": str(folder), "dtype": "float32", "speculative": speculative, "block_size": BLOCK}
    config = apply_overrides(EngineConfig(), {**base, **settings})
    return attrs.evolve(config, sections={"dspark": dspark}) if speculative != "none" else config


def test_engine_proposals_equal_the_official_forward_spec(folder: Path, golden: dict[str, torch.Tensor]) -> None:
    """Prompt c through the engine, greedy, fixed-k speculation with the checkpoint's drafter: the
    engine's continuation is the official exact one, and every block drafted at a recorded anchor
    has the official drafts and confidences (the engine's own taps, cache writes from accepted rows
    and drafting together)."""
    prompt, tokens = golden["main.c.prompt"].tolist(), golden["main.c.tokens"].tolist()
    expected = {p + 1: i for i, p in enumerate(golden["main.c.dspark_positions"].tolist())}
    with LLM(config=engine_config(folder, num_blocks=96)) as llm:
        drafted = spy_on_block_drafts(llm.speculative_policy.drafter)  # type: ignore[union-attr]
        params = SamplingParams(temperature=0, max_tokens=len(tokens), ignore_eos=True)
        output = llm.generate([prompt], [params])[0].outputs[0].token_ids
    proposals = [(len(history) - 1, drafts, confidences) for history, drafts, confidences in drafted()]
    assert list(output) == tokens, "the engine's greedy continuation is not the official exact one"
    checked = 0
    for anchor, drafts, confidences in proposals:
        if anchor not in expected or not drafts:
            continue
        step = expected[anchor]
        assert drafts == golden["main.c.dspark_drafts"][step][: len(drafts)].tolist(), f"anchor {anchor}"
        want = torch.sigmoid(golden["main.c.dspark_confidence"][step][: len(drafts)])
        torch.testing.assert_close(torch.tensor(confidences), want, atol=TOLERANCE, rtol=0, msg=f"anchor {anchor}")
        checked += 1
    print(f"{checked} blocks checked of {len(proposals)} proposals")
    assert checked >= 5


def generate(config: EngineConfig, prompts: list[list[int]], steps: int) -> tuple[list[list[int]], Any]:
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    with LLM(config=config) as llm:
        outputs = llm.generate(prompts, params)
        return [list(o.outputs[0].token_ids) for o in outputs], llm.engine


def test_greedy_speculation_with_its_own_drafter_keeps_plain_decodings_tokens(
    folder: Path, golden: dict[str, torch.Tensor]
) -> None:
    """Two requests sharing a 20-token prefix (the second hits the first's blocks), in prefill
    chunks of 7 tokens, then in a cache so small that one is preempted: the tokens of plain
    decoding. The tiny random drafter is never right, so every other proposal is handed on with
    plain decoding's own next tokens instead (accepted, so later context entries come after
    accepted drafts); every block the drafter made is the oracle's for its prefix."""
    shared = golden["main.a.prompt"].tolist()[:20]
    prompts = [shared + golden["main.b.prompt"].tolist()[:5], shared + golden["main.b.prompt"].tolist()[5:14]]
    steps = 20
    plain, _ = generate(engine_config(folder, "none", num_blocks=96), prompts, steps)
    paths = [prompt + tokens for prompt, tokens in zip(prompts, plain, strict=True)]
    runs = {
        "prefix hit, chunks of 7": engine_config(folder, num_blocks=96, prefix_caching=True, max_num_batched_tokens=7),
        "preemption": engine_config(folder, num_blocks=16, prefix_caching=False),
    }
    proposals: list[tuple[int, int, list[int], list[float]]] = []
    for what, config in runs.items():
        with LLM(config=config) as llm:
            drafter = llm.speculative_policy.drafter  # type: ignore[union-attr]
            drafter.propose = made_right_half_the_time(drafter.propose, paths, proposals)
            drafter.session = None  # whole blocks through propose, where the spy plants drafts
            params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
            first = llm.generate([prompts[0]], params)
            both = llm.generate(prompts, params)
            stats, engine = llm.engine.stats(), llm.engine
        got = [list(o.outputs[0].token_ids) for o in both]
        accepted, verified = stats.speculative_accepted_tokens, stats.speculative_verified_tokens
        print(f"{what}: {accepted} of {verified} drafts accepted; cached {[o.num_cached_tokens for o in both]}")
        assert 0 < accepted < verified, what
        assert [list(first[0].outputs[0].token_ids)] == plain[:1], what
        assert got == plain, what
        if what == "preemption":
            assert engine.scheduler.num_preemptions > 0
        else:
            assert both[1].num_cached_tokens >= 16
    model = load_tiny_v41(folder)
    oracles = [DraftOracle(model, path) for path in paths]
    for which, anchor, drafts, confidences in proposals:
        want, want_confidences = oracles[which].greedy(anchor, len(drafts))
        assert drafts == want, f"request {which}, anchor {anchor}"
        torch.testing.assert_close(torch.tensor(confidences), torch.tensor(want_confidences), atol=TOLERANCE, rtol=0)
    print(f"{len(proposals)} blocks equal the oracle's")


def made_right_half_the_time(propose: Any, paths: list[list[int]], seen: list) -> Any:
    """``propose``, recording each block it drafts (request, anchor, drafts, confidences), with
    every other block replaced by the path's own next tokens."""
    count = [0]

    def spy(slots: list) -> Any:
        drafted = propose(slots)
        tokens = []
        for slot, drafts, confidences in zip(slots, drafted.tokens, drafted.confidences, strict=True):
            anchor = len(slot.token_ids) - 1
            (which,) = [i for i, path in enumerate(paths) if path[: anchor + 1] == list(slot.token_ids)]
            if drafts:
                seen.append((which, anchor, list(drafts), list(confidences)))
            count[0] += 1
            right = paths[which][anchor + 1 : anchor + 1 + len(drafts)]
            tokens.append(right if count[0] % 2 and len(right) == len(drafts) else list(drafts))
        return attrs.evolve(drafted, tokens=tokens)

    return spy

"""Speculative decoding on DeepSeek-V3.2, whose indexer keys live in the paged cache.

A verify step writes the indexer key of every draft position beside MLA's latent; when
drafts are rejected those entries are stale until the positions are computed again,
and the Lightning Indexer must never pick them. Tiny random float32 V3.2 checkpoints
(``write_tiny_deepseek_v32``, ``index_topk`` 8) with prompts of 12-40 tokens, so the
top-k selection drops most of the context:

- greedy: the n-gram drafter (repetitive prompts, so it proposes; prompts quoting the
  model's own continuation, so some drafts are accepted) and the MTP drafter (V3.2's MTP
  block has an indexer of its own) give plain decoding's tokens, also with chunked
  prefill and with preemption mid-speculation; the checkpoint is a "mimic" (as in
  ``test_mtp.py``), whose next token depends mostly on the last one, so drafts are
  accepted often and rejected often, or plain random (the indexer's choice matters most);
- sampling: seeded requests through the engine with DSpark and the MTP drafter follow
  the exact law of the first tokens, computed from HF transformers' V3.2 (chi-square, as
  ``test_lossless.py`` does for its exact table target).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
import transformers  # the oracle for the sampling law; the locked dev group has DeepSeek-V3.2

from powertrain import LLM, SamplingParams
from powertrain.config import EngineConfig
from powertrain.llm import apply_overrides
from powertrain.testing import sampling_law
from powertrain.testing.base import fresh_seed
from powertrain.testing.checkpoints import TINY_DEEPSEEK_V32_CONFIG, mimic_mtp_layers, write_tiny_deepseek_v32
from powertrain.testing.sampling_law import SIGNIFICANCE
from powertrain_dspark.mtp import MTPDrafter

PROFILE = [1, 2]  # a short startup profile (sequence counts) keeps the tests quick
INDEX_TOPK = TINY_DEEPSEEK_V32_CONFIG["index_topk"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    seed = fresh_seed()
    print(f"checkpoint seed={seed}")
    return {
        "random": write_tiny_deepseek_v32(tmp_path_factory.mktemp("v32"), seed=seed, num_nextn_predict_layers=1),
        "mimic": mimic_mtp_layers(
            write_tiny_deepseek_v32(tmp_path_factory.mktemp("v32-mimic"), seed=seed, num_nextn_predict_layers=1)
        ),
    }


def engine_config(path: Path, speculative: str, dspark: dict[str, Any] | None = None, **settings: Any) -> EngineConfig:
    base = {"path": str(path), "dtype": "float32", "speculative": speculative, "block_size": 8, **settings}
    config = apply_overrides(EngineConfig(), base)
    if speculative == "none":
        return config
    return attrs.evolve(config, sections={"dspark": {"profile_sequences": PROFILE, **(dspark or {})}})


def generate(config: EngineConfig, batch: list[tuple[list[int], SamplingParams]]) -> tuple[list, Any]:
    with LLM(config=config) as llm:
        outputs = llm.generate([p for p, _ in batch], [s for _, s in batch])
        return [list(o.outputs[0].token_ids) for o in outputs], llm.engine.stats()


@pytest.fixture(scope="module")
def batch(checkpoints: dict[str, Path]) -> list[tuple[list[int], SamplingParams]]:
    """Random prompts longer than ``index_topk``; a motif repeated (the n-gram drafter
    proposes its continuation, which the model does not follow); prompts that quote the
    model's own greedy continuation of a prompt and then that prompt again (the mimic
    target's next token depends mostly on the last one, so it largely repeats itself and
    the drafts are accepted, up to where the longer context changes its mind); and one
    request that never speculates."""
    seed = fresh_seed()
    print(f"batch seed={seed}")
    generator = torch.Generator().manual_seed(seed)

    def tokens(n: int) -> list[int]:
        return torch.randint(2, 500, (n,), generator=generator).tolist()

    quoted = [tokens(12), tokens(16)]
    continuations, _ = generate(
        engine_config(checkpoints["mimic"], "none"),
        [(p, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)) for p in quoted],
    )
    prompts = [tokens(12), tokens(33), (tokens(5) * 5)[:23]]
    prompts += [prompt + continuation + prompt for prompt, continuation in zip(quoted, continuations, strict=True)]
    prompts.append(tokens(17))
    assert all(len(p) > INDEX_TOPK for p in prompts)
    greedy = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (40, 24, 40, 32, 36)]
    greedy.append(SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1))
    return list(zip(prompts, greedy, strict=True))


@pytest.fixture(scope="module")
def plain(checkpoints: dict[str, Path], batch: list) -> dict[str, list[list[int]]]:
    """Plain decoding's tokens for ``batch``, per checkpoint (default settings: chunked
    prefill, block size and preemption change nothing, as the V3.2 model tests check)."""
    done = {}
    for name in ("random", "mimic"):
        done[name], stats = generate(engine_config(checkpoints[name], "none"), batch)
        assert stats.speculative_request_steps == 0
    return done


def assert_rolled_back(stats: Any) -> None:
    """Drafts were verified, some accepted and some rejected (so entries were rolled back)."""
    verified, accepted = stats.speculative_verified_tokens, stats.speculative_accepted_tokens
    print(f"drafts: {accepted} of {verified} accepted, preemptions={stats.preemptions}")
    assert verified > 0, "no draft was verified: the comparison proves nothing"
    assert 0 < accepted < verified, f"{accepted} of {verified} drafts accepted: rejection not exercised"


# --------------------------------------------------------------------------- greedy


@pytest.mark.parametrize(
    ("drafter", "checkpoint", "speculative", "dspark", "settings"),
    [
        # Drafts only from 3-gram matches: the quoted prompts' continuations (mostly
        # accepted) and the motif's (rejected). With 1-gram matches the first verifications
        # mostly fail, the drafter's confidence drops and DSpark soon verifies nothing.
        ("ngram", "mimic", "dspark", {"ngram_min": 3}, {}),
        ("ngram", "random", "fixed-k", {"max_draft_tokens": 4}, {"max_num_batched_tokens": 16}),
        ("mtp", "mimic", "dspark", {}, {}),
        ("mtp", "mimic", "fixed-k", {"max_draft_tokens": 3}, {"max_num_batched_tokens": 16}),
    ],
    ids=["ngram-dspark", "ngram-random-fixed-4-chunked", "mtp-dspark", "mtp-fixed-3-chunked"],
)
@pytest.mark.usefixtures("steady_step_time")  # DSpark verifies the same drafts under any load
def test_greedy_outputs_equal_plain_decoding(
    checkpoints: dict[str, Path],
    batch: list,
    plain: dict[str, list[list[int]]],
    drafter: str,
    checkpoint: str,
    speculative: str,
    dspark: dict,
    settings: dict,
) -> None:
    path = checkpoints[checkpoint]
    speculated, stats = generate(engine_config(path, speculative, {"drafter": drafter, **dspark}, **settings), batch)
    assert speculated == plain[checkpoint]
    if checkpoint == "random":  # a random model follows few drafts (the quotes are the mimic's)
        assert stats.speculative_verified_tokens > stats.speculative_accepted_tokens
    else:
        assert_rolled_back(stats)


def test_greedy_outputs_survive_preemption_mid_speculation(
    checkpoints: dict[str, Path], batch: list, plain: dict[str, list[list[int]]]
) -> None:
    """Too few blocks for every request at once: preempted sequences recompute their
    indexer keys (the target's and the MTP's) from scratch while others speculate."""
    settings = {"block_size": 4, "prefix_caching": False}
    # 40 blocks of 4 tokens: room for the startup profile, not for the whole batch.
    dspark = {"drafter": "mtp", "max_draft_tokens": 3}
    config = engine_config(checkpoints["mimic"], "fixed-k", dspark, num_blocks=40, **settings)
    speculated, stats = generate(config, batch)
    assert stats.preemptions > 0, "the cache was meant to be too small for every request at once"
    assert speculated == plain["mimic"]
    assert_rolled_back(stats)


# --------------------------------------------------------------------------- sampling law

GENERATED = 3
RUNS = 1500
#: A fixed checkpoint and prompt for the law: with them the control below is known to have
#: power (with fresh ones the sparse and dense laws could happen to be close).
LAW_CHECKPOINT_SEED, LAW_PROMPT_SEED = 7, 11


@pytest.fixture(scope="module")
def law_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = write_tiny_deepseek_v32(
        tmp_path_factory.mktemp("v32-law"), seed=LAW_CHECKPOINT_SEED, num_nextn_predict_layers=1
    )
    return mimic_mtp_layers(path)


def exact_law(path: Path, prompt: list[int], params: SamplingParams, **config: Any) -> dict[tuple[int, ...], float]:
    """The law of the first ``GENERATED`` tokens under ``params``, from transformers' V3.2
    (which skips the MTP tensors; ``config`` overrides config.json)."""
    model = transformers.DeepseekV32ForCausalLM.from_pretrained(str(path), dtype=torch.float32, **config).eval()
    with torch.inference_mode():
        return sampling_law.exact_law(
            lambda tokens: model(input_ids=torch.tensor([tokens])).logits[0, -1], prompt, params, GENERATED
        )


def test_sampling_with_ngram_drafts_follows_the_exact_law(law_checkpoint: Path) -> None:
    """The n-gram drafter's drafts are point masses (prompt lookup): fixed-k verifies what it
    drafts for every request, the sampled token keeps or rejects them, and the output law
    must still be the target's exactly. This checkpoint's next token depends mostly on the
    last one, so the prompt first quotes, for each of the three tokens the sample can start
    with, that token and the model's greedy continuation of it, then ends with the tail they
    were drawn after: a sampled token has occurred before, and what followed it is a likely
    draft, kept often and rejected often."""
    tail = torch.randint(2, 500, (1, 12), generator=torch.Generator().manual_seed(LAW_PROMPT_SEED + 1))
    model = transformers.DeepseekV32ForCausalLM.from_pretrained(str(law_checkpoint), dtype=torch.float32).eval()
    quotes: list[int] = []
    with torch.inference_mode():
        for first in model(input_ids=tail).logits[0, -1].topk(3).indices.tolist():
            grown = torch.cat([tail, torch.tensor([[first]])], dim=1)
            quotes += model.generate(grown, max_new_tokens=3, min_new_tokens=3, do_sample=False)[0, -4:].tolist()
    prompt = quotes + tail[0].tolist()
    assert len(prompt) > INDEX_TOPK
    params = SamplingParams(temperature=2.0, top_k=3, max_tokens=GENERATED, ignore_eos=True)
    config = engine_config(law_checkpoint, "fixed-k", {"drafter": "ngram", "max_draft_tokens": 2}, max_num_seqs=32)
    with LLM(config=config) as llm:
        outputs = llm.generate([prompt] * RUNS, [attrs.evolve(params, seed=20_000 + i) for i in range(RUNS)])
        stats = llm.engine.stats()
    assert_rolled_back(stats)
    counts = sampling_law.count_outcomes(outputs)
    law = exact_law(law_checkpoint, prompt, params)
    assert set(counts) <= set(law), "an outcome the target cannot produce"
    p_value = sampling_law.chi_square_p(counts, law, RUNS)
    assert p_value > SIGNIFICANCE, f"output law differs from the target's: chi-square p = {p_value:.2e}"
    dense = exact_law(law_checkpoint, prompt, params, index_topk=4 * len(prompt))
    p_control = sampling_law.chi_square_p(counts, dense, RUNS)
    print(f"chi-square p = {p_value:.3g} against the sparse law, {p_control:.3g} against the dense one")
    assert p_control < SIGNIFICANCE, f"the dense-attention law passed (p = {p_control:.2e}): the test has no power"


@pytest.mark.usefixtures("steady_step_time")
def test_sampling_with_dspark_and_mtp_follows_the_exact_law(law_checkpoint: Path) -> None:
    """Seeded requests, top-k 3 so the law has 27 outcomes, temperature 2 so few of them
    are rare. The MTP drafter samples its drafts (q is its own distribution); DSpark
    verifies some of them, rejects part of those, and the rest of each sequence is
    computed over the entries the rejected drafts left. The step times DSpark weighs
    drafts against are a fixed cost model (``steady_step_time``), so its choices do not
    swing with the machine's load; like any chi-square test at 1e-3 on fresh samples,
    this one fails about once in a thousand runs of a correct engine.

    The control: the same counts against the law of the same model attending densely
    (``index_topk`` above the prompt's length) must fail, which shows both that the
    indexer's selection shapes the law and that the test can tell."""
    prompt = torch.randint(2, 500, (20,), generator=torch.Generator().manual_seed(LAW_PROMPT_SEED)).tolist()
    assert len(prompt) > INDEX_TOPK
    params = SamplingParams(temperature=2.0, top_k=3, max_tokens=GENERATED, ignore_eos=True)
    # Batches of 32, profiled at 32 (steps of more sequences extrapolate the last two counts).
    dspark = {"drafter": "mtp", "max_draft_tokens": 2, "profile_sequences": [1, 32]}
    config = engine_config(law_checkpoint, "dspark", dspark, max_num_seqs=32)
    with LLM(config=config) as llm:
        drafter = llm.speculative_policy.drafter  # type: ignore[union-attr]
        assert isinstance(drafter, MTPDrafter)  # V3.2's MTP block is an indexed MLA: it keeps its own keys
        assert drafter.kv_cache["index_keys"].shape[-1] == TINY_DEEPSEEK_V32_CONFIG["index_head_dim"]
        outputs = llm.generate([prompt] * RUNS, [attrs.evolve(params, seed=10_000 + i) for i in range(RUNS)])
        stats = llm.engine.stats()
    assert_rolled_back(stats)
    counts = sampling_law.count_outcomes(outputs)
    law = exact_law(law_checkpoint, prompt, params)
    assert len(law) == 3**GENERATED and sum(law.values()) == pytest.approx(1.0)
    assert set(counts) <= set(law), "an outcome the target cannot produce"
    p_value = sampling_law.chi_square_p(counts, law, RUNS)
    assert p_value > SIGNIFICANCE, f"output law differs from the target's: chi-square p = {p_value:.2e}"
    dense = exact_law(law_checkpoint, prompt, params, index_topk=4 * len(prompt))
    p_control = sampling_law.chi_square_p(counts, dense, RUNS)
    assert p_control < SIGNIFICANCE, f"the dense-attention law passed (p = {p_control:.2e}): the test has no power"

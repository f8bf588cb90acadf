"""Training the DSpark block drafter (``block_training``) on a tiny Qwen3 target.

- The dense training forward, fed the engine's own taps (recorded by ``HiddenStateLog``
  while the engine drafts), gives the outputs ``BlockDrafterModel.block`` gives through the
  engine's paged-cache path for every block the engine drafted (float32).
- ``train_drafter`` on the tiny target lowers the loss, writes a folder in DeepSpec's
  format (the names and shapes ``deepspec_drafter_shapes`` lists), which the engine loads
  and drafts with, through the target's head (the drafter's is a frozen copy of it); greedy
  outputs equal plain decoding's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from powertrain import LLM, SamplingParams
from powertrain.config import EngineConfig
from powertrain.llm import apply_overrides
from powertrain.models.dspark import read_drafter_config
from powertrain.testing import fresh_seed, write_tiny_deepspec_drafter, write_tiny_qwen3
from powertrain.testing.drafters import deepspec_drafter_shapes
from powertrain_dspark.block import BlockDrafter, shared_head
from powertrain_dspark.block_training import DenseBlockDrafter, HiddenStateLog, TrainSettings, train_drafter

DRAFT_BLOCK = 5


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_qwen3(tmp_path_factory.mktemp("target"), seed=3, num_hidden_layers=4)


def engine_config(target: Path, drafter: Path | None) -> EngineConfig:
    base = {"path": str(target), "dtype": "float32", "block_size": 4, "prefix_caching": False}
    if drafter is None:
        return apply_overrides(EngineConfig(), {**base, "speculative": "none"})
    config = apply_overrides(EngineConfig(), {**base, "speculative": "fixed-k"})
    dspark = {"drafter": "block", "draft_model": str(drafter), "max_draft_tokens": DRAFT_BLOCK}
    return attrs.evolve(config, sections={"dspark": dspark})


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(4, 500, (n,), generator=generator).tolist() for n in (3, 17, 40)]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def load_dense(folder: Path) -> DenseBlockDrafter:
    model = DenseBlockDrafter(read_drafter_config(folder))
    model.load_state_dict(load_file(str(folder / "model.safetensors")), strict=True)
    return model.eval()


def test_dense_training_forward_equals_the_engines_blocks(target: Path, tmp_path: Path) -> None:
    drafter_folder = write_tiny_deepspec_drafter(tmp_path / "drafter", target, seed=4, block_size=DRAFT_BLOCK)
    dense = load_dense(drafter_folder)
    log = HiddenStateLog(dense.config.target_layer_ids, torch.float32)
    blocks: list[tuple[int, list[int], int, torch.Tensor]] = []  # seq id, history, anchor, block outputs
    with LLM(config=engine_config(target, drafter_folder)) as llm:
        drafter = llm.speculative_policy.drafter  # type: ignore[union-attr]
        assert isinstance(drafter, BlockDrafter)
        observe, draft, block = drafter.observe, drafter._block, drafter.model.block
        jobs: list[Any] = []

        def observe_spy(step: Any) -> None:
            log.observe(step)
            observe(step)

        def draft_spy(drafted: Any) -> Any:
            jobs[:] = drafted
            return draft(drafted)

        def block_spy(*args: Any) -> torch.Tensor:
            out = block(*args)
            for job, rows in zip(jobs, out.view(len(jobs), DRAFT_BLOCK, -1), strict=True):
                blocks.append((job.slot.seq_id, list(job.slot.token_ids), job.anchor, rows.clone()))
            return out

        drafter.observe, drafter._block, drafter.model.block = observe_spy, draft_spy, block_spy  # type: ignore[method-assign]
        llm.generate(prompts(), [greedy(20)] * 3)
    sequences = log.sequences()
    assert len(blocks) > 20
    with torch.no_grad():
        for seq_id, history, anchor, engine_rows in blocks:
            tokens, taps, _ = sequences[seq_id]
            assert tokens[: anchor + 1].tolist() == history
            anchors = torch.tensor([[anchor]])
            rows = dense(taps[None, : anchor + 1], torch.tensor([history]), anchors)[0, 0]
            torch.testing.assert_close(rows, engine_rows, rtol=1e-5, atol=1e-5)
            previous = torch.tensor([history[-1]])
            engine_logits = drafter.model.corrected_logits(
                drafter.model.base_logits(engine_rows[:1]), previous, engine_rows[:1]
            )
            torch.testing.assert_close(dense.corrected_logits(rows[:1], previous), engine_logits, rtol=1e-5, atol=1e-4)
            confidence = torch.sigmoid(dense.confidence_logits(rows[:1], previous))  # type: ignore[arg-type]
            torch.testing.assert_close(confidence, drafter.model.confidence(engine_rows[:1], previous))


def test_training_lowers_the_loss_and_the_engine_drafts_with_the_result(target: Path, tmp_path: Path) -> None:
    out = tmp_path / "trained"
    settings = TrainSettings(steps=40, batch_size=4, num_anchors=8, lr=3e-3, seed=1)
    report = train_drafter(
        str(target), out, responses=24, max_tokens=40, layer_ids=[0, 2], num_layers=1,
        block_size=DRAFT_BLOCK, markov_rank=16, mask_token_id=3, settings=settings, held_out=0.25,
    )  # fmt: skip
    assert report["train_loss_last"] < report["train_loss_first"]
    assert report["held_out_after"]["loss"] < report["held_out_before"]["loss"]
    assert report["held_out_after"]["l1"] < report["held_out_before"]["l1"]

    config = json.loads((out / "config.json").read_text())
    with safe_open(str(out / "model.safetensors"), "pt") as saved:
        shapes = {name: tuple(saved.get_slice(name).get_shape()) for name in saved.keys()}  # noqa: SIM118
    assert shapes == deepspec_drafter_shapes(config)
    target_weights = load_file(str(target / "model.safetensors"))
    trained = load_file(str(out / "model.safetensors"))
    assert torch.equal(trained["embed_tokens.weight"], target_weights["model.embed_tokens.weight"])
    assert torch.equal(trained["lm_head.weight"], target_weights["lm_head.weight"])

    batch = prompts()
    with LLM(config=engine_config(target, None)) as llm:
        plain = [list(o.outputs[0].token_ids) for o in llm.generate(batch, [greedy(24)] * 3)]
    with LLM(config=engine_config(target, out)) as llm:
        drafted = [list(o.outputs[0].token_ids) for o in llm.generate(batch, [greedy(24)] * 3)]
        stats = llm.engine.stats()
        # The trained drafter's head is the target's (frozen copy): drafted through the target's.
        runner = llm.engine.runner
        drafter = runner.speculative.drafter
        assert drafter.base_logits == runner.model.compute_logits
        head = drafter.model.lm_head.weight
        saved = head.clone()
        head.mul_(1.01)  # no longer the same weights: the drafter keeps its own head
        assert not shared_head(drafter.model, runner.model, runner.device)
        head.copy_(saved)
        assert shared_head(drafter.model, runner.model, runner.device)
    assert drafted == plain
    assert stats.speculative_verified_tokens > 0


def test_copy_share_draws_that_fraction_of_text_tasks() -> None:
    """``--copy-share``: the share of prompts handing the model a text to repeat or rework,
    within sampling error (binomial, n = 2,000: 4.5 standard deviations is 0.05); unset,
    every task alike (2 of 12 are text tasks); out of range, refused."""
    from powertrain_dspark.block_training import TASKS, TEXT_TASKS, chat_prompts

    def share(prompts: list[str]) -> float:
        heads = [task.split(":")[0] for task in TEXT_TASKS]
        return sum(any(head in prompt for head in heads) for prompt in prompts) / len(prompts)

    seed = fresh_seed()
    assert len(TEXT_TASKS) == 2 and len(TASKS) == 12
    assert abs(share(chat_prompts(str, 2000, seed)) - 2 / 12) < 0.05, f"seed={seed}"
    for wanted in (0.0, 0.6, 1.0):
        assert abs(share(chat_prompts(str, 2000, seed, copy_share=wanted)) - wanted) < 0.05, (wanted, seed)
    with pytest.raises(ValueError, match="copy_share=1.5"):
        chat_prompts(str, 3, seed, copy_share=1.5)

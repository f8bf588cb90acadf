"""Training a confidence head (``powertrain-dspark train-confidence-head``).

``log_and_train`` generates with the engine, the MTP drafter logging every verified
draft (its features and acceptance probability, ``confidence_head.ConfidenceLog``), fits
a head on most of the log (``train_head``) and evaluates it on the rest. It drives the
engine, so it lives apart from the head itself, which the drafter loads.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from powertrain_dspark.calibration import expected_calibration_error
from powertrain_dspark.confidence_head import ConfidenceHead, ConfidenceLog
from powertrain_dspark.mtp import MTPDrafter
from powertrain_dspark.policy import SpeculativeDecoder


def train_head(
    features: torch.Tensor,
    labels: torch.Tensor,
    *,
    width: int = 64,
    steps: int = 300,
    lr: float = 1e-3,
    batch_size: int = 4096,
    seed: int = 0,
    validation: float = 0.2,
) -> tuple[ConfidenceHead, list[float]]:
    """Fit a head with BCE to soft labels (Adam, minibatches drawn with ``seed``);
    returns it and the training loss of every step.

    Early stopping: ``validation`` of the rows (drawn with ``seed``) are not trained on;
    the returned head is the step's whose loss on them was lowest. A few hundred drafts
    are few for a head over two hidden states, and the last step's head had memorised
    them (training loss 0.71 -> 0.12, held-out BCE 0.73, worse than a constant).
    """
    hidden_size = features.shape[1] // 2
    generator = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head = ConfidenceHead(hidden_size, width)
    order = torch.randperm(len(labels), generator=generator)
    held = max(1, int(len(labels) * validation)) if len(labels) > 1 and validation > 0 else 0
    val, fit = order[:held], order[held:]
    optimizer = torch.optim.Adam(head.parameters(), lr=lr, weight_decay=1e-4)
    losses = []
    best_loss, best_state = math.inf, copy.deepcopy(head.state_dict())
    with torch.enable_grad():
        for _ in range(steps):
            rows = fit[torch.randint(0, len(fit), (min(batch_size, len(fit)),), generator=generator)]
            loss = nn.functional.binary_cross_entropy_with_logits(head(features[rows]), labels[rows])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            if held:
                with torch.no_grad():
                    val_loss = nn.functional.binary_cross_entropy_with_logits(head(features[val]), labels[val]).item()
                if val_loss < best_loss:
                    best_loss, best_state = val_loss, copy.deepcopy(head.state_dict())
    if held:
        head.load_state_dict(best_state)
    return head.eval().requires_grad_(False), losses


def bce(predicted: torch.Tensor, labels: torch.Tensor) -> float:
    """Mean binary cross-entropy of probabilities against soft labels."""
    p = predicted.double().clamp(1e-6, 1 - 1e-6)
    y = labels.double()
    return float(-(y * p.log() + (1 - y) * (1 - p).log()).mean())


def evaluate(predicted: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """BCE and expected calibration error of confidences against acceptance probabilities."""
    if not len(labels):
        return {"bce": math.nan, "ece": math.nan}
    return {"bce": bce(predicted, labels), "ece": expected_calibration_error(predicted.tolist(), labels.tolist())}


def log_and_train(
    model: str,
    prompts: Sequence[Any],
    out: str | Path,
    *,
    max_tokens: int = 64,
    draft_tokens: int = 5,
    temperature: float = 0.0,
    steps: int = 300,
    lr: float = 1e-3,
    width: int = 64,
    held_out: float = 0.25,
    dtype: str = "auto",
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Generate from ``prompts`` (texts or token ids) with the MTP drafter of ``model``
    verifying ``draft_tokens`` drafts a step, log every verified draft, fit a head on
    most of them and save it to ``out``; returns held-out BCE and ECE of the head, of
    the raw confidence and of a constant (the mean label), overall and per position."""
    from powertrain import LLM, EngineConfig, SamplingParams

    say = progress or (lambda _: None)
    config = EngineConfig(sections={"dspark": {"drafter": "mtp", "max_draft_tokens": draft_tokens}})
    log = ConfidenceLog()
    with LLM(model, config=config, speculative="fixed-k", dtype=dtype) as llm:
        policy = llm.speculative_policy
        assert isinstance(policy, SpeculativeDecoder) and isinstance(policy.drafter, MTPDrafter)
        policy.drafter.log = log
        params = [
            SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True, seed=seed + i)
            for i in range(len(prompts))
        ]
        say(f"generating from {len(prompts)} prompts, {draft_tokens} drafts verified per step")
        llm.generate(list(prompts), params)
    features, labels, positions, raw = log.tensors()
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    cut = len(order) - max(1, int(len(order) * held_out))
    if cut < 1:
        raise ValueError(f"only {len(labels)} verified drafts were logged; use more prompts or tokens")
    fit, test = order[:cut], order[cut:]
    say(f"training on {len(fit)} drafts, evaluating on {len(test)}")
    head, losses = train_head(features[fit], labels[fit], width=width, steps=steps, lr=lr, seed=seed)
    head.save(out)
    mean_acceptance = float(labels.mean())
    predicted = head.confidence(features[test])
    constant = torch.full((len(test),), float(labels[fit].mean()))
    labels, positions, raw = labels[test], positions[test], raw[test]
    by_position = {}
    for k in positions.unique().tolist():
        at = positions == k
        by_position[int(k)] = {
            "drafts": int(at.sum()),
            "head": evaluate(predicted[at], labels[at]),
            "raw": evaluate(raw[at], labels[at]),
        }
    return {
        "drafts": len(order),
        "mean_acceptance": mean_acceptance,
        "train_loss_first": losses[0],
        "train_loss_last": sum(losses[-10:]) / len(losses[-10:]),
        "held_out": {
            "head": evaluate(predicted, labels),
            "raw": evaluate(raw, labels),
            "constant": evaluate(constant, labels),
        },
        "by_position": by_position,
    }

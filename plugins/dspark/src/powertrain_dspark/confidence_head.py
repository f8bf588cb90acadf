"""The MTP drafter's confidence head: what it sees, what it is trained on, its file.

c(k) = σ(MLP([g_k; e_k])): g_k is the MTP hidden state whose distribution draft k is
drawn from, e_k the embedding of the token before draft k (the sequence's last token
for k = 1), each RMS-normalised. Neither depends on draft k itself — only on the prefix
and the drafts before k — which is what keeps DSpark's choice of what to verify
lossless (see ``lengths.py``).

Training target: a draft drawn from q is accepted with probability
Σ_x min(p(x), q(x)) = 1 − ½‖p − q‖₁, p the target's distribution at that position given
the drafts before it (for greedy requests: 1 if the argmaxes agree, else 0). The head is
fitted with binary cross-entropy to that soft label, so it predicts the acceptance
probability itself rather than a noisy sample of it.

``log_and_train`` collects that data by generating with the engine (the MTP drafter
logs every verified draft, ``MTPDrafter.log``), fits a head and evaluates it on held-out
drafts: ``powertrain-dspark train-confidence-head``.

The file is safetensors: the two layers' tensors, and in the header's metadata the
format name, the model's hidden size and the head's width.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
from torch import nn

from powertrain.interfaces import SamplingParams, target_probs
from powertrain_dspark.calibration import expected_calibration_error

FORMAT = "powertrain-dspark-confidence-head/1"


def head_features(hidden: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
    """``[rows, 2·hidden]`` float32: the RMS-normalised MTP hidden state and embedding
    (the MTP's block output is not normalised, and its scale varies with depth)."""
    return torch.cat([_rms(hidden.float()), _rms(embedded.float())], dim=-1)


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + 1e-6)


def acceptance_probability(
    target_logits: torch.Tensor, drafts: Sequence[int], draft_probs: torch.Tensor | None, params: SamplingParams
) -> torch.Tensor:
    """``[len(drafts)]``: the probability that verification accepts each draft, given
    the ones before it: Σ min(p, q) with p the target's processed distribution and q the
    draft's (a point mass at the draft when ``draft_probs`` is None)."""
    p = target_probs(target_logits, params)
    if draft_probs is None:
        return p[torch.arange(len(drafts)), torch.tensor(list(drafts), dtype=torch.int64)]
    return torch.minimum(p, draft_probs.float()).sum(dim=-1).clamp(0, 1)


class ConfidenceHead(nn.Module):
    """Linear(2H → width) → SiLU → Linear(width → 1); ``forward`` returns logits."""

    def __init__(self, hidden_size: int, width: int = 64) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.width = width
        self.fc1 = nn.Linear(2 * hidden_size, width)
        self.fc2 = nn.Linear(width, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.fc2(nn.functional.silu(self.fc1(features))).squeeze(-1)

    def confidence(self, features: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self(features))

    def save(self, path: str | Path) -> None:
        from safetensors.torch import save_file

        tensors = {name: t.detach().float().cpu().contiguous() for name, t in self.state_dict().items()}
        metadata = {"format": FORMAT, "hidden_size": str(self.hidden_size), "width": str(self.width)}
        save_file(tensors, str(path), metadata=metadata)

    @classmethod
    def load(cls, path: str | Path, hidden_size: int | None = None) -> ConfidenceHead:
        """Raises ValueError when ``path`` is not a head file, or was trained for a model
        of another hidden size."""
        from safetensors import safe_open
        from safetensors.torch import load_file

        hint = "write one with `powertrain-dspark train-confidence-head`"
        try:
            with safe_open(str(path), "pt") as f:
                metadata = f.metadata() or {}
            tensors = load_file(str(path))
            if metadata.get("format") != FORMAT:
                raise ValueError(f"format {metadata.get('format')!r}, expected {FORMAT!r}")
            head = cls(int(metadata["hidden_size"]), int(metadata["width"]))
            head.load_state_dict(tensors)
        except (OSError, ValueError, KeyError, RuntimeError) as exc:
            raise ValueError(f"{path}: not a DSpark confidence head ({exc}); {hint}") from exc
        if hidden_size is not None and head.hidden_size != hidden_size:
            raise ValueError(
                f"{path}: the confidence head was trained for hidden size {head.hidden_size}, "
                f"but this model's is {hidden_size}; train one for this model ({hint})"
            )
        return head.eval().requires_grad_(False)


@attrs.define
class ConfidenceLog:
    """Training data an MTP drafter collects (``MTPDrafter.log``): one row per verified draft."""

    features: list[torch.Tensor] = attrs.field(factory=list)  # [n, 2H] each
    labels: list[torch.Tensor] = attrs.field(factory=list)  # acceptance probabilities
    positions: list[torch.Tensor] = attrs.field(factory=list)  # k = 1, 2, ...
    raw: list[torch.Tensor] = attrs.field(factory=list)  # the drafter's own confidence

    def add(self, features: torch.Tensor, labels: torch.Tensor, raw: Sequence[float]) -> None:
        self.features.append(features.float().cpu())
        self.labels.append(labels.float().cpu())
        self.positions.append(torch.arange(1, len(labels) + 1))
        self.raw.append(torch.tensor(list(raw), dtype=torch.float32))

    def __len__(self) -> int:
        return sum(len(labels) for labels in self.labels)

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(features, labels, positions, raw confidences), rows concatenated."""
        if not self.labels:
            raise ValueError("the log holds no verified drafts")
        return torch.cat(self.features), torch.cat(self.labels), torch.cat(self.positions), torch.cat(self.raw)


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
    from powertrain import LLM, SamplingParams
    from powertrain.config import EngineConfig
    from powertrain.llm import apply_overrides
    from powertrain_dspark.mtp import MTPDrafter

    say = progress or (lambda _: None)
    config = apply_overrides(EngineConfig(), {"path": model, "speculative": "fixed-k", "dtype": dtype})
    config = attrs.evolve(config, sections={"dspark": {"drafter": "mtp", "max_draft_tokens": draft_tokens}})
    log = ConfidenceLog()
    with LLM(config=config) as llm:
        drafter = llm.engine.runner.speculative.drafter
        assert isinstance(drafter, MTPDrafter)
        drafter.log = log
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

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

The MTP drafter logs every verified draft's features and label into a ``ConfidenceLog``
(``MTPDrafter.log``); ``training.py`` collects such a log by generating with the engine,
fits a head and evaluates it on held-out drafts (``powertrain-dspark
train-confidence-head``).

The file is safetensors: the two layers' tensors, and in the header's metadata the
format name, the model's hidden size and the head's width.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import attrs
import torch
from torch import nn

from powertrain.interfaces import SamplingParams, target_probs

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

"""Per-position confidence calibration: sequential temperature scaling, and its error.

A drafter's raw confidence r(k) for position k becomes c(k) = σ(logit(r(k)) / T_k).
DSpark ranks drafts by survival a(j) = c(1)·…·c(j), so what must be calibrated is the
survival, position by position: T_1 is fitted on whether position 1 was accepted;
then, with T_1 fixed, T_2 on whether positions 1 and 2 both were, predicted by
c(1)·c(2); and so on (each fit on the records that verified at least that many
drafts). Expected calibration error (ECE, equal-width bins) of the survival is
reported per position, before and after, on held-out records.

A record is one request-step that verified drafts: the raw confidences of the
verified positions and how many of them were accepted.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from pathlib import Path

import attrs
import torch


@attrs.frozen
class Record:
    raw: tuple[float, ...]  # raw confidence of each verified position
    accepted: int  # how many of them were accepted (a prefix)


@attrs.frozen
class Calibration:
    """Temperatures per position (1-based k -> T_k = temperatures[k-1]); positions past
    the fitted ones reuse the last temperature."""

    temperatures: tuple[float, ...] = ()

    def apply(self, raw: Sequence[float]) -> list[float]:
        if not self.temperatures:
            return [min(max(float(r), 0.0), 1.0) for r in raw]
        out = []
        for k, r in enumerate(raw):
            t = self.temperatures[min(k, len(self.temperatures) - 1)]
            out.append(1.0 / (1.0 + math.exp(-_logit(r) / t)))
        return out

    def save(self, path: str | Path, report: dict | None = None) -> None:
        Path(path).write_text(json.dumps({"temperatures": list(self.temperatures), "report": report or {}}, indent=2))

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        try:
            data = json.loads(Path(path).read_text())
            temperatures = tuple(float(t) for t in data["temperatures"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(
                f"{path}: not a DSpark calibration file ({exc}); write one with `powertrain-dspark calibrate`"
            ) from exc
        if any(not t > 0 for t in temperatures):
            raise ValueError(f"{path}: temperatures must be > 0, got {temperatures}")
        return cls(temperatures)


def _logit(p: float) -> float:
    p = min(max(float(p), 1e-6), 1 - 1e-6)
    return math.log(p / (1 - p))


def fit(records: Sequence[Record], max_positions: int | None = None) -> Calibration:
    """Sequential temperature scaling (module doc)."""
    depth = max((len(r.raw) for r in records), default=0)
    if max_positions is not None:
        depth = min(depth, max_positions)
    temperatures: list[float] = []
    for k in range(depth):
        rows = [r for r in records if len(r.raw) > k]
        if not rows:
            break
        # survival before position k under the temperatures fitted so far (fixed)
        before = torch.tensor([_survival(r.raw[:k], temperatures) for r in rows], dtype=torch.float64)
        logits = torch.tensor([_logit(r.raw[k]) for r in rows], dtype=torch.float64)
        labels = torch.tensor([1.0 if r.accepted > k else 0.0 for r in rows], dtype=torch.float64)
        temperatures.append(_fit_temperature(before, logits, labels))
    return Calibration(tuple(temperatures))


def _survival(raw: Sequence[float], temperatures: Sequence[float]) -> float:
    return math.prod(Calibration(tuple(temperatures)).apply(raw)) if raw else 1.0


def _fit_temperature(before: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor) -> float:
    """argmin over T of the binary NLL of ``before · σ(logits / T)`` against ``labels``."""
    log_t = torch.zeros((), dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.LBFGS([log_t], lr=0.5, max_iter=100, line_search_fn="strong_wolfe")

    def loss() -> torch.Tensor:
        optimizer.zero_grad()
        p = (before * torch.sigmoid(logits / log_t.exp())).clamp(1e-9, 1 - 1e-9)
        value = -(labels * p.log() + (1 - labels) * (1 - p).log()).mean()
        value.backward()
        return value

    optimizer.step(loss)
    return float(log_t.detach().clamp(-5, 5).exp())


def expected_calibration_error(predicted: Sequence[float], outcomes: Sequence[float], bins: int = 10) -> float:
    """Σ_bins (n_bin / n)·|mean prediction − mean outcome| over equal-width bins."""
    if not predicted:
        return float("nan")
    totals = [[0, 0.0, 0.0] for _ in range(bins)]
    for p, y in zip(predicted, outcomes, strict=True):
        b = totals[min(int(p * bins), bins - 1)]
        b[0] += 1
        b[1] += p
        b[2] += y
    return sum(abs(s - y) for n, s, y in totals if n) / len(predicted)


def survival_ece(records: Sequence[Record], calibration: Calibration) -> dict[int, float]:
    """ECE of the predicted survival a(k) against 'positions 1..k all accepted', per position k."""
    result = {}
    depth = max((len(r.raw) for r in records), default=0)
    for k in range(depth):
        rows = [r for r in records if len(r.raw) > k]
        predicted = [math.prod(calibration.apply(r.raw[: k + 1])) for r in rows]
        result[k + 1] = expected_calibration_error(predicted, [1.0 if r.accepted > k else 0.0 for r in rows])
    return result


def split(records: Sequence[Record], held_out: float = 0.5, seed: int = 0) -> tuple[list[Record], list[Record]]:
    """(fit, held-out) records, shuffled with ``seed``."""
    shuffled = list(records)
    random.Random(seed).shuffle(shuffled)
    cut = int(len(shuffled) * (1 - held_out))
    return shuffled[:cut], shuffled[cut:]


def read_log(path: str | Path) -> list[Record]:
    """Records from a DSpark log (one JSON object per line: {"raw": [...], "accepted": n})."""
    records = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
            records.append(Record(tuple(float(x) for x in data["raw"]), int(data["accepted"])))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{number}: not a DSpark log record ({exc})") from exc
    return records

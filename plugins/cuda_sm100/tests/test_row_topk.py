"""The indexer's top-k kernel (``kernels/row_topk.py``) under the Triton interpreter, against
``torch.topk``: distinct scores give the same columns in the same order; with ties, the same
values best first and distinct columns; ``-inf`` (keys a token cannot see) gives ``-1``."""

from __future__ import annotations

import pytest
import torch

from powertrain.testing.base import fresh_seed
from powertrain_cuda_sm100.kernels.row_topk import MAX_WIDTH, row_topk


@pytest.fixture
def gen() -> torch.Generator:
    seed = fresh_seed()
    print(f"seed={seed}")
    return torch.Generator().manual_seed(seed)


def _oracle(scores: torch.Tensor, width: int) -> torch.Tensor:
    values, columns = scores.topk(width, dim=-1)
    return columns.masked_fill(values == float("-inf"), -1).to(torch.int32)


@pytest.mark.parametrize(("columns", "width"), [(1, 1), (37, 9), (64, 64), (100, 33), (300, 128)])
def test_distinct_scores_give_torch_topk_exactly(gen: torch.Generator, columns: int, width: int) -> None:
    """Scores of both signs and wide range; rows whose last columns are ``-inf``, some with
    fewer visible keys than ``width``."""
    scores = torch.randn(6, columns, generator=gen) * torch.logspace(-3, 3, 6)[:, None]
    for row, visible in enumerate((columns, columns // 2, width // 2, 0, columns - 1, 1)):
        scores[row, max(visible, 0) :] = float("-inf")
    got = row_topk(scores, width)
    assert got.dtype == torch.int32 and got.shape == (6, width)
    assert torch.equal(got, _oracle(scores, width)), f"{got}\n{_oracle(scores, width)}"


@pytest.mark.parametrize("width", [1, 7, 16, 40])
def test_ties_give_the_same_values_best_first(gen: torch.Generator, width: int) -> None:
    """Few distinct values (so the width-th largest is tied many times over, and the radix
    passes meet equal keys); +0.0 and -0.0 among them."""
    scores = torch.randint(-3, 4, (5, 90), generator=gen).float()
    scores[0] = torch.where(scores[0] == 0, -0.0, scores[0])
    scores[4, 50:] = float("-inf")
    got = row_topk(scores, width)
    want_values = scores.topk(width, dim=-1).values
    for row in range(5):
        picked = got[row].long()
        assert len(set(picked.tolist())) == width, f"row {row}: a column picked twice: {picked}"
        assert torch.equal(scores[row, picked], want_values[row]), f"row {row}: {scores[row, picked]}"


def test_every_column_and_the_largest_width() -> None:
    """``width`` = columns picks every column; the largest width sorts a full register tile."""
    scores = torch.randn(2, 50)
    got = row_topk(scores, 50)
    assert torch.equal(got, _oracle(scores, 50))
    wide = torch.randn(1, MAX_WIDTH + 3)
    assert torch.equal(row_topk(wide, MAX_WIDTH), _oracle(wide, MAX_WIDTH))


def test_bad_input_is_refused_with_what_to_do() -> None:
    with pytest.raises(ValueError, match=r"picks 1 to min\(columns, 4096\) = 5 per row, got 6"):
        row_topk(torch.randn(2, 5), 6)
    with pytest.raises(ValueError, match=r"float32 scores with a contiguous last dimension, got torch.float16"):
        row_topk(torch.randn(2, 5).half(), 2)
    with pytest.raises(ValueError, match=r"contiguous last dimension"):
        row_topk(torch.randn(5, 2).T, 2)
    assert row_topk(torch.empty(0, 5), 3).shape == (0, 3)

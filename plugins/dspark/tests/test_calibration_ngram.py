"""Per-position temperature scaling recovers a known miscalibration and lowers the
held-out calibration error; the n-gram drafter drafts what the sequence repeats and
learns from outcomes."""

from __future__ import annotations

import json
import math
import random

import pytest

from powertrain.interfaces.sampling import SamplingParams
from powertrain.interfaces.speculative import DraftSlot
from powertrain_dspark.calibration import (
    Calibration,
    Record,
    expected_calibration_error,
    fit,
    read_log,
    split,
    survival_ece,
)
from powertrain_dspark.ngram import NgramDrafter


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def synthetic_records(n: int, true_temperatures: tuple[float, ...], seed: int) -> list[Record]:
    """Raw confidences whose true acceptance probability is σ(logit(raw) / T_k)."""
    rng = random.Random(seed)
    records = []
    for _ in range(n):
        depth = rng.randint(1, len(true_temperatures))
        raw = tuple(rng.uniform(0.05, 0.95) for _ in range(depth))
        accepted = 0
        for k, r in enumerate(raw):
            if rng.random() < sigmoid(math.log(r / (1 - r)) / true_temperatures[k]):
                accepted += 1
            else:
                break
        records.append(Record(raw, accepted))
    return records


def test_sequential_temperature_scaling_recovers_the_temperatures() -> None:
    truth = (0.5, 2.0, 1.0)
    records = synthetic_records(6000, truth, seed=1)
    fitted = fit(records)
    assert fitted.temperatures == pytest.approx(truth, rel=0.15)
    assert fitted.biases == pytest.approx((0.0, 0.0, 0.0), abs=0.25)  # no offset in the truth


def test_the_bias_corrects_a_drafter_confident_across_the_board() -> None:
    """True acceptance σ(logit(raw) - 2) at every position: an overconfident drafter. A
    temperature alone cannot lower a confidence of 0.5; the fitted bias recovers the offset
    and the held-out error falls well below what the best temperature alone leaves."""
    rng = random.Random(3)
    records = []
    for _ in range(6000):
        raw = tuple(rng.uniform(0.3, 0.95) for _ in range(rng.randint(1, 3)))
        accepted = 0
        while accepted < len(raw) and rng.random() < sigmoid(math.log(raw[accepted] / (1 - raw[accepted])) - 2.0):
            accepted += 1
        records.append(Record(raw, accepted))
    fitting, held_out = split(records, held_out=0.5, seed=0)
    fitted = fit(fitting)
    # positions 1 and 2 (~3,000 and ~450 fitted records; position 3 sees ~50)
    assert fitted.temperatures[:2] == pytest.approx((1.0, 1.0), rel=0.2)
    assert fitted.biases[:2] == pytest.approx((-2.0, -2.0), abs=0.3)
    temperature_only = Calibration(fitted.temperatures)  # the same temperatures, no bias
    after, without_bias = survival_ece(held_out, fitted), survival_ece(held_out, temperature_only)
    assert after[1] < 0.05 < 0.15 < without_bias[1]


def test_calibration_lowers_held_out_error() -> None:
    records = synthetic_records(6000, (0.4, 0.6, 2.5), seed=2)
    fitting, held_out = split(records, held_out=0.5, seed=0)
    before = survival_ece(held_out, Calibration())
    after = survival_ece(held_out, fit(fitting))
    assert set(before) == {1, 2, 3}
    assert after[1] < before[1] / 3 and after[2] < before[2]
    assert max(after.values()) < 0.04


def test_expected_calibration_error() -> None:
    assert expected_calibration_error([0.9, 0.9], [1.0, 0.0]) == pytest.approx(0.4)
    assert expected_calibration_error([0.25, 0.75], [0.25, 0.75]) == pytest.approx(0.0)


def test_calibration_files_round_trip_and_bad_ones_are_named(tmp_path) -> None:
    path = tmp_path / "calibration.json"
    Calibration((0.5, 2.0)).save(path, {"ece": 0.1})
    loaded = Calibration.load(path)
    assert loaded.temperatures == (0.5, 2.0)
    assert loaded.biases == ()
    Calibration((0.5, 2.0), (0.25, -1.0)).save(path)
    assert Calibration.load(path).at(2, 0.9) == pytest.approx(sigmoid(math.log(9) / 2.0 - 1.0))
    assert loaded.apply([0.5, 0.5, 0.9])[2] == pytest.approx(sigmoid(math.log(9) / 2.0))  # past the fit: last T
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="bad.json: not a DSpark calibration file"):
        Calibration.load(tmp_path / "bad.json")
    (tmp_path / "log.jsonl").write_text('{"raw": [0.5], "accepted": 1}\n\nnot json\n')
    with pytest.raises(ValueError, match="log.jsonl:3"):
        read_log(tmp_path / "log.jsonl")


def slot(seq_id: int, tokens: list[int], max_draft: int = 5) -> DraftSlot:
    return DraftSlot(
        seq_id=seq_id,
        token_ids=tokens,
        num_prompt_tokens=len(tokens),
        params=SamplingParams(temperature=0),
        generator=None,
        max_draft=max_draft,
    )


def test_ngram_drafts_the_continuation_of_the_longest_earlier_match() -> None:
    drafter = NgramDrafter(min_n=1, max_n=3, max_draft_tokens=4)
    tokens = [7, 1, 2, 3, 9, 9, 4, 1, 2, 3]  # "1 2 3" occurred before, followed by 9 9 4 1
    drafted = drafter.propose([slot(0, tokens)])
    (drafts,), (confidences,) = drafted.tokens, drafted.confidences
    assert drafted.draft_probs is None  # n-gram drafts are point masses
    assert drafts == [9, 9, 4, 1]
    assert all(0 < c < 1 for c in confidences)
    (short,) = drafter.propose([slot(0, tokens, max_draft=2)]).tokens
    assert short == [9, 9]
    nothing_drafted = drafter.propose([slot(1, [5, 6, 7])])
    (nothing,), (none,) = nothing_drafted.tokens, nothing_drafted.confidences
    assert nothing == [] and none == []


def test_ngram_confidences_learn_from_outcomes() -> None:
    drafter = NgramDrafter(min_n=1, max_n=3, max_draft_tokens=3)
    tokens = [1, 2, 3, 4, 5, 6, 1, 2, 3]
    (first,) = drafter.propose([slot(0, tokens)]).confidences
    for _ in range(20):  # this kind of draft keeps being accepted in full
        drafter.propose([slot(0, tokens)])
        drafter.record(0, verified=3, accepted=3)
    (later,) = drafter.propose([slot(0, tokens)]).confidences
    assert later[0] > first[0] and later[0] > 0.9


def test_the_calibrate_command_fits_a_log_and_reports_held_out_error(tmp_path) -> None:
    from click.testing import CliRunner

    from powertrain_dspark.cli import main

    log = tmp_path / "log.jsonl"
    log.write_text(
        "".join(f'{{"raw": {list(r.raw)}, "accepted": {r.accepted}}}\n' for r in synthetic_records(3000, (0.5, 2.0), 3))
    )
    out = tmp_path / "calibration.json"
    result = CliRunner().invoke(main, ["calibrate", str(log), "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["temperatures"] == pytest.approx([0.5, 2.0], rel=0.25)
    assert report["held_out_ece_after"]["1"] < report["held_out_ece_before"]["1"]
    assert Calibration.load(out).temperatures == tuple(report["temperatures"])
    bad = CliRunner().invoke(main, ["calibrate", str(tmp_path / "calibration.json"), "--out", str(out)])
    assert bad.exit_code != 0 and "not a DSpark log record" in bad.output

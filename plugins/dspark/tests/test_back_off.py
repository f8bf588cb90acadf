"""Back-off (``back_off.BackOff``): sequences whose drafts the length rule keeps declining stop
drafting for doubling rests and probe in between; a probe that verifies a draft ends it.
Checked on the schedule itself and through ``SpeculativeDecoder`` with a drafter that
counts what it is asked for and whose confidences the test sets."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from powertrain.interfaces import DraftSlot, ExecutedStep, SamplingParams, VerifyBatch
from powertrain_dspark.back_off import BackOff
from powertrain_dspark.drafter import DraftBatch
from powertrain_dspark.lengths import StepsPerSecond
from powertrain_dspark.policy import SpeculativeDecoder


def rest_pattern(back_off: BackOff, verified: Sequence[int], seq_id: int = 7) -> str:
    """One character per step until the last proposal: 'p' the sequence proposed (``verified``
    says how many of its drafts were verified, one entry per proposal), 'r' it rested."""
    out = []
    for outcome in verified:
        while back_off.resting(seq_id):
            out.append("r")
            back_off.end_step()
        back_off.record(seq_id, outcome)
        out.append("p")
        back_off.end_step()
    return "".join(out)


def test_rests_double_after_failed_probes_and_a_verified_draft_ends_them() -> None:
    assert rest_pattern(BackOff(after=2, longest=8), [0] * 6) == "pprrprrrrprrrrrrrrprrrrrrrrp"
    # a probe that verifies ends the back-off: the next failures start over at ``after``
    assert rest_pattern(BackOff(after=2, longest=8), [0, 0, 1, 0, 0, 0]) == "pprrppprrp"
    assert rest_pattern(BackOff(after=1, longest=32), [1, 1, 1]) == "ppp"


class Counting:
    """A drafter that drafts ``depth`` tokens (all 5s) with confidence ``confidence`` and
    counts the proposals asked of it per sequence."""

    max_draft_tokens = 3

    def __init__(self) -> None:
        self.confidence = 0.01
        self.asked: list[list[int]] = []

    def propose(self, slots: Sequence[DraftSlot]) -> DraftBatch:
        self.asked.append([slot.seq_id for slot in slots])
        drafts = [[5] * min(3, slot.max_draft) for slot in slots]
        return DraftBatch(tokens=drafts, confidences=[[self.confidence] * len(d) for d in drafts])

    def record(self, seq_id: int, verified: int, accepted: int) -> None:
        pass


def slot(seq_id: int) -> DraftSlot:
    return DraftSlot(
        seq_id=seq_id,
        token_ids=[1, 2, 3],
        num_prompt_tokens=2,
        params=SamplingParams(temperature=0, max_tokens=100),
        generator=None,
        max_draft=10,
    )


def executed(seq_ids: list[int], lengths: list[int]) -> ExecutedStep:
    """A step whose forward the policy's observe does not read (only who verified what)."""
    empty = torch.empty(0)
    return ExecutedStep(
        input_ids=empty,
        positions=empty,
        hidden=empty,
        metadata=None,  # type: ignore[arg-type]
        seq_ids=seq_ids,
        accepted=[[5] * (n + 1) for n in lengths],
        num_drafts=lengths,
    )


@pytest.mark.parametrize("back_off", [True, False])
def test_a_sequence_whose_drafts_are_declined_is_asked_only_at_probes(back_off: bool) -> None:
    """Under DSpark's rule with a step cost where a draft must survive with probability
    > 2/3 to pay: confidence 0.01 drafts are declined, so with back-off a sequence is asked
    only at its probes; once its drafts turn confident, its next probe is verified and it
    drafts every step again. Without back-off it is asked every step."""
    drafter = Counting()
    sps = StepsPerSecond.from_profile({1: 100.0, 3: 50.0})  # each draft costs half a step
    policy = SpeculativeDecoder(drafter, "dspark", sps=sps, back_off=BackOff() if back_off else None)

    def step() -> list[int]:
        proposal = policy.propose([slot(1), slot(2)], VerifyBatch(base_tokens=2, num_sampling=2))
        policy.observe(executed([1, 2], proposal.lengths))
        return proposal.lengths

    for _ in range(12):
        drafter.confidence = 0.01
        assert step() == [0, 0]
    asked_1 = [1 in seqs for seqs in drafter.asked]
    if back_off:
        assert asked_1 == [True, True, False, False, True, False, False, False, False, True, False, False]
    else:
        assert all(asked_1)
    drafter.confidence = 0.99
    lengths = [step() for _ in range(12)]
    asked_1 = [1 in seqs for seqs in drafter.asked[12:]]
    first = asked_1.index(True)
    assert all(asked_1[first:]), asked_1  # verified at the probe: drafts every step again
    assert all(length[0] > 0 for length in lengths[first:])
    assert first == (6 if back_off else 0)  # the rest that began at step 10 runs 8 steps

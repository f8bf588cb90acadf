"""Lockstep's drafter rounds against a scripted peer (the real two-process run, with an
MTP drafter at (DP, EP) = (2, 2), is dspark's test_mtp.py)."""

from __future__ import annotations

import torch

from powertrain.parallel.lockstep import Lockstep


class ScriptedPeer:
    """The other rank of a 2-rank group: busy in the target's round, then drafting in its
    first ``drafts`` drafter rounds. Records every flag vector this rank sent."""

    world_size = 2

    def __init__(self, drafts: int) -> None:
        self.peer_busy = [1] + [1] * drafts + [0] * 100
        self.sent: list[list[int]] = []

    def all_reduce(self, flags: torch.Tensor) -> torch.Tensor:
        self.sent.append(flags.tolist())
        return flags + torch.tensor([self.peer_busy[len(self.sent) - 1], 0])


class RecordingLayer:
    def __init__(self) -> None:
        self.calls: list[int] = []

    def __call__(self, hidden: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        self.calls.append(hidden.shape[0])
        return hidden


def test_an_idle_rank_serves_every_drafter_forward_of_its_peer() -> None:
    peer, target, draft = ScriptedPeer(drafts=3), RecordingLayer(), RecordingLayer()
    lockstep = Lockstep(peer, [target], 8, torch.float32, "cpu")
    draft_round = lockstep.join_draft_rounds([draft])
    assert draft_round == lockstep.draft_round
    assert lockstep.idle().anyone_busy
    assert target.calls == [0]  # the target's MoE layer, with no tokens
    assert draft.calls == [0, 0, 0]  # once per drafter round the peer drafted in
    assert peer.sent == [[0, 0]] * 5  # the target's round, 3 drafting rounds, the empty one that ends them
    assert (lockstep.rounds, lockstep.draft_rounds, lockstep.busy_draft_rounds) == (1, 4, 0)


def test_a_drafting_rank_opens_a_round_per_forward_then_waits_for_its_peer() -> None:
    peer, draft = ScriptedPeer(drafts=4), RecordingLayer()
    lockstep = Lockstep(peer, [RecordingLayer()], 8, torch.float32, "cpu")
    draft_round = lockstep.join_draft_rounds([draft])
    lockstep.busy()
    draft_round()
    draft_round()  # two forwards of its own (it runs the layers itself: not counted here)
    lockstep.finish_drafts()
    assert draft.calls == [0, 0]  # the peer's 3rd and 4th drafter forwards
    assert peer.sent == [[1, 0], [1, 0], [1, 0], [0, 0], [0, 0], [0, 0]]
    assert (lockstep.busy_rounds, lockstep.draft_rounds, lockstep.busy_draft_rounds) == (1, 5, 2)


def test_without_a_drafter_no_drafter_round_is_opened() -> None:
    peer = ScriptedPeer(drafts=2)
    lockstep = Lockstep(peer, [RecordingLayer()], 8, torch.float32, "cpu")
    lockstep.idle()
    lockstep.finish_drafts()
    assert peer.sent == [[0, 0]] and lockstep.draft_rounds == 0

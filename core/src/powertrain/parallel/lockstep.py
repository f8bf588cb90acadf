"""Keeps expert-parallel ranks' collectives in the same order, whoever has work.

Every MoE layer is a collective (dispatch and combine), so every rank must run every
MoE layer of every step some rank runs. The ranks therefore advance in *rounds*, on
each engine's device thread (where its forwards run, in order): a round opens with one
all_reduce of ``[busy, stopping]`` flags. A rank with a batch then runs its forward; a
rank without one runs the MoE layers with no tokens (it still receives, computes and
returns its experts' share of the others' tokens) when any peer is busy, and nothing
when no one is. Rounds pair up one to one across ranks because every rank opens
exactly one per forward or idle turn, and every rank learns the same flags.

Shutdown is a round too: ranks leave together at the first round in which all of them
are stopping, so none is left waiting in a collective for a peer that has gone.

Drafter rounds. A speculative policy may run MoE layers of its own after the target's
forward (an MTP drafter: a catch-up forward and one per draft depth), as many as its
sequences need, which differs between ranks. Every round in which some rank was busy
is therefore followed by drafter rounds: a rank opens one with ``draft_round`` before
each of its drafter forwards, and ``finish_drafts`` then opens empty ones, replaying the
drafter's MoE layers with no tokens while any peer still drafts, until a round finds
nobody drafting; every rank learns the same flags, so all leave on the same round.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch

from powertrain.interfaces import Communicator


@attrs.frozen
class Round:
    busy_ranks: int
    stopping_ranks: int
    world_size: int

    @property
    def anyone_busy(self) -> bool:
        return self.busy_ranks > 0

    @property
    def everyone_stopping(self) -> bool:
        return self.stopping_ranks == self.world_size


class Lockstep:
    def __init__(
        self, communicator: Communicator, moe_layers: Sequence[Any], hidden_size: int, dtype: torch.dtype, device: Any
    ) -> None:
        self.communicator = communicator
        self.moe_layers = list(moe_layers)
        #: The MoE layers a speculative policy's own forward runs, in order (none: no drafter rounds).
        self.draft_layers: list[Any] = []
        self._empty = torch.empty(0, hidden_size, dtype=dtype, device=device)
        self._no_token_ids = torch.empty(0, dtype=torch.long, device=device)  # what hash-routed layers read
        #: Rounds this rank opened, busy or not (diagnostics and tests).
        self.rounds = 0
        self.busy_rounds = 0
        #: Drafter rounds this rank opened, and those it drafted in.
        self.draft_rounds = 0
        self.busy_draft_rounds = 0

    def _open(self, busy: bool, stopping: bool) -> Round:
        flags = torch.tensor([int(busy), int(stopping)], dtype=torch.int64)
        total = self.communicator.all_reduce(flags).tolist()
        return Round(busy_ranks=int(total[0]), stopping_ranks=int(total[1]), world_size=self.communicator.world_size)

    def join_draft_rounds(self, layers: Any) -> Any:
        """For a speculative policy that runs MoE ``layers`` outside the target's forward:
        returns ``draft_round``, which it calls before each such forward."""
        self.draft_layers = list(layers)
        return self.draft_round

    def draft_round(self) -> None:
        """Open a drafter round for this rank's drafter forward, which the caller runs next."""
        self._open(True, False)
        self.draft_rounds += 1
        self.busy_draft_rounds += 1

    @torch.inference_mode()
    def finish_drafts(self) -> None:
        """After a round in which some rank was busy: empty drafter rounds, serving the
        peers' drafter forwards, until nobody drafts (nothing without a drafter)."""
        while self.draft_layers:
            result = self._open(False, False)
            self.draft_rounds += 1
            if not result.anyone_busy:
                return
            for layer in self.draft_layers:
                layer(self._empty, self._no_token_ids)

    def busy(self) -> Round:
        """Open a round for this rank's forward, which the caller runs next (and then its
        drafter forwards and ``finish_drafts``)."""
        self.rounds += 1
        self.busy_rounds += 1
        return self._open(True, False)

    @torch.inference_mode()
    def idle(self, stopping: bool = False) -> Round:
        """Open a round with nothing to compute; serve the peers' tokens if any are busy,
        and then their drafter forwards."""
        result = self._open(False, stopping)
        self.rounds += 1
        if result.anyone_busy:
            for layer in self.moe_layers:
                layer(self._empty, self._no_token_ids)
            self.finish_drafts()
        return result

"""Back-off: a sequence whose drafts the length rule keeps declining stops drafting for a
while, then probes again.

Why: a block drafter's proposal costs a forward of its layers whether or not the rule then
verifies anything (on a 2-core CPU, ~9 ms a step at c = 1 against a 10 ms target step),
and at high concurrency on a CPU, or with a drafter that is weak on the text at hand, the
rule verifies nothing for long stretches. Drafting less never changes an output (only
verification decides what is kept), so resting is lossless; it only gives up the drafts a
resting sequence would have had verified, which the probes bound: after ``after``
proposals in a row with nothing verified the sequence rests 2 steps, and each probe that
again verifies nothing doubles the rest, up to ``longest`` steps; a probe that verifies a
draft ends the back-off.
"""

from __future__ import annotations

import attrs

#: A sequence not seen in this many steps is forgotten (finished or aborted).
FORGET_AFTER_STEPS = 1024


@attrs.define
class _State:
    seen: int  # the last step it was proposed for or rested in
    quiet: int = 0  # proposals in a row that verified nothing
    span: int = 0  # the current rest's length (0: not backing off)
    left: int = 0  # steps of it still to rest


@attrs.define
class BackOff:
    #: Proposals in a row with nothing verified before the first rest.
    after: int = 2
    #: The longest rest, in steps.
    longest: int = 32
    _states: dict[int, _State] = attrs.field(factory=dict, init=False)
    _step: int = attrs.field(default=0, init=False)

    def resting(self, seq_id: int) -> bool:
        """Whether ``seq_id`` sits this step out (called once per step for each sequence
        that could draft)."""
        state = self._states.get(seq_id)
        if state is None:
            return False
        state.seen = self._step
        if state.left:
            state.left -= 1
            return True
        return False

    def record(self, seq_id: int, verified: int) -> None:
        """How many of the drafts proposed for ``seq_id`` this step were verified."""
        state = self._states.setdefault(seq_id, _State(self._step))
        state.seen = self._step
        if verified:
            state.quiet = state.span = 0
            return
        state.quiet += 1
        if state.span or state.quiet >= self.after:  # a failed probe, or the first rest
            state.span = min(self.longest, 2 * state.span if state.span else 2)
            state.left, state.quiet = state.span, 0

    def end_step(self) -> None:
        self._step += 1
        if self._step % FORGET_AFTER_STEPS == 0:
            stale = [s for s, state in self._states.items() if state.seen < self._step - FORGET_AFTER_STEPS]
            for seq_id in stale:
                del self._states[seq_id]

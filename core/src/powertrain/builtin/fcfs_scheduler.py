"""First-come-first-served continuous batching with chunked prefill.

Each step: running sequences first (in admission order), each taking its next
tokens (one for a decode, the next chunk of a long prompt); then waiting sequences
in arrival order, each starting from its longest prefix-cache hit, while the token
budget and the sequence limit allow. When the cache cannot hold a running
sequence's next tokens, the most recently admitted sequences are preempted
(blocks freed, recomputed later), never the oldest: the oldest always progresses,
so the engine cannot livelock, and nothing ever runs out of memory mid-step.

A sequence whose step in flight samples its last token (``finishing``) is neither
scheduled (its next token would be thrown away) nor preempted: its blocks come free
when that step is collected, and preempting it would lose the cache that step wrote
(a prefill rank's hand-off). Where only such sequences could make room, the one
short of blocks waits a step instead of being preempted.
"""

from __future__ import annotations

from collections import deque
from typing import Generic

from powertrain.interfaces.scheduling import BlockAllocator, ScheduledBatch, SchedulerContext, Seq, SequenceStatus


class FcfsScheduler(Generic[Seq]):
    """Sees the engine's sequences and block manager only through the contract
    (``interfaces.scheduling``), as an external scheduler would."""

    def __init__(self, context: SchedulerContext[Seq]) -> None:
        self.limits = context.limits
        self.blocks: BlockAllocator[Seq] = context.block_manager
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.num_preemptions = 0

    def add(self, sequence: Seq) -> None:
        sequence.status = SequenceStatus.WAITING
        self.waiting.append(sequence)

    def finish(self, sequence: Seq) -> None:
        if sequence in self.running:
            self.running.remove(sequence)
        elif sequence in self.waiting:
            self.waiting.remove(sequence)
        self.blocks.free_sequence(sequence)
        sequence.status = SequenceStatus.FINISHED

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch[Seq]:
        budget = self.limits.max_num_batched_tokens
        chosen: list[tuple[Seq, int]] = []
        preempted: list[Seq] = []

        index = 0
        short = False  # a running sequence waits for blocks the step in flight frees
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            remaining = seq.num_tokens - seq.num_computed_tokens
            if remaining <= 0 or seq.finishing:  # nothing new to compute (yet, or ever)
                index += 1
                continue
            count = min(remaining, budget)
            target = seq.num_computed_tokens + count
            while not self.blocks.can_append(seq, target) and (victim := self._victim_after(seq)) is not None:
                preempted.append(self._preempt(victim))
            if not self.blocks.can_append(seq, target):
                short = any(other.finishing for other in self.running)
                if not short:
                    preempted.append(self._preempt(seq))
                break
            self.blocks.append(seq, target)
            chosen.append((seq, count))
            budget -= count
            index += 1

        # Admit new work only when memory is not tight (nothing was just preempted).
        while not (preempted or short) and self.waiting and budget > 0 and len(self.running) < self.limits.max_num_seqs:
            seq = self.waiting[0]
            matched = self.blocks.match_prefix(seq)
            cached = matched.num_tokens
            remaining = seq.num_tokens - cached
            count = min(remaining, budget)
            if count < remaining and not self.limits.chunked_prefill:
                break
            if not self.blocks.can_allocate(seq, cached + count, matched):
                break
            self.waiting.popleft()
            self.blocks.allocate(seq, cached + count, matched)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            chosen.append((seq, count))
            budget -= count

        chosen.sort(key=lambda item: item[1] != 1)  # one-token sequences first (stable)
        for seq, count in chosen:
            seq.num_computed_tokens += count
        return ScheduledBatch(
            seqs=[seq for seq, _ in chosen],
            num_new_tokens=[count for _, count in chosen],
            samples=[seq.num_computed_tokens == seq.num_tokens for seq, _ in chosen],
            preempted=preempted,
        )

    def _victim_after(self, seq: Seq) -> Seq | None:
        """The most recently admitted running sequence after ``seq`` that is not finishing."""
        for candidate in reversed(self.running):
            if candidate is seq:
                return None
            if not candidate.finishing:
                return candidate
        return None

    def _preempt(self, seq: Seq) -> Seq:
        """Free ``seq``'s blocks and queue it first, to be recomputed (its full blocks
        usually come straight back from the prefix cache)."""
        self.running.remove(seq)
        self.blocks.free_sequence(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        return seq

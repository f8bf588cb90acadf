"""Prompt-lookup drafting: continue the sequence the way it continued before.

The longest suffix of the sequence (``max_n`` down to ``min_n`` tokens) that occurred
earlier is looked up in an index of the sequence's n-grams; the tokens that followed
its most recent earlier occurrence are the drafts. Works with any model, costs no
forward pass, and is deterministic (each draft is a point mass for verification).

Confidence comes from match statistics. Each draft falls in a bucket: its position,
the match length, whether every earlier occurrence of the matched context continued
the same way, and how this sequence's previous verification went. The raw
confidence is the bucket's acceptance rate so far over the outcomes of earlier
verifications (was position k accepted, given 1..k-1 were), shrunk toward the rate of
all drafts at position k while the bucket has few outcomes (``PRIOR_WEIGHT``);
``calibration.Calibration`` then scales it per position. All of it is computed from
finished steps, so it never looks at what it is about to verify.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from powertrain.interfaces import DraftSlot
from powertrain_dspark.drafter import DraftBatch

_FRESH, _ACCEPTED_ALL, _REJECTED = 0, 1, 2
#: How many outcomes a bucket needs before its own rate outweighs its position's.
PRIOR_WEIGHT = 5.0


class _Index:
    """n-gram -> positions right after each of its occurrences, for one sequence."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.length = 0
        self.table: dict[tuple[int, ...], list[int]] = defaultdict(list)

    def update(self, tokens: Sequence[int]) -> None:
        if len(tokens) < self.length:  # rewritten history (never expected): start over
            self.length = 0
            self.table.clear()
        for end in range(max(self.length, 1), len(tokens) + 1):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self.table[tuple(tokens[end - n : end])].append(end)
        self.length = len(tokens)


class NgramDrafter:
    def __init__(self, min_n: int = 1, max_n: int = 4, max_draft_tokens: int = 5) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram drafter: need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n, self.max_draft_tokens = min_n, max_n, max_draft_tokens
        self._indexes: dict[int, _Index] = {}
        self._last_outcome: dict[int, int] = {}
        #: bucket -> [accepted, verified], and the same per position
        self._stats: dict[tuple[int, int, bool, int], list[int]] = defaultdict(lambda: [0, 0])
        self._position_stats: dict[int, list[int]] = defaultdict(lambda: [0, 0])
        self._pending: dict[int, list[tuple[int, int, bool, int]]] = {}

    def propose(self, slots: Sequence[DraftSlot]) -> DraftBatch:
        """Drafts and raw confidences per slot (point masses: no draft distributions)."""
        alive = {slot.seq_id for slot in slots}
        for seq_id in [s for s in self._indexes if s not in alive]:  # finished sequences
            self._forget(seq_id)
        drafts, confidences = [], []
        for slot in slots:
            tokens, buckets = self._draft(slot)
            self._pending[slot.seq_id] = buckets
            drafts.append(tokens)
            confidences.append([self._rate(b) for b in buckets])
        return DraftBatch(tokens=drafts, confidences=confidences)

    def record(self, seq_id: int, verified: int, accepted: int) -> None:
        """The outcome of verifying ``verified`` drafts of a sequence, ``accepted`` of them kept."""
        buckets = self._pending.pop(seq_id, [])
        for k in range(min(verified, accepted + 1, len(buckets))):
            for stat in (self._stats[buckets[k]], self._position_stats[k]):
                stat[0] += k < accepted
                stat[1] += 1
        if verified:
            self._last_outcome[seq_id] = _ACCEPTED_ALL if accepted == verified else _REJECTED

    def _forget(self, seq_id: int) -> None:
        self._indexes.pop(seq_id, None)
        self._last_outcome.pop(seq_id, None)
        self._pending.pop(seq_id, None)

    def _rate(self, bucket: tuple[int, int, bool, int]) -> float:
        accepted, verified = self._position_stats.get(bucket[0], (0, 0))
        position_rate = (accepted + 1) / (verified + 2)
        accepted, verified = self._stats.get(bucket, (0, 0))
        return (accepted + PRIOR_WEIGHT * position_rate) / (verified + PRIOR_WEIGHT)

    def _draft(self, slot: DraftSlot) -> tuple[list[int], list[tuple[int, int, bool, int]]]:
        index = self._indexes.get(slot.seq_id)
        if index is None:
            index = self._indexes[slot.seq_id] = _Index(self.min_n, self.max_n)
        tokens = slot.token_ids
        index.update(tokens)
        limit = min(self.max_draft_tokens, slot.max_draft)
        end = len(tokens)
        for n in range(min(self.max_n, end - 1), self.min_n - 1, -1):
            earlier = [p for p in index.table.get(tuple(tokens[end - n : end]), ()) if p < end]
            if not earlier:
                continue
            start = earlier[-1]
            drafts = list(tokens[start : min(start + limit, end)])
            if not drafts:
                continue
            last = self._last_outcome.get(slot.seq_id, _FRESH)
            buckets = []
            for k, token in enumerate(drafts):
                # did every earlier occurrence of this context continue with this token?
                unanimous = all(p + k < end and tokens[p + k] == token for p in earlier[-8:])
                buckets.append((k, n, unanimous, last))
            return drafts, buckets
        return [], []

"""The scheduler contract: what a scheduler is given, what it sees of the engine's
sequences and block manager, and the batch it returns (the scheduler itself is a plugin).

The engine owns its sequences and its block manager; a scheduler sees each through a
small Protocol of exactly what batch forming needs (``SchedulerSequence``,
``BlockAllocator``). Both are generic over the engine's sequence type ``Seq``: a
scheduler hands back (in ``ScheduledBatch``) the very objects it was given, and passes
them to the block manager unchanged.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

import attrs


class SequenceStatus(enum.Enum):
    """Where a sequence is; the scheduler moves it between these."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class SchedulerSequence(Protocol):
    """What a scheduler reads and writes of one sequence.

    ``num_computed_tokens`` counts tokens whose keys/values are (or, for the step in
    flight, will be) in the cache: the scheduler advances it by each step's new tokens.
    """

    status: SequenceStatus
    num_computed_tokens: int

    @property
    def num_tokens(self) -> int:
        """Prompt and generated tokens so far (including drafts being verified)."""
        ...

    @property
    def finishing(self) -> bool:
        """The step in flight samples this sequence's last token (its length limit): it
        needs nothing more, and its blocks come free when that step is collected. Its
        cache is worth keeping until then (a prefill rank publishes it)."""
        ...


#: The engine's sequence type, as a scheduler passes it through.
Seq = TypeVar("Seq", bound=SchedulerSequence)
Seq_contra = TypeVar("Seq_contra", bound=SchedulerSequence, contravariant=True)


@attrs.frozen(kw_only=True)
class PrefixMatch:
    """The longest prefix of a sequence the cache can serve: its first ``num_tokens``
    tokens (whole blocks), and for each retention class (a sliding window, or None for
    the full history) the cached block ids holding them, None where a sliding class needs
    no block (it fell out of the window) or where a tier below the device holds it
    (``loads``). The block manager reads ``blocks`` and ``loads``; a scheduler needs only
    ``num_tokens``."""

    num_tokens: int = 0
    blocks: Mapping[int | None, tuple[int | None, ...]] = attrs.field(factory=dict)
    #: (retention class, block index) -> (block hash, payload fetched from a tier), to
    #: load into a fresh block.
    loads: Mapping[tuple[int | None, int], tuple[bytes, Any]] = attrs.field(factory=dict)
    #: Tokens of the hit each tier serves (by tier name).
    tier_tokens: Mapping[str, int] = attrs.field(factory=dict)


class BlockAllocator(Protocol[Seq_contra]):
    """What a scheduler uses of the engine's block manager: cache blocks for sequences,
    with prefix-cache hits. ``matched`` is what ``match_prefix`` returned.

    Blocks come in retention classes (``interfaces.attention.CacheGroupSpec``); every
    call covers all of a sequence's classes at once, so a scheduler never sees them.
    """

    @property
    def block_size(self) -> int: ...

    def match_prefix(self, seq: Seq_contra) -> PrefixMatch:
        """The longest cached prefix of ``seq`` every class can reproduce, without taking it."""
        ...

    def can_allocate(self, seq: Seq_contra, num_tokens: int, matched: PrefixMatch) -> bool:
        """Could ``seq`` (with its ``matched`` prefix) get slots for ``num_tokens``?"""
        ...

    def allocate(self, seq: Seq_contra, num_tokens: int, matched: PrefixMatch) -> None:
        """Give a sequence with no blocks its prefix hits plus fresh blocks for
        ``num_tokens``; sets its ``num_computed_tokens`` to the tokens the hits hold."""
        ...

    def can_append(self, seq: Seq_contra, num_tokens: int) -> bool: ...

    def append(self, seq: Seq_contra, num_tokens: int) -> None:
        """Grow ``seq``'s blocks to hold its first ``num_tokens`` tokens. Called before the
        step's tokens are counted in ``num_computed_tokens``: sliding-window classes first
        release the blocks no query from ``num_computed_tokens`` on can see."""
        ...

    def free_sequence(self, seq: Seq_contra) -> None:
        """Release ``seq``'s blocks (full computed ones stay in the prefix cache)."""
        ...


@attrs.frozen(kw_only=True)
class SchedulerLimits:
    #: Sequences running at once.
    max_num_seqs: int = 64
    #: Tokens computed per step (decodes count one each; prefills are chunked to fit).
    max_num_batched_tokens: int = 2048
    #: Split long prompts across steps; without it a prompt must fit a step whole.
    chunked_prefill: bool = True


@attrs.frozen(kw_only=True)
class SchedulerContext(Generic[Seq]):
    """What a scheduler factory is given."""

    limits: SchedulerLimits
    block_manager: BlockAllocator[Seq]


@attrs.frozen(kw_only=True)
class ScheduledBatch(Generic[Seq]):
    """One step: which sequences run and how many new tokens each computes.

    Sequences with one new token come first (the attention metadata contract).
    ``samples[i]`` says whether sequence ``i`` reaches the end of its known tokens this
    step and so samples its next token (a prompt chunk short of the end does not).
    """

    seqs: list[Seq]
    num_new_tokens: list[int]
    samples: list[bool]
    preempted: list[Seq] = attrs.field(factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __bool__(self) -> bool:
        return bool(self.seqs)


@runtime_checkable
class Scheduler(Protocol[Seq]):
    """Forms each step's batch from waiting and running sequences.

    Built by its record's factory from a ``SchedulerContext`` (the limits and the block
    manager). The engine owns the sequences; the scheduler decides which run, how many
    tokens each computes, and whom to preempt when the cache runs out (their blocks are
    freed and they are recomputed later).
    """

    def add(self, sequence: Seq) -> None:
        """Queue a new (or preempted) sequence."""
        ...

    def schedule(self) -> ScheduledBatch[Seq]:
        """The next step's batch (empty when idle)."""
        ...

    def finish(self, sequence: Seq) -> None:
        """Remove a finished or aborted sequence and free its blocks."""
        ...

    def has_unfinished(self) -> bool: ...

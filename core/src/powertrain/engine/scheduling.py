"""What a scheduler is given and what it returns (the scheduler itself is a plugin)."""

from __future__ import annotations

import attrs

from powertrain.engine.block_manager import BlockManager
from powertrain.engine.sequence import Sequence


@attrs.frozen(kw_only=True)
class SchedulerLimits:
    #: Sequences running at once.
    max_num_seqs: int = 64
    #: Tokens computed per step (decodes count one each; prefills are chunked to fit).
    max_num_batched_tokens: int = 2048
    #: Split long prompts across steps; without it a prompt must fit a step whole.
    chunked_prefill: bool = True


@attrs.frozen(kw_only=True)
class SchedulerContext:
    """What a scheduler factory is given."""

    limits: SchedulerLimits
    block_manager: BlockManager


@attrs.frozen(kw_only=True)
class ScheduledBatch:
    """One step: which sequences run and how many new tokens each computes.

    Sequences with one new token come first (the attention metadata contract).
    ``samples[i]`` says whether sequence ``i`` reaches the end of its known tokens this
    step and so samples its next token (a prompt chunk short of the end does not).
    """

    seqs: list[Sequence]
    num_new_tokens: list[int]
    samples: list[bool]
    preempted: list[Sequence] = attrs.field(factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __bool__(self) -> bool:
        return bool(self.seqs)

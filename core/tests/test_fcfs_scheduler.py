"""The fcfs scheduler through its plugin record: budgets, chunking, prefix hits, preemption."""

from __future__ import annotations

import random

import pytest

from powertrain.engine.block_manager import BlockManager
from powertrain.engine.sequence import PLACEHOLDER, Request, Sequence
from powertrain.interfaces import Scheduler
from powertrain.interfaces.sampling import SamplingParams
from powertrain.interfaces.scheduling import SchedulerContext, SchedulerLimits
from powertrain.testing.base import find_component


@pytest.fixture
def make(powertrain_plugins):
    record = find_component(powertrain_plugins, "scheduler", "fcfs").record

    def build(num_blocks=64, block_size=4, **limits) -> tuple[Scheduler, BlockManager]:
        blocks = BlockManager(num_blocks, block_size)
        scheduler = record.factory(SchedulerContext(limits=SchedulerLimits(**limits), block_manager=blocks))
        assert isinstance(scheduler, Scheduler)
        return scheduler, blocks

    return build


def seq_of(length: int, seed: int | None = None) -> Sequence:
    rng = random.Random(seed)
    return Request(f"r{rng.random()}", None, [rng.randrange(500) for _ in range(length)], SamplingParams()).sequences[0]


def finish_step(batch, blocks: BlockManager) -> None:
    """What the engine does after a step: sampled sequences gain a token; blocks are published."""
    for seq, samples in zip(batch.seqs, batch.samples, strict=True):
        if samples:
            seq.token_ids.append(random.randrange(500))
        blocks.register_computed(seq)


def test_prefill_is_chunked_to_the_token_budget(make) -> None:
    scheduler, blocks = make(max_num_batched_tokens=8)
    long, short = seq_of(19), seq_of(3)
    scheduler.add(long)
    scheduler.add(short)
    batch = scheduler.schedule()
    assert batch.seqs == [long] and batch.num_new_tokens == [8] and batch.samples == [False]
    finish_step(batch, blocks)
    batch = scheduler.schedule()
    assert batch.num_new_tokens == [8] and batch.samples == [False]
    finish_step(batch, blocks)
    batch = scheduler.schedule()  # the last 3 prompt tokens, then the short prompt fits too
    assert batch.seqs == [long, short] and batch.num_new_tokens == [3, 3] and batch.samples == [True, True]
    finish_step(batch, blocks)
    batch = scheduler.schedule()
    assert batch.num_new_tokens == [1, 1]  # both decode


def test_decodes_come_first(make) -> None:
    scheduler, blocks = make(max_num_batched_tokens=64)
    a = seq_of(5)
    scheduler.add(a)
    finish_step(scheduler.schedule(), blocks)
    b = seq_of(7)
    scheduler.add(b)
    batch = scheduler.schedule()
    assert batch.seqs == [a, b] and batch.num_new_tokens == [1, 7]


def test_without_chunking_a_prompt_waits_for_a_budget_it_fits(make) -> None:
    scheduler, _ = make(max_num_batched_tokens=8, chunked_prefill=False)
    scheduler.add(seq_of(5))
    scheduler.add(seq_of(5))
    assert scheduler.schedule().num_new_tokens == [5]


def test_max_num_seqs(make) -> None:
    scheduler, _ = make(max_num_seqs=2)
    for _ in range(3):
        scheduler.add(seq_of(3))
    assert len(scheduler.schedule().seqs) == 2


def test_prefix_hits_skip_their_tokens(make) -> None:
    scheduler, blocks = make(block_size=4)
    first = seq_of(13, seed=7)
    scheduler.add(first)
    finish_step(scheduler.schedule(), blocks)
    again = Request("again", None, first.token_ids[:13] + [1, 2], SamplingParams()).sequences[0]
    scheduler.add(again)
    batch = scheduler.schedule()
    assert batch.seqs[-1] is again
    assert batch.num_new_tokens[-1] == 15 - 12 and again.num_cached_tokens == 12


def test_out_of_blocks_preempts_the_newest_and_the_oldest_progresses(make) -> None:
    scheduler, blocks = make(num_blocks=6, block_size=4, max_num_batched_tokens=64)
    old, new = seq_of(8), seq_of(8)  # two blocks each, two blocks left
    scheduler.add(old)
    scheduler.add(new)
    batch = scheduler.schedule()
    assert batch.seqs == [old, new]
    for _ in range(8):  # decode until both need more blocks than exist
        finish_step(batch, blocks)
        batch = scheduler.schedule()
        if batch.preempted:
            break
    assert batch.preempted == [new] and old in batch.seqs and new not in batch.seqs
    assert new.block_table == [] and new.num_computed_tokens == 0 and scheduler.waiting[0] is new
    # The oldest keeps going alone until it finishes; then the preempted one resumes.
    finish_step(batch, blocks)
    scheduler.finish(old)
    batch = scheduler.schedule()
    assert batch.seqs == [new] and batch.num_new_tokens == [new.num_tokens - new.num_cached_tokens]


def test_a_sequence_finishing_in_flight_is_neither_scheduled_nor_preempted(make) -> None:
    """Async scheduling: while step N samples a sequence's last token (its placeholder is
    the one ``max_tokens`` allows), step N+1 gives it nothing (the token would be thrown
    away) and does not take its blocks: preempting it would lose what step N writes to its
    cache (a prefill rank publishes that). The sequence short of blocks waits a step instead
    of being preempted, and admits nobody meanwhile."""
    scheduler, blocks = make(num_blocks=5, block_size=4, max_num_batched_tokens=64)
    rng = random.Random(0)
    old = seq_of(8, seed=1)  # two blocks, then a third at its ninth token
    last = Request("last", None, [rng.randrange(500) for _ in range(9)], SamplingParams(max_tokens=1)).sequences[0]
    for seq in (old, last):
        scheduler.add(seq)
    batch = scheduler.schedule()  # both prefill: old 2 blocks, last 3 (the cache is full)
    assert batch.seqs == [old, last] and batch.samples == [True, True] and blocks.num_free_blocks == 0
    for seq in batch.seqs:  # what the engine's launch does for the step in flight
        seq.token_ids.append(PLACEHOLDER)
    assert last.finishing and not old.finishing
    waiting = seq_of(4, seed=2)
    scheduler.add(waiting)
    # Step N+1, before step N is collected: old's placeholder needs a third block, which
    # only the finishing sequence holds. Nobody is preempted; old waits.
    batch = scheduler.schedule()
    assert not batch and batch.preempted == [] and last.block_tables and old.block_tables
    assert list(scheduler.waiting) == [waiting]
    # Step N collected: last finishes (its blocks come free, its prefix cached); old goes on.
    old.token_ids[-1] = rng.randrange(500)
    last.token_ids[-1] = rng.randrange(500)
    for seq in (old, last):
        blocks.register_computed(seq)
    scheduler.finish(last)
    assert blocks.match_prefix(seq_of_tokens(last.token_ids[:9])).num_tokens == 8  # its full blocks were cached
    batch = scheduler.schedule()
    assert old in batch.seqs and batch.preempted == []


def seq_of_tokens(tokens: list[int]) -> Sequence:
    return Request(f"r{random.random()}", None, list(tokens), SamplingParams()).sequences[0]


def test_finish_frees_blocks(make) -> None:
    scheduler, blocks = make(num_blocks=8)
    seq = seq_of(9)
    scheduler.add(seq)
    scheduler.schedule()
    assert blocks.num_free_blocks == 5
    scheduler.finish(seq)
    assert blocks.num_free_blocks == 8 and not scheduler.has_unfinished()

"""Requests and the sequences they expand into (what the engine reports back is
``interfaces.outputs``)."""

from __future__ import annotations

import itertools
import time
from typing import TYPE_CHECKING

import attrs
import torch

from powertrain.interfaces.sampling import SamplingParams
from powertrain.interfaces.scheduling import SequenceStatus

if TYPE_CHECKING:
    from powertrain.engine.images import PromptImage
    from powertrain.engine.structured import GrammarState

#: A token sampled by a step that is still running (async scheduling): its id is
#: filled in when the step's result arrives; the step after it reads it on the device.
PLACEHOLDER = -1

_seq_ids = itertools.count()


class Sequence:
    """One stream of tokens: a prompt and what has been generated after it.

    ``num_computed_tokens`` counts tokens whose keys/values are (or, for the step in
    flight, will be) in the cache; ``block_tables`` lists, per retention class (None:
    full history, else a sliding window), the cache blocks holding them.
    """

    def __init__(self, request: Request, index: int) -> None:
        self.seq_id = next(_seq_ids)
        self.request = request
        self.index = index
        self.token_ids: list[int] = list(request.prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache at first schedule
        self.block_tables: dict[int | None, list[int]] = {}
        #: Chained prefix-cache hashes of the sequence's full, computed blocks.
        self.block_hashes: list[bytes] = []
        #: Leading blocks already published to the prefix cache since the last allocation.
        self.num_registered_blocks = 0
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.logprobs: list[dict[int, float]] = []
        params = request.params
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            # One generator per sequence, advanced once per sampled token: the same
            # request draws the same numbers whatever else is batched with it.
            self.generator = torch.Generator().manual_seed(params.seed + index)
        #: The matcher of a constrained sequence (structured output), dropped when it finishes.
        self.grammar: GrammarState | None = None

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def images(self) -> tuple[PromptImage, ...]:
        """The request's images, placed in its prompt (``engine.images``); empty for text."""
        return self.request.images

    @property
    def block_table(self) -> list[int]:
        """The blocks of the first retention class (the full history when there is one)."""
        return next(iter(self.block_tables.values()), [])

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def finishing(self) -> bool:
        """``SchedulerSequence.finishing``: the step in flight fills the last placeholder
        this sequence's ``max_tokens`` allows."""
        return self.token_ids[-1:] == [PLACEHOLDER] and self.num_output_tokens >= self.params.max_tokens

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return self.request.stop_token_ids

    def __repr__(self) -> str:
        return (
            f"Sequence({self.seq_id}, request={self.request.request_id!r}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, {self.status.value})"
        )


def ends_at(
    params: SamplingParams, stop_token_ids: tuple[int, ...], token: int, produced: int, length: int, max_model_len: int
) -> str | None:
    """Why a sequence ends with ``token``, its ``produced``-th output token and ``length``-th
    token, whatever its text: "stop" for a stop token (once ``min_tokens`` are out),
    "length" at ``max_tokens`` or the model's length; None where only a stop string could."""
    if produced >= params.min_tokens and token in stop_token_ids:
        return "stop"
    if produced >= params.max_tokens or length >= max_model_len:
        return "length"
    return None


@attrs.define(kw_only=True)
class SequenceSnapshot:
    """A sequence as the engine thread saw it when it launched a speculative step: the
    device thread completes that step from it (the previous step's tokens, the drafts)
    while the engine thread goes on changing the sequence itself. Read like a Sequence
    by ``ModelRunner.prepare``."""

    seq_id: int
    token_ids: list[int]
    num_computed_tokens: int
    num_prompt_tokens: int
    params: SamplingParams
    generator: torch.Generator | None
    stop_token_ids: tuple[int, ...]
    grammar: GrammarState | None
    block_tables: dict[int | None, list[int]]
    #: Tokens its cache blocks can hold: its drafts must end below.
    capacity: int
    images: tuple[PromptImage, ...] = ()

    @classmethod
    def of(cls, seq: Sequence, capacity: int) -> SequenceSnapshot:
        return cls(
            seq_id=seq.seq_id,
            token_ids=list(seq.token_ids),
            num_computed_tokens=seq.num_computed_tokens,
            num_prompt_tokens=seq.num_prompt_tokens,
            params=seq.params,
            generator=seq.generator,
            stop_token_ids=seq.stop_token_ids,
            grammar=seq.grammar,
            block_tables={w: list(table) for w, table in seq.block_tables.items()},
            capacity=capacity,
            images=seq.images,
        )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens


class Request:
    """A prompt and its sampling settings; ``n`` sequences sample from it."""

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        stop_token_ids: tuple[int, ...] = (),
        images: tuple[PromptImage, ...] = (),
        given_token_ids: list[int] | None = None,
    ) -> None:
        self.request_id = request_id
        #: Tokens that end a sequence: the model's EOS ids (unless ignore_eos) and the
        #: request's own stop ids. None of them may be sampled before min_tokens.
        self.stop_token_ids = stop_token_ids
        self.prompt = prompt
        #: What the sequences compute: with images, every placeholder widened to its span.
        self.prompt_token_ids = prompt_token_ids
        #: The prompt as it came (one placeholder per image): what outputs report.
        self.given_token_ids = prompt_token_ids if given_token_ids is None else given_token_ids
        #: The images placed in the prompt (``engine.images``), in order.
        self.images = images
        self.params = params
        self.arrival_time = time.monotonic()
        self.first_token_time: float | None = None
        self.sequences = [Sequence(self, i) for i in range(params.n)]

    @property
    def finished(self) -> bool:
        return all(seq.finished for seq in self.sequences)

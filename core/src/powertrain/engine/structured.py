"""Structured output: a request's tokens constrained to a JSON schema, a regex or a Lark grammar.

llguidance compiles each request's constraint once, when the request is added (a constraint
that does not compile is an InvalidRequestError saying why), and every sequence gets its own
matcher. A matcher eats the sequence's sampled tokens one by one and answers which tokens may
come next, as a bitmask over the vocabulary; the sampler sets the logits of the others to -inf.

Where that work runs follows the engine's one-step lag (DESIGN §3, async scheduling): step N
samples on the device thread, which then hands N's tokens to the grammar worker thread and goes
on to step N+1's forward; the worker feeds each matcher its token and computes its next mask
meanwhile (llguidance releases the GIL), and only N+1's sampler waits for those masks. A
constrained row thus costs a step nothing unless its mask takes longer than the forward, and a
batch without constrained rows touches none of this.

A constrained sequence may speculate. Before a step's forward the device thread asks
``allowed_drafts`` how many of its drafts the grammar accepts, so a draft the grammar forbids is
not verified; ``draft_masks`` then computes, on the worker while the forward runs, one mask per
verified row: before each draft and after the last. Verification samples from the masked
logits, and ``advance`` feeds the matcher every token the sequence kept.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import attrs
import numpy as np
import torch

from powertrain.cpu_budget import cpu_budget
from powertrain.interfaces.errors import InvalidRequestError
from powertrain.interfaces.sampling import KIND_NAMES, StructuredOutput

if TYPE_CHECKING:
    import llguidance

    from powertrain.tokenizer import Tokenizer


class GrammarState:
    """One sequence's matcher and the tokens it may not sample next.

    After the engine thread creates it, only the device thread (between steps) and the grammar
    worker (inside one job, which ``ready`` completes) touch it, never both at once.
    """

    __slots__ = ("matcher", "disallowed", "ready")

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher
        #: bool [1 + drafts, llguidance's vocab size]: the next token's mask, then one after
        #: each draft the step verifies (none without speculation).
        self.disallowed: torch.Tensor = torch.empty(0, 0, dtype=torch.bool)
        self.ready: Future[None] | None = None  # the job that writes ``disallowed``


@attrs.frozen
class TokenMasks:
    """The sampler's view: which sample rows are constrained, and what each may not sample."""

    rows: list[int]
    disallowed: torch.Tensor  # bool [len(rows), llguidance's vocab size]

    def apply(self, logits: torch.Tensor) -> None:
        """Set the logits of every token a row may not sample to -inf (in place)."""
        vocab = logits.shape[1]
        disallowed = self.disallowed[:, :vocab]
        if disallowed.shape[1] < vocab:  # ids past the tokenizer's vocabulary (padded embedding rows)
            disallowed = torch.nn.functional.pad(disallowed, (0, vocab - disallowed.shape[1]), value=True)
        if len(self.rows) == logits.shape[0]:  # rows are distinct sample rows: these are all of them
            logits.masked_fill_(disallowed, float("-inf"))
        else:
            logits[self.rows] = logits[self.rows].masked_fill_(disallowed, float("-inf"))


class StructuredOutputs:
    """Per engine: llguidance's view of the tokenizer, the compiler, and the grammar worker.

    ``start`` runs on the engine thread (when a request is added); ``masks`` and ``advance`` run
    on the device thread, before and after each step's sampling.
    """

    def __init__(self, tokenizer: Tokenizer, *, threads: int | None = None) -> None:
        self.tokenizer = tokenizer
        # llguidance fans a step's matchers out over its own threads; leave cores to the forward.
        self._threads = threads or max(1, min(8, cpu_budget().cpus // 2))
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._executor: llguidance.LLExecutor | None = None
        self._worker: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        """Built on first use (it walks the whole vocabulary: most of a second)."""
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance

                # The grammar's end is EOS: llguidance allows only these once the output is complete.
                self._ll_tokenizer = llguidance.LLTokenizer(
                    self.tokenizer.backend.to_str(), eos_token=sorted(self.tokenizer.eos_token_ids)
                )
                self._executor = llguidance.LLExecutor(num_threads=self._threads)
                self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="powertrain-grammar")
            return self._ll_tokenizer

    def compile(self, constraint: StructuredOutput) -> llguidance.LLMatcher:
        """A fresh matcher for ``constraint``; InvalidRequestError with llguidance's reason if it
        does not compile (an unsupported schema keyword, an unsatisfiable schema, a bad regex)."""
        from llguidance import LLMatcher

        grammar = constraint.grammar()
        matcher = LLMatcher(self.ll_tokenizer, grammar, log_level=0)  # compiles without the GIL
        if matcher.is_error():
            raise InvalidRequestError(
                f"the {KIND_NAMES[constraint.kind]} constraint cannot be compiled: {matcher.get_error().strip()}"
            )
        return matcher

    def start(self, constraint: StructuredOutput, count: int) -> list[GrammarState]:
        """Matchers for the ``count`` sequences of a request; their first masks are computed
        on the worker right away."""
        matcher = self.compile(constraint)
        states = [GrammarState(matcher if i == 0 else matcher.deep_copy()) for i in range(count)]
        self._submit(states, None)
        return states

    def masks(self, states: Sequence[GrammarState]) -> torch.Tensor:
        """What ``states`` may not sample (their rows, in order: one per state, or one per
        verified row), once the jobs computing it are done."""
        for state in states:
            state.ready.result()  # type: ignore[union-attr]  # every state has a job from start()
        return torch.cat([state.disallowed for state in states])

    def advance(self, states: Sequence[GrammarState], tokens: Sequence[Sequence[int]]) -> None:
        """Feed each state the tokens it kept (one, or accepted drafts and one) and compute
        its next mask, on the worker."""
        self._submit(states, tokens)

    def allowed_drafts(self, state: GrammarState, drafts: Sequence[int]) -> int:
        """How many of ``drafts``, from the start, the grammar accepts after the tokens fed so
        far (device thread, before a step: it waits for the state's job)."""
        state.ready.result()  # type: ignore[union-attr]
        return state.matcher.validate_tokens(list(drafts))

    def draft_masks(self, states: Sequence[GrammarState], drafts: Sequence[Sequence[int]]) -> None:
        """Compute each state's masks before each of its ``drafts`` (which the grammar accepts)
        and after the last, on the worker; the matchers are left where they were."""
        self._submit(states, None, drafts)

    def _submit(
        self,
        states: Sequence[GrammarState],
        tokens: Sequence[Sequence[int]] | None,
        drafts: Sequence[Sequence[int]] | None = None,
    ) -> None:
        assert self._worker is not None
        job = self._worker.submit(self._fill, list(states), tokens, drafts)
        for state in states:
            state.ready = job

    def _fill(
        self,
        states: list[GrammarState],
        tokens: Sequence[Sequence[int]] | None,
        drafts: Sequence[Sequence[int]] | None,
    ) -> None:
        """The worker's job. No torch op runs here (a second thread computing with torch starts
        a second OpenMP team, see device_thread.py): llguidance and numpy do the work."""
        executor, ll_tokenizer = self._executor, self._ll_tokenizer
        assert executor is not None and ll_tokenizer is not None
        matchers = [state.matcher for state in states]
        # A token a matcher refuses leaves it in an error state, whose mask allows only EOS,
        # so the sequence ends; that is also what a finished sequence's last moot token does.
        if tokens is not None and all(len(kept) == 1 for kept in tokens):
            executor.consume_token_par([(matcher, kept[0]) for matcher, kept in zip(matchers, tokens, strict=True)])
        elif tokens is not None:
            for matcher, kept in zip(matchers, tokens, strict=True):
                matcher.consume_tokens(list(kept))
        drafts = drafts or [[] for _ in states]
        starts = np.cumsum([0] + [1 + len(d) for d in drafts]).tolist()
        # One bit per token: bit t % 32 of the little-endian 32-bit word t // 32.
        bits = np.empty((starts[-1], (ll_tokenizer.vocab_size + 31) // 32), dtype=np.int32)
        row_bytes = bits.shape[1] * 4
        rows = list(zip(matchers, starts[:-1], drafts, strict=True))
        if plain := [(matcher, start) for matcher, start, d in rows if not d]:
            executor.unsafe_compute_mask_ptr(plain, bits.ctypes.data, row_bytes, starts[-1])
        if drafted := [(matcher, start, list(d)) for matcher, start, d in rows if d]:
            # The mask before each draft and after the last; the matcher rolls back.
            executor.unsafe_compute_mask_ptr_with_draft_token(drafted, bits.ctypes.data, row_bytes, starts[-1])
        disallowed = torch.from_numpy(np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little") == 0)
        for state, start, end in zip(states, starts[:-1], starts[1:], strict=True):
            state.disallowed = disallowed[start:end]

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)

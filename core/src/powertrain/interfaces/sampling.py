"""How one request's tokens are chosen: ``SamplingParams`` (with its output constraint,
``StructuredOutput``), and the distribution the sampler draws from for them.

Part of the contract because a speculative policy verifies drafts against exactly that
distribution (``target_probs``): a lossless verifier and the sampler must agree on it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch

from powertrain.interfaces.errors import InvalidRequestError

#: What a constraint can be: a JSON schema (OpenAI ``response_format`` ``json_schema``), any JSON
#: object (``json_object``), a regular expression (Rust ``regex`` syntax, matched against the
#: whole output) or a Lark grammar (llguidance's dialect, which can also embed JSON schemas with
#: ``%json {...}``).
KINDS = ("json_schema", "json_object", "regex", "lark")
KIND_NAMES = {"json_schema": "JSON schema", "json_object": "JSON object", "regex": "regex", "lark": "Lark grammar"}

#: How JSON is laid out unless a schema's ``"x-guidance"`` says otherwise: one space after ``:``
#: and ``,`` (as ``json.dumps`` writes it) and no other whitespace. Free whitespace lets a small
#: model pad with newlines until it runs out of tokens; a fixed layout is still valid JSON.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@attrs.frozen
class StructuredOutput:
    """A constraint on a request's output, e.g. ``StructuredOutput("json_schema", {...})``.

    ``spec`` is the JSON schema (a dict, or its JSON text) for ``json_schema``, nothing for
    ``json_object``, the pattern for ``regex`` and the grammar text for ``lark``. A schema's
    ``"x-guidance"`` key takes llguidance's JSON options (e.g. ``{"whitespace_flexible": true}``).
    Whether the constraint compiles is checked when the request is added.
    """

    kind: str
    spec: Any = attrs.field(default=None, hash=False)  # dicts do not hash; equality still sees them

    def __attrs_post_init__(self) -> None:
        kind, spec = self.kind, self.spec
        if kind not in KINDS:
            raise InvalidRequestError(f"structured output kind must be one of {', '.join(KINDS)}; got {kind!r}")
        if kind == "json_schema":
            if isinstance(spec, str):
                try:
                    spec = json.loads(spec)
                except ValueError as error:
                    raise InvalidRequestError(f"the JSON schema is not valid JSON: {error}") from None
            if not isinstance(spec, Mapping):
                raise InvalidRequestError(
                    f"a json_schema constraint needs the schema as a JSON object, got {type(spec).__name__}"
                )
            try:  # a private copy, so a caller changing its dict later cannot change this request
                spec = json.loads(json.dumps(spec))
            except (TypeError, ValueError) as error:
                raise InvalidRequestError(f"the JSON schema cannot be written as JSON: {error}") from None
            object.__setattr__(self, "spec", spec)
        elif kind == "json_object":
            if spec is not None:
                raise InvalidRequestError("a json_object constraint takes no spec; use json_schema to give a schema")
        elif not isinstance(spec, str) or not spec:
            what = "pattern" if kind == "regex" else "grammar text"
            raise InvalidRequestError(f"a {kind} constraint needs its {what} as a non-empty string, got {spec!r}")

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | str) -> StructuredOutput:
        return cls("json_schema", schema)

    @classmethod
    def json_object(cls) -> StructuredOutput:
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> StructuredOutput:
        return cls("regex", pattern)

    @classmethod
    def lark(cls, grammar: str) -> StructuredOutput:
        return cls("lark", grammar)

    def check(self) -> None:
        """Raise InvalidRequestError now if the constraint cannot compile: for callers (a
        server) that must refuse a request before they start answering it. Checked without
        the tokenizer, so a grammar can still fail later against a vocabulary."""
        from llguidance import LLMatcher

        problem = LLMatcher.validate_grammar(self.grammar())
        if problem:
            raise InvalidRequestError(f"the {KIND_NAMES[self.kind]} constraint cannot be compiled: {problem.strip()}")

    def grammar(self) -> str:
        """llguidance's grammar for this constraint (not yet compiled, so not yet checked)."""
        from llguidance import LLMatcher

        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.spec)
        if self.kind == "lark":
            return LLMatcher.grammar_from_lark(self.spec)
        schema = {"type": "object"} if self.kind == "json_object" else self.spec
        try:
            return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)  # type: ignore[arg-type]
        except ValueError as error:  # e.g. an "x-guidance" value of the wrong type
            raise InvalidRequestError(f"the JSON schema cannot be compiled: {error}") from None


def _bias_pairs(value: Any) -> tuple:
    """``{token id: bias}`` (or its pairs) as sorted pairs, so the frozen params hash."""
    try:
        pairs = value.items() if isinstance(value, Mapping) else (value or ())
        return tuple(sorted((tuple(pair) for pair in pairs), key=repr))
    except TypeError:  # not pairs at all: kept as it is for the check to report
        return (value,)


def _to_tuple(value: Any) -> tuple:
    if value is None:
        return ()
    if isinstance(value, str | int):
        return (value,)
    return tuple(value)


@attrs.frozen(kw_only=True)
class SamplingParams:
    """Sampling settings of one request (OpenAI/vLLM semantics).

    ``temperature=0`` is greedy. ``top_k=0`` and ``top_p=1`` disable those filters.
    ``seed`` makes the request's tokens reproducible whatever else is in the batch.
    ``logprobs=k`` returns the chosen token's logprob and the ``k`` most likely ones
    (from the model's distribution before temperature, penalties and constraints).
    ``structured`` constrains the output to a JSON schema, any JSON object, a regex or a
    Lark grammar (see ``StructuredOutput``); the output then ends when the constraint is
    complete, with an EOS token even if ``ignore_eos`` is set.
    ``logit_bias`` (OpenAI's: ``{token id: bias in [-100, 100]}``) is added to those tokens'
    logits before sampling; -100 in effect bans a token, +100 in effect forces it.
    """

    n: int = 1
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: tuple[str, ...] = attrs.field(default=(), converter=_to_tuple)
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_to_tuple)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    seed: int | None = None
    logprobs: int | None = None
    skip_special_tokens: bool = True
    logit_bias: tuple[tuple[int, float], ...] = attrs.field(default=(), converter=_bias_pairs)
    structured: StructuredOutput | None = None

    def __attrs_post_init__(self) -> None:
        problems = []

        def need(ok: bool, message: str) -> None:
            if not ok:
                problems.append(message)

        need(_is_int(self.n) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}")
        need(_is_int(self.max_tokens) and self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens!r}")
        need(
            _is_int(self.min_tokens) and 0 <= self.min_tokens <= max(self.max_tokens, 0),
            f"min_tokens must be between 0 and max_tokens ({self.max_tokens}), got {self.min_tokens!r}",
        )
        need(
            _is_number(self.temperature) and self.temperature >= 0,
            f"temperature must be >= 0, got {self.temperature!r}",
        )
        need(_is_number(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}")
        need(_is_int(self.top_k) and self.top_k >= 0, f"top_k must be >= 0 (0 disables it), got {self.top_k!r}")
        need(_is_number(self.min_p) and 0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p!r}")
        need(
            _is_number(self.repetition_penalty) and self.repetition_penalty > 0,
            f"repetition_penalty must be > 0 (1 disables it), got {self.repetition_penalty!r}",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            need(_is_number(value) and -2 <= value <= 2, f"{name} must be in [-2, 2], got {value!r}")
        need(all(isinstance(s, str) and s for s in self.stop), f"stop must be non-empty strings, got {self.stop!r}")
        need(
            all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
            f"stop_token_ids must be token ids >= 0, got {self.stop_token_ids!r}",
        )
        need(
            all(
                isinstance(p, tuple)
                and len(p) == 2
                and _is_int(p[0])
                and p[0] >= 0
                and _is_number(p[1])
                and -100 <= p[1] <= 100
                for p in self.logit_bias
            ),
            f"logit_bias must map token ids >= 0 to biases in [-100, 100], got {self.logit_bias!r}",
        )
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            value = getattr(self, name)
            need(isinstance(value, bool), f"{name} must be true or false, got {value!r}")
        need(self.seed is None or _is_int(self.seed), f"seed must be an integer, got {self.seed!r}")
        need(
            self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= 20),
            f"logprobs must be between 0 and 20, got {self.logprobs!r}",
        )
        need(
            self.structured is None or isinstance(self.structured, StructuredOutput),
            f"structured must be a StructuredOutput, got {type(self.structured).__name__}",
        )
        need(
            self.structured is None or self.min_tokens == 0,
            "min_tokens cannot be combined with structured output: the constraint decides where the output ends",
        )
        if problems:
            raise InvalidRequestError("invalid sampling parameters: " + "; ".join(problems))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


#: The sampling fields a model's own defaults may set (generation_config.json spells them so too).
DEFAULTABLE = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@attrs.frozen(kw_only=True)
class SamplingDefaults:
    """What a request gets for the sampling fields it leaves unset: the model's own
    defaults (its ``generation_config.json``, as vLLM and transformers read it) where it
    has them, ``SamplingParams``' own elsewhere. ``source`` says where they came from."""

    values: Mapping[str, float] = attrs.field(factory=dict, converter=dict)
    source: str = "powertrain's defaults"

    @classmethod
    def from_generation_config(cls, config: Mapping[str, Any], source: str) -> SamplingDefaults:
        """The defaults a ``generation_config.json`` sets. An explicit ``do_sample: false``
        means greedy, as transformers' ``generate`` reads it; a value SamplingParams would
        refuse raises InvalidRequestError naming the key and ``source``."""
        if config.get("do_sample") is False:
            return cls(values={"temperature": 0.0}, source=f"{source} (do_sample: false, so greedy)")
        values = {name: config[name] for name in DEFAULTABLE if config.get(name) is not None}
        try:
            SamplingParams(**values)
        except InvalidRequestError as exc:
            raise InvalidRequestError(f"{source}: {exc}") from exc
        return (
            cls(values=values, source=source) if values else cls(source=f"powertrain's defaults ({source} sets none)")
        )

    def params(self, **fields: Any) -> SamplingParams:
        """``SamplingParams(**fields)`` with these defaults where a field is left out or None."""
        given = {name: value for name, value in fields.items() if value is not None}
        return SamplingParams(**{**self.values, **given})


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value == value  # not NaN


# --------------------------------------------------------------------------- the sampled distribution


def filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Softmax, then top-k, top-p and min-p as masks, renormalised per row (``logits``
    already divided by each row's temperature): what the sampler draws from."""
    probs = torch.softmax(logits, dim=-1)
    vocab = probs.shape[1]
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params])
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
    min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32)
    if (top_k < vocab).any() or (top_p < 1).any():
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab)[None, :]
        # Keep a token while the mass strictly before it is below top_p (so the top one always stays).
        before = sorted_probs.cumsum(dim=-1) - sorted_probs
        keep_sorted = (ranks < top_k[:, None]) & (before < top_p[:, None])
        keep = torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)
        probs = probs * keep
    if (min_p > 0).any():
        threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = torch.where(probs >= threshold, probs, torch.zeros_like(probs))
    return probs / probs.sum(dim=-1, keepdim=True)


def row_argmax(values: torch.Tensor) -> torch.Tensor:
    """``values.argmax(dim=-1)``: each row's first maximum, a NaN counting as the maximum.

    Float CPU tensors go through numpy's argmax, which gives the same indices: torch's CPU
    argmax took 70-80 us per row of SmolLM2's 49,152 logits on the 2-core Xeon VM (2.4 ms
    for a 64-row step) against numpy's 4-7 us."""
    if values.is_cpu and values.dtype in (torch.float32, torch.float64) and values.dim() > 0:  # numpy reads host memory
        return torch.as_tensor(values.detach().numpy().argmax(axis=-1), dtype=torch.int64)
    return values.argmax(dim=-1)


def race_noise(out: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """``out`` filled, in place, with the exponential race's ``Exp(1)`` draws: ``-log(u)`` of
    uniform ``u`` in [0, 1). The sampler and every verifier that must draw its very tokens
    use this, so a seeded request gets the same tokens either way.

    torch's CPU ``exponential_`` took 56 ms to fill 64 rows of SmolLM2's 49,152 (a third of
    a 64-sequence decode step on the 2-core Xeon VM); ``uniform_`` and a log take 10. A
    ``u`` of 0 (2^-24 per entry) is raised to the smallest normal float, so every draw is
    finite (at most 87.3): an infinite one would zero its entry's ``p / q``, and where that
    entry held all the probability (a one-hot target) the race would go to token 0."""
    return out.uniform_(generator=generator).clamp_(min=torch.finfo(out.dtype).tiny).log_().neg_()


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution the sampler draws from for ``params``, one row per position
    (float32 ``[rows, vocab]``); greedy (temperature 0) is a one-hot of the argmax.
    A speculative verifier compares drafts against exactly this."""
    logits = logits.float()
    if params.temperature == 0:
        return torch.nn.functional.one_hot(row_argmax(logits), logits.shape[-1]).float()
    return filtered_probs(logits / params.temperature, [params] * logits.shape[0])

"""Registers DSpark (entry point ``dspark``): two speculative policies and the [dspark] table.

``speculative = "dspark"`` verifies, per step and for the whole batch, the drafts worth
verifying (``lengths.dspark_rule``); ``speculative = "fixed-k"`` verifies
``max_draft_tokens`` drafts of every request. Both draft and verify the same way, as
``[dspark]`` configures.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs
import structlog

from powertrain import hookimpl
from powertrain.components import ConfigSectionRecord, SpeculativePolicyRecord

if TYPE_CHECKING:  # importing the plugin stays cheap: no torch until a policy is built
    from powertrain.interfaces import SpeculativeContext
    from powertrain_dspark.drafter import Drafter
    from powertrain_dspark.policy import SpeculativeDecoder

POWERTRAIN_HOOK_API = 1

log = structlog.get_logger(__name__)

DRAFTERS = ("ngram", "mtp", "block")


def _one_of(*choices: str) -> Any:
    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value not in choices:
            raise ValueError(f"{attribute.name} must be one of {', '.join(choices)}; got {value!r}")

    return check


def _in_range(low: int, high: int) -> Any:
    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if not low <= value <= high:
            raise ValueError(f"{attribute.name} must be between {low} and {high}; got {value!r}")

    return check


def _profile_triples(value: Any) -> tuple[tuple[int, int, float], ...]:
    triples = []
    for entry in value:
        try:
            if not isinstance(entry, list | tuple) or len(entry) != 3:
                raise ValueError
            n, q, sps = entry
            triples.append((int(n), int(q), float(sps)))
        except (TypeError, ValueError):
            raise ValueError(
                f"[dspark] steps_per_second takes [sequences, tokens, steps/s] triples of numbers; got {entry!r}"
            ) from None
    return tuple(triples)


@attrs.frozen(kw_only=True)
class DSparkConfig:
    """The ``[dspark]`` table of engine.toml."""

    #: "ngram" (prompt lookup, any model), "mtp" (a DeepSeek checkpoint's MTP layers) or
    #: "block" (DeepSeek's DSpark block drafter: from ``draft_model``, or without it the one
    #: the target's checkpoint carries, DeepSeek-V4.1's ``mtp.*``).
    drafter: str = attrs.field(default="ngram", validator=_one_of(*DRAFTERS))
    #: The block drafter's folder: a DeepSpec DSpark checkpoint (config.json, safetensors)
    #: trained for this target ("": the target's own drafter).
    draft_model: str = ""
    #: The block drafter's linear weights: "none" (as its checkpoint stores them) or "q8"
    #: (rounded to 8-bit codes at load and multiplied by the platform's quantised-linear
    #: kernel: on a CPU the drafter's float32 weights are most of its cost, and drafts
    #: only propose, so rounding them never changes an output).
    draft_quantization: str = attrs.field(default="none", validator=_one_of("none", "q8"))
    #: Drafts per request and step at most (fixed-k verifies this many).
    max_draft_tokens: int = attrs.field(default=5, validator=_in_range(1, 16))
    #: n-gram drafter: longest and shortest suffix to look up.
    ngram_max: int = attrs.field(default=4, validator=_in_range(1, 16))
    ngram_min: int = attrs.field(default=1, validator=_in_range(1, 16))
    #: Fix each step's verification budget from the previous step's confidences (the
    #: variant an overlapped engine needs); the current ones still rank the drafts.
    lagged_budget: bool = False
    #: A calibration file written by `powertrain-dspark calibrate` ("" = raw confidences).
    calibration: str = ""
    #: Append one JSON line per request-step that verified drafts (raw confidences and
    #: how many were accepted): the data `powertrain-dspark calibrate` fits on.
    log: str = ""
    #: Sequence counts at which the target's steps per second are measured at startup,
    #: each with 1 .. 1 + max_draft_tokens tokens per sequence (lengths.StepsPerSecondGrid);
    #: steps with more sequences than the last extrapolate the last two counts.
    profile_sequences: tuple[int, ...] = attrs.field(
        default=(1, 2, 4, 8, 16, 32, 64), converter=lambda v: tuple(int(x) for x in v)
    )
    #: A steps-per-second profile given instead of measured: ``[sequences, tokens per
    #: sequence, steps/s]`` triples covering every pair of a grid (the startup log prints
    #: the measured one). Pins DSpark's choices where the measurement would vary (a
    #: shared machine, reproducible runs) and skips the startup probe; empty = measure.
    steps_per_second: tuple[tuple[int, int, float], ...] = attrs.field(default=(), converter=_profile_triples)
    #: Rest a sequence whose drafts the length rule keeps declining, probing now and then
    #: (``back_off``; lossless): "auto" does for the block drafter, whose every proposal
    #: costs a forward of its layers; "on"; "off".
    back_off: str = attrs.field(default="auto", validator=_one_of("auto", "on", "off"))
    #: The MTP drafter's confidence head (`powertrain-dspark train-confidence-head`);
    #: "" = the draft distribution's own estimate.
    confidence_head: str = ""


def build(context: SpeculativeContext, rule: str) -> SpeculativeDecoder:
    """A ``SpeculativeDecoder`` for ``context``."""
    from powertrain_dspark.back_off import BackOff
    from powertrain_dspark.calibration import Calibration
    from powertrain_dspark.lengths import StepsPerSecondGrid
    from powertrain_dspark.policy import SpeculativeDecoder

    config: DSparkConfig = context.config or DSparkConfig()
    if config.ngram_min > config.ngram_max:
        raise ValueError(f"[dspark] ngram_min ({config.ngram_min}) must not exceed ngram_max ({config.ngram_max})")
    drafter = make_drafter(context, config)
    sps = None
    if rule == "dspark":  # only DSpark weighs tokens against step time
        # probed as the batches it will verify: each sequence a token and its drafts
        widths = range(1, 2 + config.max_draft_tokens)
        if config.steps_per_second:
            profile = {(n, q): sps for n, q, sps in config.steps_per_second}
            if missing := [q for q in widths if not any(w == q for _, w in profile)]:
                raise ValueError(
                    f"[dspark] steps_per_second has no entry with {missing} tokens per sequence; "
                    f"max_draft_tokens={config.max_draft_tokens} needs 1 to {widths[-1]}"
                )
        else:
            profile = context.measure_steps_per_second(config.profile_sequences, widths)
        log.info(
            "dspark steps-per-second profile",
            given=bool(config.steps_per_second),
            **{f"n={n},q={q}": round(v, 1) for (n, q), v in sorted(profile.items())},
        )
        try:
            sps = StepsPerSecondGrid.from_profile(profile)
        except ValueError as error:
            if not config.steps_per_second:
                raise
            raise ValueError(f"[dspark] steps_per_second: {error}") from error
    return SpeculativeDecoder(
        drafter,
        rule,
        sps=sps,
        fixed_k=config.max_draft_tokens,
        calibration=Calibration.load(config.calibration) if config.calibration else None,
        lagged_budget=config.lagged_budget,
        log_path=config.log or None,
        back_off=BackOff()
        if config.back_off == "on" or (config.back_off, config.drafter) == ("auto", "block")
        else None,
    )


def make_drafter(context: SpeculativeContext, config: DSparkConfig) -> Drafter:
    """The drafter ``[dspark] drafter`` names (tests replace it with one whose drafts they know)."""
    if config.drafter == "mtp":
        from powertrain_dspark.mtp import MTPDrafter

        return MTPDrafter.from_context(context, config)
    if config.drafter == "block":
        from powertrain_dspark.block import BlockDrafter

        return BlockDrafter.from_context(context, config)
    from powertrain_dspark.ngram import NgramDrafter

    return NgramDrafter(config.ngram_min, config.ngram_max, config.max_draft_tokens)


def requirements(section: Mapping[str, Any]) -> dict[str, set[str]]:
    """DeepSpec's block drafter's layers attend both ways inside a block (``causal`` False)
    through the attention backend; a target's own drafter (no ``draft_model``) computes
    its attention itself."""
    return {"attention": {"non-causal"}} if section.get("drafter") == "block" and section.get("draft_model") else {}


def build_dspark(context: SpeculativeContext) -> SpeculativeDecoder:
    return build(context, "dspark")


def build_fixed(context: SpeculativeContext) -> SpeculativeDecoder:
    return build(context, "fixed")


@hookimpl
def powertrain_speculative_policies() -> list[SpeculativePolicyRecord]:
    return [
        SpeculativePolicyRecord(
            name="dspark",
            factory=build_dspark,
            config_section="dspark",
            requirements=requirements,
            description="confidence-scheduled, load-aware speculative decoding (lossless)",
        ),
        SpeculativePolicyRecord(
            name="fixed-k",
            factory=build_fixed,
            config_section="dspark",
            requirements=requirements,
            description="speculative decoding verifying max_draft_tokens drafts of every request",
        ),
    ]


@hookimpl
def powertrain_config_sections() -> list[ConfigSectionRecord]:
    return [ConfigSectionRecord(name="dspark", config_class=DSparkConfig, description="DSpark speculative decoding")]

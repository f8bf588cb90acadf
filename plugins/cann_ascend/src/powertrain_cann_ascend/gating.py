"""Which DeepSeek routing configs ``torch_npu.npu_moe_gating_top_k`` can compute, and with what arguments.

The core's ``powertrain.layers.moe.route`` is the rule; the fused op may only be
used where it chooses the same experts with the same weights. What the op computes
(torch_npu API reference, Ascend/op-plugin ``docs/context/torch_npu-npu_moe_gating_top_k.md``,
and the aclnnMoeGatingTopK reference it calls)::

    norm  = softmax(x) if norm_type == 0 else sigmoid(x)          # float32
    value = norm + bias (if a bias is given)                      # steers the choice only
    if group_count > 1: keep the k_group groups with the highest score,
        score = max(value in group)          (group_select_mode 0)
              = sum of its top-2 values      (group_select_mode 1)
    ids   = top-k of value over kept groups
    y     = norm[ids]
    y     = y / (sum(y) + eps)   always for sigmoid; for softmax only with renorm=1
    y     = y * routed_scaling_factor

Against ``layers.moe.route`` that gives (see ``routing_support`` for each reason):

* the group scores match exactly: V2's group_limited_greedy is mode 0 (best expert),
  V3's noaux_tc is mode 1 (sum of the best two, bias included);
* sigmoid always renormalises, so sigmoid + ``norm_topk_prob = false`` cannot be
  expressed; softmax + ``norm_topk_prob = true`` needs ``renorm = 1``, which the
  torch_npu reference documents as unsupported ("当前仅支持0");
* a config whose groups cannot exclude anything (greedy, or ``topk_group ==
  n_group``) is plain top-k: ``group_count = 1``;
* the shape limits (at most 2048 experts; more than 2 experts per group; per-group
  width padded to 32 times the groups at most 2048; k within the kept groups).

Two releases document different limits, so they are data (``GatingLimits``):
``GENERAL`` is torch_npu 7.2+ with CANN 8.3.RC1+ (softmax or sigmoid, any group
count); ``DEEPSEEK_V3_ONLY`` is what torch_npu 7.0.0 documents (hiascend.com
Pytorch/700 ptaoplist_002365: exactly 256 experts, k in [1, 32], k_group 4, a
bias required, sigmoid with the top-2-sum group score, and 8 groups as vllm-ascend
pins it for that release).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import attrs

from powertrain.components import Availability
from powertrain.interfaces import RoutingConfig

#: ``norm_type`` values of the op.
SOFTMAX, SIGMOID = 0, 1
#: ``group_select_mode`` values: a group's best expert, or the sum of its best two.
GROUP_MAX, GROUP_TOP2_SUM = 0, 1
#: The core divides by ``sum + 1e-20``; the op's eps plays that role.
EPS = 1e-20


@attrs.frozen(kw_only=True)
class GatingLimits:
    """What one torch_npu release documents that ``npu_moe_gating_top_k`` accepts."""

    name: str
    max_experts: int = 2048
    #: Group widths are padded to 32 experts; padded width x groups may not exceed this.
    max_aligned_experts: int = 2048
    #: The op requires strictly more experts than this in each group.
    min_experts_per_group_exclusive: int = 2
    norm_types: frozenset[int] = frozenset({SOFTMAX, SIGMOID})
    group_select_modes: frozenset[int] = frozenset({GROUP_MAX, GROUP_TOP2_SUM})
    #: Fixed values an older release insists on (None: any value the rules above allow).
    only_experts: int | None = None
    only_group_count: int | None = None
    only_k_group: int | None = None
    max_k: int | None = None
    needs_bias: bool = False


GENERAL = GatingLimits(name="torch_npu 7.2+ / CANN 8.3.RC1+")
DEEPSEEK_V3_ONLY = GatingLimits(
    name="torch_npu 7.0.0",
    norm_types=frozenset({SIGMOID}),
    group_select_modes=frozenset({GROUP_TOP2_SUM}),
    only_experts=256,
    only_group_count=8,
    only_k_group=4,
    max_k=32,
    needs_bias=True,
)


@attrs.frozen(kw_only=True)
class GatingArgs:
    """The op's arguments for one routing config (everything but ``x`` and ``bias``)."""

    k: int
    k_group: int
    group_count: int
    group_select_mode: int
    renorm: int
    norm_type: int
    out_flag: bool
    routed_scaling_factor: float
    eps: float

    def kwargs(self) -> dict[str, Any]:
        """Keyword arguments after ``x, k`` (the op takes everything past ``k`` by keyword)."""
        return {
            "k_group": self.k_group,
            "group_count": self.group_count,
            "group_select_mode": self.group_select_mode,
            "renorm": self.renorm,
            "norm_type": self.norm_type,
            "out_flag": self.out_flag,
            "routed_scaling_factor": self.routed_scaling_factor,
            "eps": self.eps,
        }


def gating_args(config: RoutingConfig) -> GatingArgs:
    """The op's arguments that reproduce ``layers.moe.route`` for ``config``.

    Only meaningful where ``routing_support`` says yes; it does not check limits.
    """
    grouped = config.limits_groups
    return GatingArgs(
        k=config.top_k,
        k_group=config.topk_group if grouped else 1,
        group_count=config.n_group if grouped else 1,
        group_select_mode=GROUP_TOP2_SUM if config.topk_method == "noaux_tc" else GROUP_MAX,
        renorm=0,
        norm_type=SIGMOID if config.scoring == "sigmoid" else SOFTMAX,
        out_flag=False,
        routed_scaling_factor=float(config.routed_scaling_factor),
        eps=EPS,
    )


def _refusal(config: RoutingConfig, limits: GatingLimits) -> str | None:
    """Why the op cannot reproduce ``config``'s routing under ``limits``, or None."""
    if config.scoring not in ("sigmoid", "softmax"):
        return f"npu_moe_gating_top_k scores by sigmoid or softmax, not {config.scoring!r}"
    if config.topk_method == "hash":
        return "npu_moe_gating_top_k chooses experts by score; hash routing takes them from a token-id table"
    if config.scoring == "sigmoid" and not config.norm_topk_prob:
        return (
            "npu_moe_gating_top_k always renormalises sigmoid weights (norm_type=1), "
            "but this config has norm_topk_prob = false"
        )
    if config.scoring == "softmax" and config.norm_topk_prob:
        return (
            "renormalising softmax top-k weights needs renorm=1, which torch_npu documents "
            "as unsupported (renorm must be 0)"
        )
    args = gating_args(config)
    if args.norm_type not in limits.norm_types:
        return f"{limits.name} documents only sigmoid scoring (norm_type=1) for npu_moe_gating_top_k"
    if args.group_count > 1 and args.group_select_mode not in limits.group_select_modes:
        return (
            f"{limits.name} scores a group only by the sum of its top-2 experts (group_select_mode=1), "
            f"but topk_method {config.topk_method!r} scores it by its best expert"
        )
    if limits.needs_bias and not config.uses_correction_bias:
        return f"{limits.name} requires a correction bias, which only noaux_tc routing has"
    experts = config.num_experts
    if limits.only_experts is not None and experts != limits.only_experts:
        return f"{limits.name} supports exactly {limits.only_experts} experts, this config has {experts}"
    if experts > limits.max_experts:
        return f"npu_moe_gating_top_k takes at most {limits.max_experts} experts, this config has {experts}"
    if limits.only_group_count is not None and (
        args.group_count != limits.only_group_count or args.k_group != limits.only_k_group
    ):
        return (
            f"{limits.name} supports only group_count={limits.only_group_count} with "
            f"k_group={limits.only_k_group}, this config needs group_count={args.group_count}, "
            f"k_group={args.k_group}"
        )
    per_group = experts // args.group_count
    if per_group <= limits.min_experts_per_group_exclusive:
        where = f"{args.group_count} groups of {per_group}" if args.group_count > 1 else f"{experts} experts"
        return (
            f"npu_moe_gating_top_k needs more than {limits.min_experts_per_group_exclusive} experts "
            f"per group, this config has {where}"
        )
    aligned = -(-per_group // 32) * 32 * args.group_count
    if aligned > limits.max_aligned_experts:
        return (
            f"npu_moe_gating_top_k pads each group to a multiple of 32 experts and takes at most "
            f"{limits.max_aligned_experts} padded experts; {args.group_count} groups of {per_group} need {aligned}"
        )
    if args.k > per_group * args.k_group:
        return f"top_k = {args.k} exceeds the {per_group * args.k_group} experts of the kept groups"
    if limits.max_k is not None and args.k > limits.max_k:
        return f"{limits.name} takes k in [1, {limits.max_k}], this config has top_k = {args.k}"
    return None


def routing_support(config: Any, limits: GatingLimits = GENERAL) -> Availability:
    """Whether ``npu_moe_gating_top_k`` chooses what ``layers.moe.route`` chooses for ``config``."""
    if not isinstance(config, RoutingConfig):
        return Availability.no(f"expected a powertrain.interfaces.RoutingConfig, got {type(config).__name__}")
    return _support(config, limits)


@lru_cache(maxsize=256)
def _support(config: RoutingConfig, limits: GatingLimits) -> Availability:
    # Cached: asked once per layer at build and again by every ``route`` call (configs are frozen).
    why = _refusal(config, limits)
    if why is not None:
        return Availability.no(f"{why}; this layer routes in the core")
    args = gating_args(config)
    return Availability.yes(
        f"npu_moe_gating_top_k(k={args.k}, norm_type={args.norm_type}, group_count={args.group_count}, "
        f"k_group={args.k_group}, group_select_mode={args.group_select_mode}) under {limits.name}"
    )

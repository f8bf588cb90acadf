"""The MoE contract: the experts a rank holds, how a layer routes, and the Protocols
MoE backends implement.

Routing rules stay in the core (DESIGN §3): every backend gets the same expert choice
(``powertrain.layers.moe.route`` computes it from a layer's ``RoutingConfig``), so a
kernel pack can only change how fast the experts run, never which ones.

A backend that declares ``cuda-graphs`` may have ``forward`` captured in a CUDA graph
(``engine.cuda_graphs``) and replayed with new rows of the same count: it sizes its
launches from shapes alone, never reads a value back to the host and creates no tensor
from host data.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from typing import Any, Literal, Protocol, TypeVar, runtime_checkable

import attrs
import torch

from powertrain.interfaces.platform import Availability, PlatformInfo

#: What ``MoEBackend.prepare`` returns and ``forward`` receives: the experts re-laid out
#: as one backend's kernels want them (transposed, packed, pre-scaled). Nothing but that
#: backend reads it, so the contract keeps it a type parameter rather than a record.
Prepared = TypeVar("Prepared")

# --------------------------------------------------------------------------- routing

#: ``sqrtsoftplus``: sqrt(softplus(logit)), DeepSeek-V4's.
Scoring = Literal["sigmoid", "softmax", "sqrtsoftplus"]
#: ``hash``: the experts are a fixed function of the token id (DeepSeek-V4's first layers,
#: ``tid2eid[token_id]``), looked up by the layer and handed to ``route`` as ``expert_ids``;
#: the router's scores only weight them.
TopkMethod = Literal["greedy", "group_limited_greedy", "noaux_tc", "hash"]

SCORING_FUNCS = ("sigmoid", "softmax", "sqrtsoftplus")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc", "hash")

#: RoutingConfig field -> the config.json key it is read from (errors name both).
CONFIG_KEYS = {
    "num_experts": "n_routed_experts",
    "top_k": "num_experts_per_tok",
    "scoring": "scoring_func",
    "topk_method": "topk_method",
    "n_group": "n_group",
    "topk_group": "topk_group",
    "norm_topk_prob": "norm_topk_prob",
    "routed_scaling_factor": "routed_scaling_factor",
}

#: What HF's DeepseekV2Config / DeepseekV3Config assume when config.json omits a key
#: (scoring_func and topk_method are not config fields there: HF's V2 gate always
#: uses softmax, its V3 gate always sigmoid + noaux_tc). ``None`` = no usable default.
#: Kimi K2 ships DeepSeek-V3's architecture under its own model_type.
_DEFAULTS: dict[str, dict[str, object]] = {
    "deepseek_v2": {
        "n_routed_experts": 64,
        "num_experts_per_tok": None,
        "scoring_func": "softmax",
        "topk_method": "greedy",
        "n_group": None,
        "topk_group": None,
        "norm_topk_prob": False,
        "routed_scaling_factor": 1.0,
    },
    "deepseek_v3": {
        "n_routed_experts": 256,
        "num_experts_per_tok": 8,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "n_group": 8,
        "topk_group": 4,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
    },
}
_DEFAULTS["kimi_k2"] = _DEFAULTS["deepseek_v3"]
_DEFAULTS["deepseek_v32"] = _DEFAULTS["deepseek_v3"]  # transformers' DeepseekV32Config defaults


def _problem(field: str, value: object, why: str) -> ValueError:
    return ValueError(f"MoE routing: {CONFIG_KEYS[field]} = {value!r} (RoutingConfig.{field}) {why}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@attrs.frozen(kw_only=True)
class RoutingConfig:
    """How one MoE layer picks its experts; validated on construction, so a bad
    config.json fails at model build naming the key, not inside a forward pass."""

    num_experts: int
    top_k: int
    scoring: Scoring
    topk_method: TopkMethod
    #: Expert groups (DeepSeek places each group on one node). 1 = no grouping.
    n_group: int = 1
    #: Groups a token may draw its experts from (group-limited methods only).
    topk_group: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0

    def __attrs_post_init__(self) -> None:
        for field in ("num_experts", "top_k", "n_group", "topk_group"):
            value = getattr(self, field)
            if not _is_int(value) or value < 1:
                raise _problem(field, value, "must be a positive integer")
        if self.top_k > self.num_experts:
            raise _problem("top_k", self.top_k, f"exceeds n_routed_experts = {self.num_experts}")
        if self.scoring not in SCORING_FUNCS:
            raise _problem("scoring", self.scoring, f"is not one of {', '.join(SCORING_FUNCS)}")
        if self.topk_method not in TOPK_METHODS:
            raise _problem("topk_method", self.topk_method, f"is not one of {', '.join(TOPK_METHODS)}")
        if not isinstance(self.norm_topk_prob, bool):
            raise _problem("norm_topk_prob", self.norm_topk_prob, "must be true or false")
        factor = self.routed_scaling_factor
        if not (_is_int(factor) or isinstance(factor, float)) or not math.isfinite(factor) or factor <= 0:
            raise _problem("routed_scaling_factor", factor, "must be a positive number")
        if self.topk_method not in ("greedy", "hash"):
            self._check_groups()
        elif self.topk_method == "hash" and (self.n_group != 1 or self.topk_group != 1):
            raise _problem("n_group", self.n_group, "must be 1 (with topk_group 1) for hash routing")

    def _check_groups(self) -> None:
        if self.num_experts % self.n_group:
            raise _problem("n_group", self.n_group, f"must divide n_routed_experts = {self.num_experts}")
        if self.topk_group > self.n_group:
            raise _problem("topk_group", self.topk_group, f"exceeds n_group = {self.n_group}")
        reachable = self.topk_group * self.experts_per_group
        if self.top_k > reachable:
            raise _problem(
                "top_k",
                self.top_k,
                f"exceeds the {reachable} experts in topk_group = {self.topk_group} groups of {self.experts_per_group}",
            )
        if self.topk_method == "noaux_tc" and self.limits_groups and self.experts_per_group < 2:
            raise _problem(
                "n_group",
                self.n_group,
                "leaves fewer than 2 experts per group; noaux_tc scores a group by its best two",
            )

    @property
    def experts_per_group(self) -> int:
        return self.num_experts // self.n_group

    @property
    def limits_groups(self) -> bool:
        """Whether group selection can exclude anything (it cannot when every group is kept)."""
        return self.topk_method not in ("greedy", "hash") and self.topk_group < self.n_group

    @property
    def uses_correction_bias(self) -> bool:
        return self.topk_method == "noaux_tc"

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> RoutingConfig:
        """Read a deepseek_v2 / deepseek_v3 config.json dict; an absent (or null) key
        takes the default HF's config class of that ``model_type`` uses."""
        model_type = config.get("model_type")
        defaults = _DEFAULTS.get(model_type)
        if defaults is None:
            raise ValueError(
                f"MoE routing: model_type = {model_type!r} has no known routing defaults "
                f"(known: {', '.join(sorted(_DEFAULTS))}); build a RoutingConfig directly"
            )

        def read(field: str) -> Any:
            key = CONFIG_KEYS[field]
            value = config.get(key)
            if value is None:
                value = defaults[key]
            if value is None:
                raise ValueError(
                    f"MoE routing: config.json of a {model_type} model lacks {key!r}, which has no default"
                )
            return value

        method = read("topk_method")
        grouped = method != "greedy"
        return cls(
            num_experts=read("num_experts"),
            top_k=read("top_k"),
            scoring=read("scoring"),
            topk_method=method,
            # Greedy ignores groups; V2's group keys are null then, which means one group.
            n_group=read("n_group") if grouped else (config.get("n_group") or 1),
            topk_group=read("topk_group") if grouped else (config.get("topk_group") or 1),
            norm_topk_prob=read("norm_topk_prob"),
            routed_scaling_factor=read("routed_scaling_factor"),
        )


# --------------------------------------------------------------------------- experts


@attrs.frozen(kw_only=True)
class ExpertWeights:
    """The experts one rank holds, as the loader produces them (HF orientation).

    ``w13`` stacks gate then up projections: ``[local_experts, 2 * intermediate, hidden]``;
    ``w2`` is ``[local_experts, hidden, intermediate]``. FP8 checkpoints carry e4m3
    weights and float32 block scales (``block_shape`` e.g. (128, 128)). Under expert
    parallelism this rank holds global experts ``first_expert ...
    first_expert + local_experts - 1`` of ``num_experts``.

    With ``fp4`` (DeepSeek-V4's FP4 experts) the weights stay packed: ``w13`` uint8
    ``[local_experts, 2 * intermediate, hidden / 2]`` and ``w2`` uint8 ``[local_experts, hidden,
    intermediate / 2]``, two e2m1 codes a byte (even column in the low nibble), with
    ``float8_e8m0fnu`` scales ``w13_scale`` / ``w2_scale`` ``[local_experts, rows, cols / 32]``
    (``powertrain.loader.fp4``).

    ``swiglu_limit`` (DeepSeek-V4's, 10) clamps the activation's inputs:
    ``silu(min(gate, limit)) * clamp(up, -limit, limit)``; None is plain SwiGLU.

    A backend runs only the formats its record declares (``required_capabilities``); its
    ``prepare`` refuses the rest (``refuse_unsupported``) rather than compute something else.
    """

    w13: torch.Tensor
    w2: torch.Tensor
    num_experts: int
    first_expert: int = 0
    w13_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None
    block_shape: tuple[int, int] | None = None
    swiglu_limit: float | None = None
    fp4: bool = False

    @property
    def local_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.w13.shape[2] * (2 if self.fp4 else 1)

    @property
    def intermediate_size(self) -> int:
        return self.w13.shape[1] // 2

    @property
    def required_capabilities(self) -> frozenset[str]:
        """The MoE capability tags a backend must declare to run these experts."""
        needs = {"fp8-block"} if self.block_shape is not None else set()
        if self.fp4:
            needs.add("fp4")
        if self.swiglu_limit is not None:
            needs.add("swiglu-limit")
        return frozenset(needs)

    def refuse_unsupported(self, backend: str, capabilities: Collection[str]) -> None:
        """For a backend's ``prepare``: raise ValueError if these experts need a capability the
        backend lacks (running them anyway would silently compute a different model)."""
        missing = sorted(self.required_capabilities - set(capabilities))
        if missing:
            what = {
                "fp8-block": f"FP8 weights with {self.block_shape} block scales",
                "fp4": "packed FP4 weights",
                "swiglu-limit": f"a SwiGLU clamped at swiglu_limit = {self.swiglu_limit} (DeepSeek-V4)",
            }
            raise ValueError(
                f"{backend} MoE cannot run these experts: they have {'; '.join(what[tag] for tag in missing)}. "
                f"Choose a MoE backend that declares {', '.join(repr(tag) for tag in missing)} "
                '(e.g. components.moe = "torch-grouped")'
            )

    def check(self) -> None:
        """Raise ValueError unless these are consistent (float, FP8 block-scaled or FP4) experts;
        every MoE backend's ``prepare`` calls it."""
        w13, w2 = self.w13, self.w2
        if w13.dim() != 3 or w2.dim() != 3 or w13.shape[1] % 2:
            raise ValueError(
                "ExpertWeights: w13 must be [experts, 2 * intermediate, hidden] and w2 [experts, hidden, "
                f"intermediate], got {tuple(w13.shape)} and {tuple(w2.shape)}"
            )
        local, hidden, intermediate = w13.shape[0], w13.shape[2], w13.shape[1] // 2
        want2 = (local, 2 * hidden, intermediate // 2) if self.fp4 else (local, hidden, intermediate)
        if tuple(w2.shape) != want2:
            packed = "packed FP4 " if self.fp4 else ""
            raise ValueError(
                f"ExpertWeights: {packed}w13 {tuple(w13.shape)} implies w2 of shape {want2}, got {tuple(w2.shape)}"
            )
        if self.first_expert < 0 or self.first_expert + local > self.num_experts:
            raise ValueError(
                f"ExpertWeights: experts {self.first_expert}..{self.first_expert + local - 1} "
                f"are not a slice of the {self.num_experts} experts"
            )
        limit = self.swiglu_limit
        if limit is not None and (
            not (_is_int(limit) or isinstance(limit, float)) or not math.isfinite(limit) or limit <= 0
        ):
            raise ValueError(f"ExpertWeights: swiglu_limit must be a positive number (or None), got {limit!r}")
        if self.fp4:
            self._check_fp4()
            return
        fp8 = torch.float8_e4m3fn
        scales = (self.w13_scale, self.w2_scale, self.block_shape)
        if all(s is None for s in scales):
            if not (w13.is_floating_point() and w2.is_floating_point()) or fp8 in (w13.dtype, w2.dtype):
                raise ValueError(
                    f"ExpertWeights: {w13.dtype}/{w2.dtype} weights need w13_scale, w2_scale and block_shape"
                )
            return
        if any(s is None for s in scales):
            raise ValueError("ExpertWeights: FP8 experts need all of w13_scale, w2_scale and block_shape")
        if w13.dtype != fp8 or w2.dtype != fp8:
            raise ValueError(f"ExpertWeights: block scales come with {fp8} weights, got {w13.dtype}/{w2.dtype}")
        rows_per_block, cols_per_block = self.block_shape
        for label, weight, scale in (("w13", w13, self.w13_scale), ("w2", w2, self.w2_scale)):
            want = (local, -(-weight.shape[1] // rows_per_block), -(-weight.shape[2] // cols_per_block))
            if tuple(scale.shape) != want:
                raise ValueError(
                    f"ExpertWeights: {label} {tuple(weight.shape)} in {rows_per_block}x{cols_per_block} blocks "
                    f"needs {label}_scale of shape {want}, got {tuple(scale.shape)}"
                )

    def _check_fp4(self) -> None:
        if self.block_shape is not None:
            raise ValueError("ExpertWeights: FP4 experts take no block_shape (their scales are per 32 columns)")
        for label, weight, scale in (("w13", self.w13, self.w13_scale), ("w2", self.w2, self.w2_scale)):
            if weight.dtype != torch.uint8:
                raise ValueError(f"ExpertWeights: FP4 {label} must be uint8 packed codes, got {weight.dtype}")
            columns = 2 * weight.shape[2]
            want = (*weight.shape[:2], columns // 32)
            if scale is None or columns % 32 or tuple(scale.shape) != want or scale.dtype != torch.float8_e8m0fnu:
                got = None if scale is None else f"{scale.dtype} {tuple(scale.shape)}"
                raise ValueError(
                    f"ExpertWeights: FP4 {label} {tuple(weight.shape)} holds {columns} columns and needs "
                    f"{label}_scale float8_e8m0fnu {want} (one per 32 columns), got {got}"
                )


@attrs.frozen(kw_only=True)
class MoEBackendContext:
    platform: PlatformInfo
    device: torch.device
    dtype: torch.dtype


@runtime_checkable
class MoEBackend(Protocol[Prepared]):
    """The expert computation of a MoE layer; routing stays in the core.

    ``prepare`` runs once per layer at load and may re-lay the weights out as the
    kernel wants them (e.g. ``[E, K, N]`` for ``npu_grouped_matmul``); ``forward``
    receives its result. Token sorting/grouping by expert is the backend's business.
    """

    name: str

    def prepare(self, weights: ExpertWeights) -> Prepared: ...

    def forward(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden]
        topk_ids: torch.Tensor,  # int32 [num_tokens, top_k], global expert ids
        topk_weights: torch.Tensor,  # float32 [num_tokens, top_k], already scaled
        weights: Prepared,  # what prepare returned
    ) -> torch.Tensor:
        """sum_k topk_weights[t,k] * expert_{topk_ids[t,k]}(hidden[t]) over local experts.

        Ids outside this rank's experts contribute nothing (expert parallelism sums
        partial outputs across ranks).
        """
        ...

    def forward_grouped(
        self,
        hidden: torch.Tensor,  # [rows, hidden], rows grouped by local expert
        tokens_per_expert: torch.Tensor,  # int64 [local_experts], rows of each group
        weights: Prepared,  # what prepare returned
        scales: torch.Tensor | None = None,  # per-row dynamic quant scales, if dispatch quantised
    ) -> torch.Tensor:
        """Each group of rows through its expert, unweighted: ``[rows, hidden]``.

        The expert-parallel path: an ExpertDispatcher has already grouped the rows
        (``npu_moe_distribute_dispatch``'s expand_x / expert_token_nums feed
        ``npu_grouped_matmul``'s group_list), and ``combine`` applies the weights.
        """
        ...


@runtime_checkable
class MoERouter(Protocol):
    """A MoE backend that also routes, with a fused gating op (capability
    ``fused-routing``; e.g. Ascend's ``npu_moe_gating_top_k``).

    Routing rules stay the core's: ``route`` must choose what
    ``powertrain.layers.moe.route`` chooses for the same logits (ids in any order
    within a token, the same weight per id). ``routing_support`` is asked once per
    layer at build, with the layer's ``RoutingConfig``; a config the op cannot
    express is answered ``Availability.no(why)`` and that layer routes in the core.
    """

    def routing_support(self, config: RoutingConfig) -> Availability: ...

    def route(
        self,
        router_logits: torch.Tensor,  # float32 [num_tokens, num_experts]
        config: RoutingConfig,
        correction_bias: torch.Tensor | None,  # float32 [num_experts] (noaux_tc)
    ) -> tuple[torch.Tensor, torch.Tensor]:  # int32 ids, float32 weights: [num_tokens, top_k] each
        ...


def dequantize_row_groups(rows: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Quantised activation rows times their scales (one per row, or one per equal
    column group, as an FP8 dispatch sends them), in float32.

    The meaning of ``forward_grouped``'s ``scales``: a backend that does not multiply
    quantised rows itself dequantizes them with this first.
    """
    count, width = rows.shape
    per_group = scales.float().reshape(count, -1)
    groups = per_group.shape[1]
    if groups and width % groups:
        raise ValueError(f"scales of shape {tuple(scales.shape)} do not split {width} columns into equal groups")
    if count == 0:
        return rows.float()
    return (rows.float().view(count, groups, width // groups) * per_group.unsqueeze(-1)).view(count, width)

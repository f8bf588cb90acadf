"""Which routing configs go to npu_moe_gating_top_k, with which arguments, and why the others stay in the core.

The decisive check is numerical: for every config the mapping accepts, the op's
documented computation (the stand-in) must choose exactly what the core's
``layers.moe.route`` chooses; for refused configs, the op with the nearest
arguments really would choose or weigh differently.
"""

from __future__ import annotations

import pytest
import torch

from powertrain.interfaces.moe import RoutingConfig
from powertrain.layers.moe import route
from powertrain.testing.base import fresh_seed, generator
from powertrain_cann_ascend import gating
from powertrain_cann_ascend.testing.standins import MoEOpsStandIn

DEEPSEEK_V3 = RoutingConfig(
    num_experts=256, top_k=8, scoring="sigmoid", topk_method="noaux_tc", n_group=8, topk_group=4,
    norm_topk_prob=True, routed_scaling_factor=2.5,
)  # fmt: skip
DEEPSEEK_V2 = RoutingConfig(
    num_experts=160, top_k=6, scoring="softmax", topk_method="group_limited_greedy", n_group=8, topk_group=3,
    routed_scaling_factor=16.0,
)  # fmt: skip
DEEPSEEK_V2_LITE = RoutingConfig(num_experts=64, top_k=6, scoring="softmax", topk_method="greedy")
KIMI_K2 = RoutingConfig(
    num_experts=384, top_k=8, scoring="sigmoid", topk_method="noaux_tc", n_group=1, topk_group=1,
    norm_topk_prob=True, routed_scaling_factor=2.827,
)  # fmt: skip
V3_ALL_GROUPS = RoutingConfig(
    num_experts=256, top_k=8, scoring="sigmoid", topk_method="noaux_tc", n_group=8, topk_group=8,
    norm_topk_prob=True, routed_scaling_factor=2.5,
)  # fmt: skip
SIGMOID_GROUP_MAX = RoutingConfig(
    num_experts=64, top_k=4, scoring="sigmoid", topk_method="group_limited_greedy", n_group=8, topk_group=2,
    norm_topk_prob=True,
)  # fmt: skip

ACCEPTED = {
    "deepseek-v3": DEEPSEEK_V3,
    "deepseek-v2": DEEPSEEK_V2,
    "deepseek-v2-lite": DEEPSEEK_V2_LITE,
    "kimi-k2": KIMI_K2,
    "v3-all-groups-kept": V3_ALL_GROUPS,
    "sigmoid-group-max": SIGMOID_GROUP_MAX,
}

#: name -> (config, a phrase the refusal must contain)
REFUSED = {
    "softmax-renormalised": (
        RoutingConfig(num_experts=64, top_k=6, scoring="softmax", topk_method="greedy", norm_topk_prob=True),
        "renorm=1",
    ),
    "sigmoid-unnormalised": (
        RoutingConfig(num_experts=64, top_k=6, scoring="sigmoid", topk_method="greedy", norm_topk_prob=False),
        "always renormalises sigmoid",
    ),
    "too-many-experts": (
        RoutingConfig(num_experts=4096, top_k=8, scoring="sigmoid", topk_method="greedy", norm_topk_prob=True),
        "at most 2048 experts",
    ),
    "two-experts-per-group": (
        RoutingConfig(
            num_experts=16,
            top_k=2,
            scoring="sigmoid",
            topk_method="noaux_tc",
            n_group=8,
            topk_group=2,
            norm_topk_prob=True,
        ),  # fmt: skip
        "more than 2 experts per group",
    ),
    "padded-groups-too-wide": (
        RoutingConfig(
            num_experts=1700,
            top_k=8,
            scoring="sigmoid",
            topk_method="noaux_tc",
            n_group=34,
            topk_group=4,
            norm_topk_prob=True,
        ),  # fmt: skip
        "2176",
    ),
    "two-experts-in-all": (
        RoutingConfig(num_experts=2, top_k=1, scoring="softmax", topk_method="greedy"),
        "more than 2 experts per group",
    ),
}


def test_deepseek_v3_arguments() -> None:
    args = gating.gating_args(DEEPSEEK_V3)
    assert args == gating.GatingArgs(
        k=8, k_group=4, group_count=8, group_select_mode=1, renorm=0, norm_type=1, out_flag=False,
        routed_scaling_factor=2.5, eps=1e-20,
    )  # fmt: skip


def test_deepseek_v2_scores_groups_by_their_best_expert() -> None:
    args = gating.gating_args(DEEPSEEK_V2)
    assert (args.norm_type, args.group_select_mode, args.group_count, args.k_group) == (0, 0, 8, 3)
    assert (args.renorm, args.routed_scaling_factor) == (0, 16.0)


def test_configs_whose_groups_exclude_nothing_are_plain_top_k() -> None:
    for config in (DEEPSEEK_V2_LITE, KIMI_K2, V3_ALL_GROUPS):
        args = gating.gating_args(config)
        assert (args.group_count, args.k_group) == (1, 1)


@pytest.mark.parametrize("name", list(ACCEPTED))
def test_accepted(name: str) -> None:
    support = gating.routing_support(ACCEPTED[name])
    assert support.available, support.reason
    assert "npu_moe_gating_top_k(" in support.reason


@pytest.mark.parametrize("name", list(REFUSED))
def test_refused_with_reason(name: str) -> None:
    config, phrase = REFUSED[name]
    support = gating.routing_support(config)
    assert not support.available
    assert phrase in support.reason and "routes in the core" in support.reason, support.reason


def test_torch_npu_7_0_serves_only_deepseek_v3() -> None:
    limits = gating.DEEPSEEK_V3_ONLY
    assert gating.routing_support(DEEPSEEK_V3, limits).available
    reasons = {
        name: gating.routing_support(config, limits).reason
        for name, config in ACCEPTED.items()
        if name != "deepseek-v3"
    }
    assert "only sigmoid" in reasons["deepseek-v2"]
    assert "only sigmoid" in reasons["deepseek-v2-lite"]
    assert "exactly 256 experts" in reasons["kimi-k2"]
    assert "group_count=8 with k_group=4" in reasons["v3-all-groups-kept"]
    assert "top-2" in reasons["sigmoid-group-max"]
    assert all(not gating.routing_support(c, limits).available for c in ACCEPTED.values() if c is not DEEPSEEK_V3)


def test_not_a_routing_config() -> None:
    support = gating.routing_support({"n_routed_experts": 8})
    assert not support.available and "RoutingConfig" in support.reason


def _op_route(config: RoutingConfig, logits: torch.Tensor, bias: torch.Tensor | None, **override):
    args = gating.gating_args(config).kwargs() | override
    weights, ids, _ = MoEOpsStandIn().npu_moe_gating_top_k(logits, config.top_k, bias=bias, **args)
    return ids, weights


def _sorted(ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = ids.long().sort(dim=1)
    return order.values, weights.float().gather(1, order.indices)


@pytest.mark.parametrize("name", list(ACCEPTED))
def test_op_chooses_what_the_core_chooses(name: str) -> None:
    """The op's documented computation with the mapped arguments equals layers.moe.route."""
    config = ACCEPTED[name]
    seed = fresh_seed()
    gen = generator(seed)
    logits = 2 * torch.randn(64, config.num_experts, generator=gen)
    bias = 0.3 * torch.randn(config.num_experts, generator=gen) if config.uses_correction_bias else None
    got_ids, got_weights = _sorted(*_op_route(config, logits, bias))
    want_ids, want_weights = _sorted(*route(logits, config, bias))
    assert torch.equal(got_ids, want_ids), f"{name}: different experts (seed={seed})"
    torch.testing.assert_close(got_weights, want_weights, atol=1e-5, rtol=1e-5)


def test_refusals_are_real_differences() -> None:
    """The nearest arguments the op allows would weigh differently from the core."""
    gen = generator(fresh_seed())
    logits = 2 * torch.randn(16, 64, generator=gen)
    for name in ("softmax-renormalised", "sigmoid-unnormalised"):
        config, _ = REFUSED[name]
        got_ids, got_weights = _sorted(*_op_route(config, logits, None))
        want_ids, want_weights = _sorted(*route(logits, config))
        assert torch.equal(got_ids, want_ids)  # the choice agrees ...
        assert not torch.allclose(got_weights, want_weights, atol=1e-3)  # ... the weights do not


def test_group_max_and_top2_sum_choose_differently() -> None:
    """V2's group score is not V3's: scored by the other rule, some tokens change experts."""
    gen = generator(fresh_seed())
    logits = 2 * torch.randn(256, DEEPSEEK_V2.num_experts, generator=gen)
    got_ids, _ = _sorted(*_op_route(DEEPSEEK_V2, logits, None, group_select_mode=gating.GROUP_TOP2_SUM))
    want_ids, _ = _sorted(*route(logits, DEEPSEEK_V2))
    assert not torch.equal(got_ids, want_ids)

"""DeepSeek MoE routing and layer (``layers/moe.py``) and the builtin ``torch-grouped`` backend.

Oracles: transformers' DeepSeek-V3 and V2 routers and V3 experts on the same random
weights, and the conformance kit's float64 per-token reference.
"""

from __future__ import annotations

from typing import Any, ClassVar

import attrs
import pytest
import torch
from transformers import DeepseekV2Config, DeepseekV3Config
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Experts, DeepseekV3TopkRouter

from powertrain.builtin.grouped_moe import TorchGroupedMoE
from powertrain.interfaces import ExpertWeights
from powertrain.interfaces.moe import RoutingConfig
from powertrain.layers.moe import MoE, route
from powertrain.loader.fp4 import dequantize_fp4
from powertrain.loader.fp8 import FP8_DTYPE, dequantize_blocks, quantize_blocks
from powertrain.testing import MoEBackendSuite, fresh_seed
from powertrain.testing.checkpoints import quantize_fp4
from powertrain.testing.moe import reference_moe, row_errors


@pytest.fixture
def seed(request: pytest.FixtureRequest) -> int:
    """A fresh seed per test (never a fixed one), reported with a failure."""
    value = fresh_seed()
    request.node.user_properties.append(("seed", value))
    return value


class TestTorchGrouped(MoEBackendSuite):
    component = "torch-grouped"
    # torch-grouped dequantizes FP8 weights and keeps activations in the input dtype,
    # so its FP8 error is its float error (plus one rounding of the dequantized
    # weights to half precision): hold it to the float limits, far below the kit's
    # FP8 default, which allows FP8 activations.
    fp8_tolerances: ClassVar = MoEBackendSuite.tolerances
    # FP4 weights dequantize exactly (e2m1 times a power of two): the float limits again.
    fp4_tolerances: ClassVar = MoEBackendSuite.tolerances


class TestTorchGroupedInvariant(TestTorchGrouped):
    """The tiled variant: the whole kit again (its padding and tiling must not change any
    result beyond float rounding), and its declared batch invariance."""

    component = "torch-grouped-invariant"


def test_tiled_linear_gives_a_row_the_same_bits_in_any_row_count(seed: int) -> None:
    """What torch-grouped-invariant rests on; and tiling changes nothing but rounding."""
    from powertrain.builtin.grouped_moe import tiled_linear

    gen = torch.Generator().manual_seed(seed)
    weight, rows = torch.randn(96, 64, generator=gen), torch.randn(37, 64, generator=gen)
    together = tiled_linear(rows, weight, 16)
    for count in (1, 2, 5, 16, 17):
        assert torch.equal(tiled_linear(rows[:count], weight, 16), together[:count]), f"{count} rows (seed={seed})"
    torch.testing.assert_close(together, rows @ weight.T, rtol=1e-5, atol=1e-5)


def same_routing(
    ids: torch.Tensor, weights: torch.Tensor, want_ids: torch.Tensor, want_weights: torch.Tensor, atol: float = 1e-6
) -> None:
    """Equal expert sets per token, and equal weights for each expert (slot order is free)."""
    order, want_order = ids.long().argsort(dim=1), want_ids.long().argsort(dim=1)
    assert torch.equal(ids.long().gather(1, order), want_ids.long().gather(1, want_order))
    torch.testing.assert_close(weights.gather(1, order), want_weights.float().gather(1, want_order), atol=atol, rtol=0)


# --------------------------------------------------------------------------- routing against transformers


V3_SHAPES = [
    # (experts, top_k, n_group, topk_group)
    (16, 4, 4, 2),
    (32, 6, 8, 3),
    (64, 8, 8, 4),  # DeepSeek-V3's 8-of-8-groups-keep-4 shape, with fewer experts
    (8, 2, 1, 1),  # one group: grouping selects nothing away
    (24, 3, 4, 4),  # every group kept
]


@pytest.mark.parametrize(("num_experts", "top_k", "n_group", "topk_group"), V3_SHAPES, ids=str)
@pytest.mark.parametrize("norm_topk_prob", [True, False], ids=["norm", "no-norm"])
@pytest.mark.parametrize("scaling", [1.0, 2.5])
def test_route_matches_transformers_v3_router(
    num_experts: int, top_k: int, n_group: int, topk_group: int, norm_topk_prob: bool, scaling: float, seed: int
) -> None:
    config = DeepseekV3Config(
        hidden_size=64,
        n_routed_experts=num_experts,
        num_experts_per_tok=top_k,
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=norm_topk_prob,
        routed_scaling_factor=scaling,
    )
    gen = torch.Generator().manual_seed(seed)
    router = DeepseekV3TopkRouter(config)
    with torch.no_grad():
        router.weight.copy_(torch.randn(num_experts, 64, generator=gen) / 8)
        # Of the size of the sigmoid scores, so the bias really changes choices.
        router.e_score_correction_bias.copy_(0.3 * torch.randn(num_experts, generator=gen))
        logits, want_weights, want_ids = router(torch.randn(97, 64, generator=gen))

    routing = RoutingConfig.from_config(config.to_dict())
    ids, weights = route(logits, routing, router.e_score_correction_bias)

    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert ids.shape == weights.shape == (97, top_k)
    same_routing(ids, weights, want_ids, want_weights)
    unbiased, _ = route(logits, routing, torch.zeros(num_experts))
    changed = (unbiased.sort(dim=1).values != ids.sort(dim=1).values).any(dim=1).sum()
    assert changed > 0, "the correction bias changed no token's experts; the test would not see it ignored"


@pytest.mark.parametrize(
    ("topk_method", "n_group", "topk_group"),
    [("greedy", None, None), ("greedy", 1, 1), ("group_limited_greedy", 8, 3), ("group_limited_greedy", 4, 1)],
    ids=["greedy", "greedy-one-group", "group-limited-8-3", "group-limited-4-1"],
)
@pytest.mark.parametrize("scaling", [1.0, 16.0])
def test_route_matches_transformers_v2_gate(
    topk_method: str, n_group: int | None, topk_group: int | None, scaling: float, seed: int
) -> None:
    # transformers' V2 gate never normalises (it ignores norm_topk_prob), which is what
    # the published V2 checkpoints ask for: norm_topk_prob false.
    config = DeepseekV2Config(
        hidden_size=64,
        num_attention_heads=8,
        n_routed_experts=32,
        num_experts_per_tok=6,
        topk_method=topk_method,
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=False,
        routed_scaling_factor=scaling,
    )
    gen = torch.Generator().manual_seed(seed)
    router = DeepseekV2TopkRouter(config)
    with torch.no_grad():
        router.weight.copy_(torch.randn(32, 64, generator=gen) / 4)
        logits, want_weights, want_ids = router(torch.randn(83, 64, generator=gen))

    routing = RoutingConfig.from_config(config.to_dict())
    assert routing.scoring == "softmax" and routing.topk_method == topk_method
    ids, weights = route(logits, routing)
    same_routing(ids, weights, want_ids, want_weights)


def test_group_limited_routing_stays_inside_the_kept_groups(seed: int) -> None:
    """Against transformers' rule restated: every chosen expert lies in one of the
    topk_group groups with the best per-group maximum (V2) score."""
    routing = RoutingConfig(
        num_experts=32, top_k=6, scoring="softmax", topk_method="group_limited_greedy", n_group=8, topk_group=2
    )
    logits = torch.randn(200, 32, generator=torch.Generator().manual_seed(seed))
    ids, _ = route(logits, routing)
    best_groups = logits.softmax(-1).view(200, 8, 4).amax(-1).topk(2, dim=-1).indices
    chosen_groups = ids.long() // 4
    assert (chosen_groups.unsqueeze(-1) == best_groups.unsqueeze(1)).any(-1).all()


def test_norm_topk_prob_makes_weights_sum_to_the_scaling_factor(seed: int) -> None:
    logits = torch.randn(50, 16, generator=torch.Generator().manual_seed(seed))
    for scoring in ("softmax", "sigmoid"):
        routing = RoutingConfig(
            num_experts=16,
            top_k=4,
            scoring=scoring,
            topk_method="greedy",
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
        )
        ids, weights = route(logits, routing)
        torch.testing.assert_close(weights.sum(-1), torch.full((50,), 2.5))
        scores = logits.softmax(-1) if scoring == "softmax" else logits.sigmoid()
        # Still the chosen experts' scores, only rescaled: ratios are kept.
        chosen = scores.gather(1, ids.long())
        torch.testing.assert_close(weights / weights[:, :1], chosen / chosen[:, :1])


def test_route_refuses_a_missing_or_unexpected_bias() -> None:
    v3 = RoutingConfig(num_experts=8, top_k=2, scoring="sigmoid", topk_method="noaux_tc", n_group=2, topk_group=1)
    greedy = RoutingConfig(num_experts=8, top_k=2, scoring="softmax", topk_method="greedy")
    logits = torch.randn(3, 8)
    with pytest.raises(ValueError, match="noaux_tc.*needs e_score_correction_bias"):
        route(logits, v3, None)
    with pytest.raises(ValueError, match="greedy.*takes no e_score_correction_bias"):
        route(logits, greedy, torch.zeros(8))
    with pytest.raises(ValueError, match=r"router_logits must be \[num_tokens, 8\]"):
        route(torch.randn(3, 9), greedy)


def test_route_takes_an_empty_batch() -> None:
    routing = RoutingConfig(num_experts=8, top_k=2, scoring="sigmoid", topk_method="noaux_tc", n_group=4, topk_group=2)
    ids, weights = route(torch.empty(0, 8), routing, torch.zeros(8))
    assert ids.shape == weights.shape == (0, 2)


# --------------------------------------------------------------------------- RoutingConfig.from_config


def test_from_config_reads_transformers_defaults() -> None:
    v3 = RoutingConfig.from_config(DeepseekV3Config().to_dict())
    assert v3 == RoutingConfig(
        num_experts=256,
        top_k=8,
        scoring="sigmoid",
        topk_method="noaux_tc",
        n_group=8,
        topk_group=4,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
    )
    v2 = RoutingConfig.from_config(DeepseekV2Config(num_experts_per_tok=6).to_dict())
    assert v2 == RoutingConfig(
        num_experts=64,
        top_k=6,
        scoring="softmax",
        topk_method="greedy",
        n_group=1,
        topk_group=1,
        norm_topk_prob=False,
        routed_scaling_factor=1.0,
    )


def test_from_config_needs_top_k_where_transformers_has_no_default() -> None:
    # DeepseekV2Config's num_experts_per_tok defaults to None: no routing is possible.
    with pytest.raises(ValueError, match="lacks 'num_experts_per_tok'"):
        RoutingConfig.from_config(DeepseekV2Config().to_dict())


# The routing keys of the published checkpoints' config.json files.
DEEPSEEK_V3_JSON = {
    "model_type": "deepseek_v3",
    "n_routed_experts": 256,
    "num_experts_per_tok": 8,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "n_group": 8,
    "topk_group": 4,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
}
DEEPSEEK_V2_JSON = {
    "model_type": "deepseek_v2",
    "n_routed_experts": 160,
    "num_experts_per_tok": 6,
    "scoring_func": "softmax",
    "topk_method": "group_limited_greedy",
    "n_group": 8,
    "topk_group": 3,
    "norm_topk_prob": False,
    "routed_scaling_factor": 16.0,
}
DEEPSEEK_V2_LITE_JSON = {
    "model_type": "deepseek_v2",
    "n_routed_experts": 64,
    "num_experts_per_tok": 6,
    "scoring_func": "softmax",
    "topk_method": "greedy",
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": False,
    "routed_scaling_factor": 1.0,
}


@pytest.mark.parametrize(
    "config", [DEEPSEEK_V3_JSON, DEEPSEEK_V2_JSON, DEEPSEEK_V2_LITE_JSON], ids=["v3", "v2", "v2-lite"]
)
def test_from_config_reads_published_checkpoint_configs(config: dict[str, Any]) -> None:
    routing = RoutingConfig.from_config(config)
    assert (routing.num_experts, routing.top_k) == (config["n_routed_experts"], config["num_experts_per_tok"])
    assert (routing.scoring, routing.topk_method) == (config["scoring_func"], config["topk_method"])
    assert (routing.n_group, routing.topk_group) == (config["n_group"], config["topk_group"])
    assert routing.norm_topk_prob is config["norm_topk_prob"]
    assert routing.routed_scaling_factor == config["routed_scaling_factor"]


@pytest.mark.parametrize(
    ("changes", "key"),
    [
        ({"topk_method": "sparse"}, "topk_method"),
        ({"scoring_func": "relu"}, "scoring_func"),
        ({"n_routed_experts": 0}, "n_routed_experts"),
        ({"n_routed_experts": "256"}, "n_routed_experts"),
        ({"num_experts_per_tok": 300}, "num_experts_per_tok"),
        ({"num_experts_per_tok": 129}, "num_experts_per_tok"),  # more than 4 kept groups of 32 hold
        ({"n_group": 7}, "n_group"),
        ({"topk_group": 9}, "topk_group"),
        ({"norm_topk_prob": "yes"}, "norm_topk_prob"),
        ({"routed_scaling_factor": -1.0}, "routed_scaling_factor"),
        ({"routed_scaling_factor": float("nan")}, "routed_scaling_factor"),
        ({"n_group": 256, "topk_group": 128}, "n_group"),  # noaux_tc needs two experts per group
    ],
)
def test_bad_routing_values_name_their_key(changes: dict[str, Any], key: str) -> None:
    with pytest.raises(ValueError, match=rf"MoE routing: {key} = "):
        RoutingConfig.from_config({**DEEPSEEK_V3_JSON, **changes})


def test_from_config_refuses_unknown_model_types() -> None:
    with pytest.raises(ValueError, match="model_type = 'mixtral'"):
        RoutingConfig.from_config({**DEEPSEEK_V3_JSON, "model_type": "mixtral"})
    with pytest.raises(ValueError, match="lacks 'n_group'"):
        RoutingConfig.from_config(
            {"model_type": "deepseek_v2", "num_experts_per_tok": 6, "topk_method": "group_limited_greedy"}
        )


# --------------------------------------------------------------------------- the MoE layer


HIDDEN, INTERMEDIATE = 64, 32


def _v3_config(num_experts: int = 16) -> DeepseekV3Config:
    return DeepseekV3Config(
        hidden_size=HIDDEN,
        moe_intermediate_size=INTERMEDIATE,
        n_routed_experts=num_experts,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
    )


def _hf_moe(config: DeepseekV3Config, seed: int) -> tuple[DeepseekV3TopkRouter, DeepseekV3Experts]:
    """transformers' router and experts with random weights of unit-variance matmuls."""
    gen = torch.Generator().manual_seed(seed)
    router, experts = DeepseekV3TopkRouter(config), DeepseekV3Experts(config)
    experts_count = config.n_routed_experts
    with torch.no_grad():
        router.weight.copy_(torch.randn(experts_count, HIDDEN, generator=gen) / 8)
        router.e_score_correction_bias.copy_(0.3 * torch.randn(experts_count, generator=gen))
        experts.gate_up_proj.copy_(torch.randn(experts_count, 2 * INTERMEDIATE, HIDDEN, generator=gen) / HIDDEN**0.5)
        experts.down_proj.copy_(torch.randn(experts_count, HIDDEN, INTERMEDIATE, generator=gen) / INTERMEDIATE**0.5)
    return router, experts


def _layer(config: DeepseekV3Config, dtype: torch.dtype = torch.float32, **slice_: int) -> MoE:
    routing = RoutingConfig.from_config(config.to_dict())
    return MoE(routing, HIDDEN, INTERMEDIATE, TorchGroupedMoE(dtype), dtype, "cpu", **slice_)


def _fused_names(router: DeepseekV3TopkRouter, experts: DeepseekV3Experts) -> dict[str, torch.Tensor]:
    return {
        "gate.weight": router.weight.detach(),
        "gate.e_score_correction_bias": router.e_score_correction_bias,
        "experts.gate_up_proj": experts.gate_up_proj.detach(),
        "experts.down_proj": experts.down_proj.detach(),
    }


def _per_expert_names(router: DeepseekV3TopkRouter, experts: DeepseekV3Experts) -> dict[str, torch.Tensor]:
    """The same weights named as DeepSeek's checkpoints name them."""
    names = {"gate.weight": router.weight.detach(), "gate.e_score_correction_bias": router.e_score_correction_bias}
    for e in range(experts.gate_up_proj.shape[0]):
        gate, up = experts.gate_up_proj[e].detach().split(INTERMEDIATE)
        names[f"experts.{e}.gate_proj.weight"] = gate
        names[f"experts.{e}.up_proj.weight"] = up
        names[f"experts.{e}.down_proj.weight"] = experts.down_proj[e].detach()
    return names


def _loaded(layer: MoE, names: dict[str, torch.Tensor]) -> MoE:
    for name, tensor in names.items():
        assert layer.load_weight(name, tensor), name
    layer.finish_loading()
    return layer


def test_layer_matches_transformers_routed_experts(seed: int) -> None:
    """Router + experts of transformers' DeepseekV3MoE (without its shared experts)."""
    config = _v3_config()
    router, experts = _hf_moe(config, seed)
    hidden = torch.randn(45, HIDDEN, generator=torch.Generator().manual_seed(seed + 1))
    with torch.no_grad():
        _, weights, ids = router(hidden)
        want = experts(hidden, ids, weights)

    fused = _loaded(_layer(config), _fused_names(router, experts))
    per_expert = _loaded(_layer(config), _per_expert_names(router, experts))
    got = fused(hidden)

    assert got.dtype == torch.float32 and got.shape == hidden.shape
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(per_expert(hidden), got), "per-expert and fused checkpoint names load different experts"


def test_layer_in_bfloat16_stays_close_to_float32(seed: int) -> None:
    """A bfloat16 model routes exactly as float32 (the router stays float32) and its
    expert outputs agree to bfloat16 precision."""
    config = _v3_config()
    router, experts = _hf_moe(config, seed)
    names = _fused_names(router, experts)
    hidden = torch.randn(30, HIDDEN, generator=torch.Generator().manual_seed(seed + 1)).bfloat16()
    exact = _loaded(_layer(config), names)(hidden.float())
    half = _loaded(_layer(config, torch.bfloat16), names)
    assert half.gate_weight.dtype == torch.float32, "the router must stay float32 in a bfloat16 model"
    got = half(hidden)
    assert got.dtype == torch.bfloat16
    # The kit's bfloat16 limit (about 10 units of bfloat16 roundoff), against float32.
    assert float(row_errors(got.double(), exact.double()).max()) < MoEBackendSuite.tolerances[torch.bfloat16]


def test_expert_parallel_layers_sum_to_the_whole_layer(seed: int) -> None:
    """Four ranks holding a quarter of the experts each add up to the full layer."""
    config = _v3_config()
    router, experts = _hf_moe(config, seed)
    names = _per_expert_names(router, experts)
    hidden = torch.randn(33, HIDDEN, generator=torch.Generator().manual_seed(seed + 1))
    whole = _loaded(_layer(config), names)(hidden)
    ranks = [_loaded(_layer(config, first_expert=4 * r, local_experts=4), names) for r in range(4)]
    torch.testing.assert_close(sum(rank(hidden) for rank in ranks), whole, atol=1e-5, rtol=1e-5)
    fused_rank = _loaded(_layer(config, first_expert=8, local_experts=4), _fused_names(router, experts))
    assert torch.equal(fused_rank(hidden), ranks[2](hidden))


def test_missing_expert_weights_are_listed(seed: int) -> None:
    config = _v3_config()
    router, experts = _hf_moe(config, seed)
    layer = _layer(config)
    names = _per_expert_names(router, experts)
    for name in ("experts.3.up_proj.weight", "experts.11.down_proj.weight", "gate.e_score_correction_bias"):
        del names[name]
    for name, tensor in names.items():
        layer.load_weight(name, tensor)
    with pytest.raises(ValueError, match="never loaded") as error:
        layer.finish_loading()
    message = str(error.value)
    for name in ("mlp.experts.3.up_proj.weight", "mlp.experts.11.down_proj.weight", "mlp.gate.e_score_correction_bias"):
        assert name in message
    assert "experts.3.gate_proj" not in message
    with pytest.raises(RuntimeError, match="before finish_loading"):
        layer(torch.randn(2, HIDDEN))


@pytest.mark.parametrize(
    ("name", "shape", "want"),
    [
        ("gate.weight", (16, HIDDEN + 1), (16, HIDDEN)),
        ("gate.e_score_correction_bias", (15,), (16,)),
        ("experts.2.gate_proj.weight", (HIDDEN, INTERMEDIATE), (INTERMEDIATE, HIDDEN)),
        ("experts.2.down_proj.weight", (INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)),
        ("experts.gate_up_proj", (16, INTERMEDIATE, HIDDEN), (16, 2 * INTERMEDIATE, HIDDEN)),
        ("experts.down_proj", (8, HIDDEN, INTERMEDIATE), (16, HIDDEN, INTERMEDIATE)),
    ],
)
def test_wrong_shapes_name_the_tensor_and_both_shapes(name: str, shape: tuple[int, ...], want: tuple[int, ...]) -> None:
    layer = _layer(_v3_config())
    with pytest.raises(ValueError) as error:
        layer.load_weight(name, torch.randn(shape))
    assert str(error.value) == f"mlp.{name} has shape {shape}, but this layer's config needs {want}"


def test_load_weight_declines_other_tensors_and_refuses_bad_ones() -> None:
    layer = _layer(_v3_config())
    for foreign in ("shared_experts.gate_proj.weight", "experts.0.gate_proj.weight_scale_inv", "gate_proj.weight"):
        assert layer.load_weight(foreign, torch.randn(4)) is False
    with pytest.raises(ValueError, match="expert 16 does not exist; the config has 16"):
        layer.load_weight("experts.16.up_proj.weight", torch.randn(INTERMEDIATE, HIDDEN))
    with pytest.raises(ValueError, match="dequantize FP8"):
        layer.load_weight("experts.0.up_proj.weight", torch.randn(INTERMEDIATE, HIDDEN).to(FP8_DTYPE))
    greedy = RoutingConfig(num_experts=4, top_k=2, scoring="softmax", topk_method="greedy")
    layer = MoE(greedy, HIDDEN, INTERMEDIATE, TorchGroupedMoE(), torch.float32, "cpu")
    assert layer.e_score_correction_bias is None
    assert layer.load_weight("gate.e_score_correction_bias", torch.randn(4)) is False


def test_finish_loading_prepares_once_and_hands_the_experts_over(seed: int) -> None:
    config = _v3_config()
    router, experts = _hf_moe(config, seed)

    class Counting(TorchGroupedMoE):
        def __init__(self) -> None:
            super().__init__(torch.float32)
            self.prepared: list[ExpertWeights] = []

        def prepare(self, weights: ExpertWeights) -> ExpertWeights:
            self.prepared.append(weights)
            return super().prepare(weights)

    backend = Counting()
    layer = MoE(RoutingConfig.from_config(config.to_dict()), HIDDEN, INTERMEDIATE, backend, torch.float32, "cpu")
    _loaded(layer, _fused_names(router, experts))
    layer.finish_loading()
    [weights] = backend.prepared
    assert weights.num_experts == 16 and weights.first_expert == 0 and weights.local_experts == 16
    torch.testing.assert_close(weights.w13, experts.gate_up_proj.detach(), atol=0, rtol=0)
    with pytest.raises(RuntimeError, match="finished loading"):
        layer.load_weight("experts.0.up_proj.weight", torch.randn(INTERMEDIATE, HIDDEN))


def test_a_router_cast_to_half_precision_is_refused(seed: int) -> None:
    config = _v3_config()
    router, experts = _hf_moe(config, seed)
    layer = _layer(config).to(torch.bfloat16)  # what Module.to(dtype) on a whole model would do
    for name, tensor in _fused_names(router, experts).items():
        layer.load_weight(name, tensor)
    with pytest.raises(ValueError, match="router weight is torch.bfloat16, not float32"):
        layer.finish_loading()


# --------------------------------------------------------------------------- torch-grouped specifics


def _random_experts(gen: torch.Generator, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.randn(experts, 2 * INTERMEDIATE, HIDDEN, generator=gen) / HIDDEN**0.5,
        torch.randn(experts, HIDDEN, INTERMEDIATE, generator=gen) / INTERMEDIATE**0.5,
    )


def test_torch_grouped_sums_an_expert_repeated_within_a_token(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    w13, w2 = _random_experts(gen, 4)
    backend = TorchGroupedMoE(torch.float32)
    prepared = backend.prepare(ExpertWeights(w13=w13, w2=w2, num_experts=4))
    hidden = torch.randn(5, HIDDEN, generator=gen)
    ids = torch.tensor([[1, 1, 1], [0, 2, 0], [3, 3, 1], [2, 2, 2], [0, 1, 2]], dtype=torch.int32)
    weights = torch.rand(5, 3, generator=gen) + 0.1
    got = backend.forward(hidden, ids, weights, prepared)
    torch.testing.assert_close(got.double(), reference_moe(hidden, ids, weights, w13, w2), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("groups", [1, 4], ids=["per-row", "per-128-columns-like"])
def test_torch_grouped_dequantizes_dispatched_fp8_rows(groups: int, seed: int) -> None:
    """forward_grouped with FP8 rows and their dynamic scales (one per row or per column group)."""
    gen = torch.Generator().manual_seed(seed)
    w13, w2 = _random_experts(gen, 3)
    backend = TorchGroupedMoE(torch.float32)
    prepared = backend.prepare(ExpertWeights(w13=w13, w2=w2, num_experts=6, first_expert=3))
    counts = torch.tensor([4, 0, 5])
    rows = torch.randn(9, HIDDEN, generator=gen)
    scales = rows.view(9, groups, -1).abs().amax(-1) / 448.0
    quantized = (rows.view(9, groups, -1) / scales.unsqueeze(-1)).view(9, HIDDEN).to(FP8_DTYPE)
    dequantized = (quantized.float().view(9, groups, -1) * scales.unsqueeze(-1)).view(9, HIDDEN)
    got = backend.forward_grouped(quantized, counts, prepared, scales.squeeze(-1) if groups == 1 else scales)
    want = torch.cat(
        [
            reference_moe(dequantized[i : i + 1], torch.tensor([[e]]), torch.ones(1, 1), w13, w2, 3)
            for i, e in enumerate([3] * 4 + [5] * 5)
        ]
    )
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_torch_grouped_keeps_fp8_experts_fp8(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    w13, w2 = _random_experts(gen, 2)
    (q13, s13), (q2, s2) = quantize_blocks(w13, (32, 32)), quantize_blocks(w2, (32, 32))
    weights = ExpertWeights(w13=q13, w2=q2, num_experts=2, w13_scale=s13, w2_scale=s2, block_shape=(32, 32))
    prepared = TorchGroupedMoE().prepare(weights)
    assert prepared.w13.dtype == FP8_DTYPE and prepared.w2.dtype == FP8_DTYPE
    hidden = torch.randn(3, HIDDEN, generator=gen)
    ids, routing_weights = torch.tensor([[0], [1], [0]], dtype=torch.int32), torch.ones(3, 1)
    got = TorchGroupedMoE().forward(hidden, ids, routing_weights, prepared)
    want = reference_moe(
        hidden, ids, routing_weights, dequantize_blocks(q13, s13, (32, 32)), dequantize_blocks(q2, s2, (32, 32))
    )
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_torch_grouped_refuses_inconsistent_weights() -> None:
    backend = TorchGroupedMoE()
    w13, w2 = torch.randn(4, 2 * INTERMEDIATE, HIDDEN), torch.randn(4, HIDDEN, INTERMEDIATE)
    with pytest.raises(ValueError, match="implies w2 of shape"):
        backend.prepare(ExpertWeights(w13=w13, w2=w2.transpose(1, 2), num_experts=4))
    with pytest.raises(ValueError, match="experts 2..5 are not a slice of the 4 experts"):
        backend.prepare(ExpertWeights(w13=w13, w2=w2, num_experts=4, first_expert=2))
    (q13, s13), (q2, _) = quantize_blocks(w13, (32, 32)), quantize_blocks(w2, (32, 32))
    with pytest.raises(ValueError, match="need all of w13_scale, w2_scale and block_shape"):
        backend.prepare(ExpertWeights(w13=q13, w2=q2, num_experts=4, w13_scale=s13, block_shape=(32, 32)))
    with pytest.raises(ValueError, match="need w13_scale, w2_scale and block_shape"):
        backend.prepare(ExpertWeights(w13=q13, w2=q2, num_experts=4))
    with pytest.raises(ValueError, match="needs w2_scale of shape"):
        backend.prepare(ExpertWeights(w13=q13, w2=q2, num_experts=4, w13_scale=s13, w2_scale=s13, block_shape=(32, 32)))
    prepared = backend.prepare(ExpertWeights(w13=w13, w2=w2, num_experts=4))
    with pytest.raises(ValueError, match="one count per local expert"):
        backend.forward_grouped(torch.randn(5, HIDDEN), torch.tensor([2, 2, 0, 0]), prepared)


def test_torch_grouped_clamped_swiglu_matches_transformers_v4_experts(seed: int) -> None:
    """DeepSeek-V4's clamped SwiGLU against transformers' DeepseekV4Experts, on hidden states
    large enough that the clamp changes many gate/up values."""
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Experts

    print(f"seed={seed}")
    gen = torch.Generator().manual_seed(seed)
    limit = 2.0 + 8.0 * float(torch.rand(1, generator=gen))
    config = DeepseekV4Config(
        hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, moe_intermediate_size=INTERMEDIATE,
        n_routed_experts=8, num_local_experts=8, num_experts_per_tok=3, swiglu_limit=limit,
    )  # fmt: skip
    experts = DeepseekV4Experts(config)
    assert (experts.limit, experts.gate_up_proj.shape[1]) == (limit, 2 * INTERMEDIATE)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(8, 2 * INTERMEDIATE, HIDDEN, generator=gen) / HIDDEN**0.5)
        experts.down_proj.copy_(torch.randn(8, HIDDEN, INTERMEDIATE, generator=gen) / INTERMEDIATE**0.5)
    hidden = 1.5 * limit * torch.randn(37, HIDDEN, generator=gen)
    ids = torch.stack([torch.randperm(8, generator=gen)[:3] for _ in range(37)])
    weights = 0.1 + torch.rand(37, 3, generator=gen)
    with torch.no_grad():
        want = experts(hidden, ids, weights)
        w13, w2 = experts.gate_up_proj.detach(), experts.down_proj.detach()
    backend = TorchGroupedMoE(torch.float32)
    clamped = backend.prepare(ExpertWeights(w13=w13, w2=w2, num_experts=8, swiglu_limit=limit))
    plain = backend.prepare(ExpertWeights(w13=w13, w2=w2, num_experts=8))
    got = backend.forward(hidden, ids.to(torch.int32), weights, clamped)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
    assert (backend.forward(hidden, ids.to(torch.int32), weights, plain) - want).abs().max() > 0.1 * want.abs().max()


@pytest.mark.parametrize("limit", [0, -1.0, float("inf"), float("nan"), "10", True])
def test_a_swiglu_limit_must_be_a_positive_number(limit: object) -> None:
    w13, w2 = torch.randn(2, 2 * INTERMEDIATE, HIDDEN), torch.randn(2, HIDDEN, INTERMEDIATE)
    with pytest.raises(ValueError, match="swiglu_limit must be a positive number"):
        ExpertWeights(w13=w13, w2=w2, num_experts=2, swiglu_limit=limit).check()  # type: ignore[arg-type]


def test_the_layer_hands_its_swiglu_limit_to_the_backend(seed: int) -> None:
    config = _v3_config()
    router, experts = _hf_moe(config, seed)
    routing = RoutingConfig.from_config(config.to_dict())
    layer = MoE(routing, HIDDEN, INTERMEDIATE, TorchGroupedMoE(torch.float32), torch.float32, "cpu", swiglu_limit=0.5)
    _loaded(layer, _fused_names(router, experts))
    assert layer.prepared.swiglu_limit == 0.5 and "swiglu_limit=0.5" in repr(layer)
    plain = _loaded(_layer(config), _fused_names(router, experts))
    hidden = 4 * torch.randn(9, HIDDEN, generator=torch.Generator().manual_seed(seed))
    assert not torch.allclose(layer(hidden), plain(hidden), atol=1e-3)


def _fp4_experts(gen: torch.Generator, local: int, **fields: Any) -> ExpertWeights:
    w13, w2 = _random_experts(gen, local)
    (q13, s13), (q2, s2) = quantize_fp4(w13), quantize_fp4(w2)
    packed = dict(w13=q13.view(torch.uint8), w2=q2.view(torch.uint8), w13_scale=s13, w2_scale=s2, fp4=True)
    return ExpertWeights(num_experts=local, **{**packed, **fields})


def test_torch_grouped_keeps_fp4_experts_packed(seed: int) -> None:
    print(f"seed={seed}")
    gen = torch.Generator().manual_seed(seed)
    weights = _fp4_experts(gen, 3, swiglu_limit=1.0)
    assert weights.required_capabilities == {"fp4", "swiglu-limit"}
    assert (weights.hidden_size, weights.intermediate_size) == (HIDDEN, INTERMEDIATE)
    prepared = TorchGroupedMoE(torch.float32).prepare(weights)
    assert prepared.w13.dtype == torch.uint8 and prepared.w13.shape == (3, 2 * INTERMEDIATE, HIDDEN // 2)
    hidden = 3 * torch.randn(4, HIDDEN, generator=gen)
    ids, routing_weights = torch.tensor([[0, 2], [1, 0], [2, 1], [0, 1]], dtype=torch.int32), torch.rand(4, 2)
    got = TorchGroupedMoE(torch.float32).forward(hidden, ids, routing_weights, prepared)
    real13 = dequantize_fp4(weights.w13, weights.w13_scale)
    real2 = dequantize_fp4(weights.w2, weights.w2_scale)
    want = reference_moe(hidden, ids, routing_weights, real13, real2, swiglu_limit=1.0)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_fp4_experts_that_do_not_fit_are_refused(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    good = _fp4_experts(gen, 2)
    good.check()
    with pytest.raises(ValueError, match=r"packed FP4 w13 .* implies w2 of shape \(2, 64, 16\), got \(2, 64, 32\)"):
        attrs.evolve(good, w2=torch.zeros(2, HIDDEN, INTERMEDIATE, dtype=torch.uint8)).check()
    with pytest.raises(ValueError, match=r"w2_scale float8_e8m0fnu \(2, 64, 1\) .*got None"):
        attrs.evolve(good, w2_scale=None).check()
    with pytest.raises(ValueError, match=r"w13 must be uint8 packed codes, got torch.int8"):
        attrs.evolve(good, w13=good.w13.view(torch.int8)).check()
    with pytest.raises(ValueError, match="FP4 experts take no block_shape"):
        attrs.evolve(good, block_shape=(32, 32)).check()


def test_refusal_names_the_backend_what_is_missing_and_what_to_do(seed: int) -> None:
    weights = _fp4_experts(torch.Generator().manual_seed(seed), 2, swiglu_limit=7.0)
    weights.refuse_unsupported("x", {"fp4", "swiglu-limit"})
    with pytest.raises(ValueError) as refused:
        weights.refuse_unsupported("some-moe", {"bf16"})
    message = str(refused.value)
    assert message.startswith("some-moe MoE cannot run these experts: they have packed FP4 weights; a SwiGLU")
    assert "swiglu_limit = 7.0" in message and "declares 'fp4', 'swiglu-limit'" in message

"""DeepSeek-V4's routing in ``layers.moe``: sqrtsoftplus scores with the correction bias
choosing the top-k, and hash routing (experts from the token id, the layer's ``tid2eid``),
against transformers' ``DeepseekV4TopKRouter`` / ``DeepseekV4HashRouter`` /
``DeepseekV4SparseMoeBlock`` on fresh random weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf_v4
from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config

from powertrain.builtin.grouped_moe import TorchGroupedMoE
from powertrain.interfaces import RoutingConfig
from powertrain.layers.moe import MoE, route
from powertrain.testing.checkpoints import TINY_DEEPSEEK_V4_CONFIG

VOCAB = 64


def hf_config() -> DeepseekV4Config:
    return DeepseekV4Config(**{**TINY_DEEPSEEK_V4_CONFIG, "vocab_size": VOCAB})


def ours(cfg: DeepseekV4Config, method: str) -> RoutingConfig:
    return RoutingConfig(
        num_experts=cfg.num_local_experts,
        top_k=cfg.num_experts_per_tok,
        scoring="sqrtsoftplus",
        topk_method=method,
        norm_topk_prob=True,
        routed_scaling_factor=cfg.routed_scaling_factor,
    )


def test_learned_routing_equals_transformers(seed: int) -> None:
    cfg = hf_config()
    assert cfg.scoring_func == "sqrtsoftplus"
    hf = hf_v4.DeepseekV4TopKRouter(cfg)
    with torch.no_grad():
        hf.weight.copy_(torch.randn_like(hf.weight))
        hf.e_score_correction_bias.copy_(torch.randn_like(hf.e_score_correction_bias))
    # 64 tokens and a bias as large as the scores: with 9 tokens and half of it, seed 2393856961
    # drew a bias that changed no token's experts, and the check below failed on its input.
    hidden = torch.randn(64, cfg.hidden_size)
    with torch.no_grad():
        logits, hf_weights, hf_ids = hf(hidden)
    ids, weights = route(logits, ours(cfg, "noaux_tc"), hf.e_score_correction_bias)
    # transformers' top-k is unsorted: compare each token's (expert, weight) pairs as sets.
    for row in range(hidden.shape[0]):
        want = dict(zip(hf_ids[row].tolist(), hf_weights[row].tolist(), strict=True))
        got = dict(zip(ids[row].tolist(), weights[row].tolist(), strict=True))
        assert got.keys() == want.keys(), f"seed={seed} token {row}"
        assert all(abs(got[e] - want[e]) < 1e-6 for e in want), f"seed={seed} token {row}"
    # The bias steered the choice (else this would not test it): without it, other experts.
    plain = F.softplus(logits).sqrt().topk(cfg.num_experts_per_tok, dim=-1).indices.sort(-1).values
    assert not torch.equal(plain, ids.long().sort(-1).values), f"seed={seed}: the bias changed nothing"


def test_hash_routing_equals_transformers(seed: int) -> None:
    cfg = hf_config()
    hf = hf_v4.DeepseekV4HashRouter(cfg)
    table = torch.stack([torch.randperm(cfg.num_local_experts)[: cfg.num_experts_per_tok] for _ in range(VOCAB)])
    with torch.no_grad():
        hf.weight.copy_(torch.randn_like(hf.weight))
        hf.tid2eid.copy_(table)
    tokens = torch.randint(0, VOCAB, (11,))
    hidden = torch.randn(11, cfg.hidden_size)
    with torch.no_grad():
        logits, hf_weights, hf_ids = hf(hidden, tokens)
    ids, weights = route(logits, ours(cfg, "hash"), expert_ids=table[tokens])
    assert torch.equal(ids.long(), hf_ids) and ids.dtype == torch.int32
    torch.testing.assert_close(weights, hf_weights, rtol=1e-6, atol=1e-7, msg=lambda m: f"seed={seed}: {m}")


def test_hash_routing_needs_its_table_and_only_it() -> None:
    cfg = hf_config()
    logits = torch.randn(3, cfg.num_local_experts)
    with pytest.raises(ValueError, match="'hash' needs expert_ids"):
        route(logits, ours(cfg, "hash"))
    with pytest.raises(ValueError, match="'noaux_tc' takes no expert_ids"):
        route(logits, ours(cfg, "noaux_tc"), torch.zeros(cfg.num_local_experts), expert_ids=torch.zeros(3, 2))
    with pytest.raises(ValueError, match=r"expert_ids must be \[num_tokens, 2\]"):
        route(logits, ours(cfg, "hash"), expert_ids=torch.zeros(3, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="must be 1 .*for hash routing"):
        RoutingConfig(num_experts=8, top_k=2, scoring="sqrtsoftplus", topk_method="hash", n_group=2)


def test_a_hash_routed_moe_layer_equals_transformers(seed: int) -> None:
    """The whole routed part of a V4 hash layer: ``layers.moe.MoE`` on the torch backend,
    loaded from transformers' block, equals its output less the shared expert (with a
    SwiGLU limit no activation reaches: the clamp has its own tests in test_moe.py)."""
    cfg = DeepseekV4Config(**{**TINY_DEEPSEEK_V4_CONFIG, "vocab_size": VOCAB, "swiglu_limit": 1e9})
    hf = hf_v4.DeepseekV4SparseMoeBlock(cfg, layer_idx=0).eval()
    assert hf.is_hash
    with torch.no_grad():
        for param in hf.parameters():
            param.copy_(0.3 * torch.randn_like(param))
        hf.gate.tid2eid.copy_(
            torch.stack([torch.randperm(cfg.num_local_experts)[: cfg.num_experts_per_tok] for _ in range(VOCAB)])
        )
    layer = MoE(ours(cfg, "hash"), cfg.hidden_size, cfg.moe_intermediate_size, TorchGroupedMoE(torch.float32),
                torch.float32, "cpu", vocab_size=VOCAB)  # fmt: skip
    for name, tensor in hf.state_dict().items():
        if not name.startswith("shared_experts."):
            assert layer.load_weight(name, tensor), name
    layer.finish_loading()
    tokens = torch.randint(0, VOCAB, (13,))
    hidden = torch.randn(13, cfg.hidden_size)
    with torch.no_grad():
        want = hf(hidden[None], input_ids=tokens[None])[0] - hf.shared_experts(hidden)
        got = layer(hidden, tokens)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"seed={seed}: {m}")
    with pytest.raises(ValueError, match="needs one token id per row"):
        layer(hidden)


def test_a_damaged_hash_table_is_refused_at_load() -> None:
    cfg = hf_config()
    layer = MoE(ours(cfg, "hash"), cfg.hidden_size, cfg.moe_intermediate_size, TorchGroupedMoE(torch.float32),
                torch.float32, "cpu", vocab_size=VOCAB)  # fmt: skip
    bad = torch.full((VOCAB, cfg.num_experts_per_tok), cfg.num_local_experts)
    with pytest.raises(ValueError, match="tid2eid names experts .* the checkpoint is damaged"):
        layer.load_weight("gate.tid2eid", bad)
    with pytest.raises(ValueError, match="needs integer"):
        layer.load_weight("gate.tid2eid", torch.zeros(VOCAB, cfg.num_experts_per_tok))
    assert "gate.tid2eid" in layer.missing_weights()
    with pytest.raises(ValueError, match="'hash'-routed MoE layer needs vocab_size"):
        MoE(ours(cfg, "hash"), cfg.hidden_size, 32, TorchGroupedMoE(torch.float32), torch.float32, "cpu")


class BusyPeer:
    """Stands in for the other rank of a 2-rank expert-parallel group, which is busy: the
    flag all-reduce reports one busy rank. (The real two-process run is
    test_deepseek_v4_model.py's DP/EP test; whether its ranks ever idle depends on timing.)"""

    world_size = 2

    def all_reduce(self, flags: torch.Tensor) -> torch.Tensor:
        return flags + torch.tensor([1, 0])


def test_an_idle_rank_serves_its_peers_through_hash_routed_layers() -> None:
    """A rank with no tokens replays every MoE layer with none, hash-routed ones included
    (they take the tokens' ids: none)."""
    from powertrain.parallel.lockstep import Lockstep

    cfg = hf_config()
    layer = MoE(ours(cfg, "hash"), cfg.hidden_size, cfg.moe_intermediate_size, TorchGroupedMoE(torch.float32),
                torch.float32, "cpu", vocab_size=VOCAB)  # fmt: skip
    experts, hidden, inner = cfg.num_local_experts, cfg.hidden_size, cfg.moe_intermediate_size
    layer.load_weight("gate.weight", torch.randn(experts, hidden))
    layer.load_weight("gate.tid2eid", torch.stack([torch.randperm(experts)[:2] for _ in range(VOCAB)]))
    layer.load_weight("experts.gate_up_proj", torch.randn(experts, 2 * inner, hidden))
    layer.load_weight("experts.down_proj", torch.randn(experts, hidden, inner))
    layer.finish_loading()
    lockstep = Lockstep(BusyPeer(), [layer], hidden, torch.float32, "cpu")
    assert lockstep.idle().anyone_busy

"""mHC (``layers.hyper_connections``) against transformers' DeepSeek-V4 modules, on fresh
random parameters and streams, in float32 and bfloat16."""

from __future__ import annotations

import pytest
import torch
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf_v4
from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config

from powertrain.layers.hyper_connections import HyperConnection, HyperHead
from powertrain.testing.checkpoints import TINY_DEEPSEEK_V4_CONFIG


def config() -> DeepseekV4Config:
    return DeepseekV4Config(**{**TINY_DEEPSEEK_V4_CONFIG, "vocab_size": 64})


def randomised(module: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn_like(param))
    return module


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_collapse_and_expand_equal_transformers(seed: int, dtype: torch.dtype) -> None:
    cfg = config()
    hf = randomised(hf_v4.DeepseekV4HyperConnection(cfg).to(torch.float32)).eval()
    ours = HyperConnection(cfg.hidden_size, cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
    ours.load_state_dict(hf.state_dict())
    tokens = 7
    streams = torch.randn(1, tokens, cfg.hc_mult, cfg.hidden_size).to(dtype)
    with torch.no_grad():
        hf_post, hf_comb, hf_collapsed = hf(streams)
        collapsed, post, comb = ours.collapse(streams[0])
    assert collapsed.dtype == dtype and post.dtype == comb.dtype == torch.float32
    torch.testing.assert_close(collapsed, hf_collapsed[0], rtol=0, atol=0, msg=lambda m: f"seed={seed}: {m}")
    torch.testing.assert_close(post, hf_post[0], rtol=0, atol=0)
    torch.testing.assert_close(comb, hf_comb[0], rtol=0, atol=0)
    # Sinkhorn ends on a column normalisation: columns sum to one, rows nearly (20
    # iterations on random, often extreme logits converge only roughly).
    ones = torch.ones(tokens, cfg.hc_mult)
    torch.testing.assert_close(comb.sum(-2), ones, atol=1e-5, rtol=0)
    torch.testing.assert_close(comb.sum(-1), ones, atol=0.2, rtol=0)
    # Expanding: stream k = post[k] * output + sum_j comb[j, k] * streams[j], against float64.
    output = torch.randn(tokens, cfg.hidden_size).to(dtype)
    mixed = HyperConnection.expand(streams[0], output, post, comb)
    want = post.double()[..., None] * output.double()[:, None, :] + torch.einsum(
        "tjk,tjd->tkd", comb.double(), streams[0].double()
    )
    tolerance = 1e-5 if dtype == torch.float32 else 5e-2
    assert mixed.dtype == dtype
    torch.testing.assert_close(mixed.double(), want, atol=tolerance, rtol=tolerance, msg=lambda m: f"seed={seed}: {m}")


def test_comb_is_used_transposed(seed: int) -> None:
    """A non-symmetric comb: reading it untransposed gives other streams (so the test can fail)."""
    cfg = config()
    ours = randomised(HyperConnection(cfg.hidden_size, cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps, 1e-6))
    streams = torch.randn(3, cfg.hc_mult, cfg.hidden_size)
    with torch.no_grad():
        _, post, comb = ours.collapse(streams)
    assert not torch.allclose(comb, comb.transpose(-1, -2), atol=1e-3)
    output = torch.zeros(3, cfg.hidden_size)
    right = HyperConnection.expand(streams, output, post, comb)
    wrong = comb @ streams
    assert not torch.allclose(right, wrong, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_equals_transformers(seed: int, dtype: torch.dtype) -> None:
    cfg = config()
    hf = randomised(hf_v4.DeepseekV4HyperHead(cfg).to(torch.float32)).eval()
    ours = HyperHead(cfg.hidden_size, cfg.hc_mult, cfg.hc_eps, cfg.rms_norm_eps)
    ours.load_state_dict(hf.state_dict())
    streams = torch.randn(1, 5, cfg.hc_mult, cfg.hidden_size).to(dtype)
    with torch.no_grad():
        torch.testing.assert_close(ours(streams[0]), hf(streams)[0], rtol=0, atol=0, msg=lambda m: f"seed={seed}: {m}")


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="streams >= 1 and sinkhorn_iters >= 1"):
        HyperConnection(8, 0, 20, 1e-6, 1e-6)

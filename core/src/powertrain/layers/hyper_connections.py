"""Manifold-constrained hyper-connections (mHC, DeepSeek-V4): each token carries
``streams`` residual streams instead of one.

A block (attention or MoE) reads one input collapsed from the streams with token-dependent
weights ``pre``, and its output goes back spread over the streams with weights ``post``, on
top of the old streams mixed by ``comb``: a doubly-stochastic ``streams x streams`` matrix
(a few Sinkhorn-Knopp normalisations), so mixing cannot blow the streams' norm up. All three
come from one linear map of the flattened, RMS-normalised streams, computed in float32
whatever the model's dtype, as transformers' ``DeepseekV4HyperConnection`` (the oracle) does.
Parameters carry the checkpoint's names: ``fn``, ``base``, ``scale``; the final collapse
(``HyperHead``) has ``hc_fn``, ``hc_base``, ``hc_scale``.

Tokens are flat here (``[num_tokens, streams, hidden]``), as everywhere in powertrain.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class HyperConnection(nn.Module):
    """The ``pre``/``post``/``comb`` weights around one block, and the mixing after it."""

    def __init__(self, hidden_size: int, streams: int, sinkhorn_iters: int, eps: float, norm_eps: float) -> None:
        super().__init__()
        if streams < 1 or sinkhorn_iters < 1:
            raise ValueError(f"mHC needs streams >= 1 and sinkhorn_iters >= 1, got {streams} and {sinkhorn_iters}")
        self.streams, self.sinkhorn_iters, self.eps, self.norm_eps = streams, sinkhorn_iters, eps, norm_eps
        width = (2 + streams) * streams  # pre (N), post (N), comb (N x N)
        self.fn = nn.Parameter(torch.empty(width, streams * hidden_size, dtype=torch.float32), requires_grad=False)
        self.base = nn.Parameter(torch.empty(width, dtype=torch.float32), requires_grad=False)
        self.scale = nn.Parameter(torch.empty(3, dtype=torch.float32), requires_grad=False)

    def weights(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """float32 ``pre`` ``[T, N]``, ``post`` ``[T, N]`` and ``comb`` ``[T, N, N]`` from the
        streams ``hidden`` ``[T, N, D]``."""
        n = self.streams
        mixes = F.linear(_unweighted_rms_norm(hidden.flatten(1).float(), self.norm_eps), self.fn)
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre_scale, post_scale, comb_scale = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_scale + pre_b) + self.eps
        post = 2 * torch.sigmoid(post_w * post_scale + post_b)
        comb = torch.softmax(comb_w.unflatten(-1, (n, n)) * comb_scale + comb_b.view(n, n), dim=-1) + self.eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)  # columns first, then rows and columns
        for _ in range(self.sinkhorn_iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        return pre, post, comb

    def collapse(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``hidden`` ``[T, N, D]`` -> the block's input ``[T, D]`` (in ``hidden``'s dtype), and
        the float32 ``post`` ``[T, N]`` and ``comb`` ``[T, N, N]`` that ``expand`` needs."""
        pre, post, comb = self.weights(hidden)
        return collapse_with(hidden, pre), post, comb

    @staticmethod
    def expand(hidden: torch.Tensor, output: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """New streams: the block's ``output`` ``[T, D]`` spread by ``post`` plus the old
        streams mixed by ``comb`` (stream ``k`` gets ``sum_j comb[j, k] * hidden[j]``),
        in ``hidden``'s dtype."""
        dtype = hidden.dtype
        return post.to(dtype).unsqueeze(-1) * output.unsqueeze(-2) + comb.to(dtype).transpose(-1, -2) @ hidden

    @staticmethod
    def expand_in_float32(
        hidden: torch.Tensor, output: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
    ) -> torch.Tensor:
        """``expand`` computed in float32 and rounded once to ``hidden``'s dtype, as
        DeepSeek's V4.1 code does (``expand`` follows transformers' V4, which mixes in the
        model's dtype)."""
        mixed = post.unsqueeze(-1) * output.float().unsqueeze(-2) + comb.transpose(-1, -2) @ hidden.float()
        return mixed.to(hidden.dtype)


def collapse_with(hidden: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """The streams ``hidden`` ``[T, N, D]`` weighed by ``pre`` ``[T, N]`` (float32) and summed:
    ``[T, D]`` in ``hidden``'s dtype."""
    return (pre.unsqueeze(-1) * hidden).sum(dim=1).to(hidden.dtype)


class HyperHead(nn.Module):
    """The final collapse of the streams into one hidden state, before the model's norm."""

    def __init__(self, hidden_size: int, streams: int, eps: float, norm_eps: float) -> None:
        super().__init__()
        self.eps, self.norm_eps = eps, norm_eps
        self.hc_fn = nn.Parameter(torch.empty(streams, streams * hidden_size, dtype=torch.float32), requires_grad=False)
        self.hc_base = nn.Parameter(torch.empty(streams, dtype=torch.float32), requires_grad=False)
        self.hc_scale = nn.Parameter(torch.empty(1, dtype=torch.float32), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [T, N, D] -> [T, D]
        mixes = F.linear(_unweighted_rms_norm(hidden.flatten(1).float(), self.norm_eps), self.hc_fn)
        pre = torch.sigmoid(mixes * self.hc_scale + self.hc_base) + self.eps
        return collapse_with(hidden, pre)

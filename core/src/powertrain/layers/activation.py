"""The gated activation of Llama-style MLPs: plain, and DeepSeek-V4's clamped form (and its
shared expert, the clamped SwiGLU MLP)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from powertrain.layers.linear import Linear


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` where the input is ``[..., 2 * intermediate]`` = gate then up.

    One fused gate/up matmul feeds it, so the pair is split here rather than run twice.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    """``silu(gate) * up``, with DeepSeek-V4's clamp of both inputs when ``limit`` is set
    (transformers' ``DeepseekV4Experts._apply_gate``)."""
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


class ClampedSwiGLU(nn.Module):
    """DeepSeek-V4's and V4.1's shared expert: ``w2(silu(min(w1 x, limit)) * clamp(w3 x, -limit, limit))``."""

    def __init__(self, hidden_size: int, intermediate_size: int, limit: float | None) -> None:
        super().__init__()
        self.w1 = Linear(hidden_size, intermediate_size, bias=False)
        self.w3 = Linear(hidden_size, intermediate_size, bias=False)
        self.w2 = Linear(intermediate_size, hidden_size, bias=False)
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(swiglu(self.w1(x), self.w3(x), self.limit))

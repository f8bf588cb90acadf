"""The gated activation of Llama-style MLPs: plain, and DeepSeek-V4's clamped form."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


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

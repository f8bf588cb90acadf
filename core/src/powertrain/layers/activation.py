"""The gated activation of Llama-style MLPs, over a fused gate|up projection."""

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

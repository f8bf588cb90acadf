"""RMSNorm, plain and fused with the residual add that precedes it in every block."""

from __future__ import annotations

from typing import TYPE_CHECKING, overload

import torch
from torch import nn

if TYPE_CHECKING:
    from powertrain.interfaces import RMSNormKernel


class RMSNorm(nn.Module):
    """``weight * x / rms(x)``, with the statistics in float32 as HF computes them.

    ``forward(x, residual)`` first adds ``residual`` and returns ``(normed, x + residual)``:
    the decoder needs both, and kernel packs fuse the add and the norm into one pass.
    Assembly hands such a pack's kernel to every norm of the model (``use_norm_kernel``).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.kernel: RMSNormKernel | None = None

    @overload
    def forward(self, x: torch.Tensor, residual: None = None) -> torch.Tensor: ...

    @overload
    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.kernel is not None:
            return self.kernel.rms_norm(x, self.weight, self.eps, residual)
        return rms_norm(x, self.weight, self.eps, residual)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


@overload
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: None = None) -> torch.Tensor: ...


@overload
def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]: ...


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``RMSNorm.forward`` in plain torch (the reference a ``RMSNormKernel`` must equal, and
    its fallback for inputs it does not take)."""
    if residual is None:
        return _norm(x, weight, eps)
    # The sum stays in the activation dtype, as in HF's decoder layer.
    x = x + residual
    return _norm(x, weight, eps), x


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    # Cast back before scaling: HF multiplies the weight in the model dtype.
    return weight * x32.to(x.dtype)


def use_norm_kernel(model: nn.Module, kernel: RMSNormKernel) -> int:
    """Make every RMSNorm of ``model`` compute through ``kernel``; returns how many."""
    norms = [module for module in model.modules() if isinstance(module, RMSNorm)]
    for norm in norms:
        norm.kernel = kernel
    return len(norms)

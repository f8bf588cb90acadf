"""What every model's ``load_weights`` does the same way: checked copies, readable errors."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def copy_checked(name: str, target: torch.Tensor, tensor: torch.Tensor) -> None:
    """Copy checkpoint tensor ``name`` into ``target`` (cast to its dtype and device);
    a shape mismatch names the tensor and both shapes."""
    if target.shape != tensor.shape:
        raise ValueError(
            f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
            f"but this model's config needs {tuple(target.shape)}"
        )
    target.copy_(tensor)


def name_list(names: Sequence[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" (and {len(names) - limit} more)" if len(names) > limit else "")


def check_complete(model: str, unexpected: Sequence[str], missing: Sequence[str]) -> None:
    """Raise ValueError naming the checkpoint tensors ``model`` did not expect and the
    ones it needed but never received."""
    problems = []
    if unexpected:
        problems.append(f"unexpected tensors: {name_list(unexpected)}")
    if missing:
        problems.append(f"missing tensors: {name_list(missing)}")
    if problems:
        raise ValueError(f"checkpoint does not match {model}: {'; '.join(problems)}")

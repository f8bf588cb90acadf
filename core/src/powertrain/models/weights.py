"""What every model's ``load_weights`` does the same way: checked copies, readable errors."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from powertrain.interfaces import QuantizedWeight

#: A routed expert's tensor, in any naming (``mlp.experts.N.`` or DeepSeek's ``ffn.experts.N.``;
#: a shared expert's ``shared_experts`` never matches).
ROUTED_EXPERT = re.compile(r"\.experts\.(\d+)\.")


def held_here(name: str, expert_slice: tuple[int, int] | None) -> bool:
    """Whether this rank reads tensor ``name``: False only for a routed expert outside
    ``expert_slice`` (``(first, count)`` under expert parallelism; None: every expert)."""
    match = ROUTED_EXPERT.search(name)
    if match is None or expert_slice is None:
        return True
    first, count = expert_slice
    return first <= int(match.group(1)) < first + count


def materialize(module: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Give every parameter of a module built on the meta device uninitialised storage of
    ``dtype`` on ``device`` (what ``.to(dtype).to_empty(device)`` does; that path goes through
    torch's Python reference ops per tensor and took 0.7 s of SmolLM2's start-up, this 0.01 s).
    Floating-point parameters take ``dtype``; others keep theirs. Nothing is initialised:
    ``load_weights`` overwrites it all."""
    for submodule in module.modules():
        for name, param in submodule._parameters.items():
            if param is None:
                continue
            target = dtype if param.dtype.is_floating_point else param.dtype
            submodule._parameters[name] = nn.Parameter(
                torch.empty(param.shape, dtype=target, device=device), requires_grad=False
            )


def copy_checked(name: str, target: torch.Tensor, tensor: torch.Tensor) -> None:
    """Copy checkpoint tensor ``name`` into ``target`` (cast to its dtype and device);
    a shape mismatch names the tensor and both shapes."""
    if target.shape != tensor.shape:
        raise ValueError(
            f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
            f"but this model's config needs {tuple(target.shape)}"
        )
    target.copy_(tensor)


def copy_or_keep(
    name: str, target: torch.Tensor, tensor: torch.Tensor | QuantizedWeight, quantized: dict[str, QuantizedWeight]
) -> None:
    """A dense checkpoint tensor is copied into ``target`` (``copy_checked``); one kept quantised
    (``QuantizedWeight``) goes to ``quantized`` for its layer, its shape checked against ``target``'s."""
    if not isinstance(tensor, QuantizedWeight):
        copy_checked(name, target, tensor)
        return
    if tensor.shape != tuple(target.shape):
        raise ValueError(
            f"checkpoint tensor {name!r} has shape {list(tensor.shape)}, "
            f"but this model's config needs {list(target.shape)}"
        )
    quantized[name] = tensor


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


def fused_targets(
    module: nn.Module, fused: Mapping[str, tuple[Sequence[str], Sequence[int]]], prefix: str = ""
) -> dict[str, torch.Tensor]:
    """Every checkpoint tensor name ``module``'s parameters take -> the rows it fills.

    ``fused`` maps a fused projection's name (``qkv_proj``) to the checkpoint projections it
    stacks (``q_proj``, ``k_proj``, ``v_proj``) and their row counts: each of those names gets
    its rows of the fused parameter; other parameters keep their own name."""
    targets: dict[str, torch.Tensor] = {}
    for name, param in module.named_parameters(prefix=prefix.rstrip(".")):
        parent_module, _, kind = name.rpartition(".")
        parent, _, leaf = parent_module.rpartition(".")
        if leaf not in fused:
            targets[name] = param.data
            continue
        parts, rows = fused[leaf]
        for part, shard in zip(parts, param.data.split(list(rows)), strict=True):
            targets[f"{parent}.{part}.{kind}"] = shard
    return targets

"""``hccl``: collectives on torch.distributed with the platform's backend (HCCL on Ascend).

The communicator is core's ``powertrain.distributed.TorchDistributedCommunicator`` —
its argument checks on the calling rank, its collective timeout, its create-or-join
rule and current-device setup — built after what Ascend needs first: torch_npu
imported, which registers the ``hccl`` backend and ``torch.npu``. ``hccl_group_name``
gives the HCCL communicator name that MC2 operators such as
``npu_moe_distribute_dispatch`` take as ``group_ep``.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from powertrain.distributed import TorchDistributedCommunicator
from powertrain.interfaces import CommunicatorContext


def hccl_communicator(context: CommunicatorContext) -> TorchDistributedCommunicator:
    """torch.distributed on the platform's backend; for HCCL, torch_npu comes first."""
    if context.platform.dist_backend == "hccl":
        importlib.import_module("torch_npu")  # registers the hccl backend and torch.npu
    return TorchDistributedCommunicator(context)


def hccl_group_name(group: Any, rank: int) -> str:
    """The HCCL communicator name of ``group``, as torch_npu documents it (torch >= 2.1):
    ``group._get_backend(torch.device("npu")).get_hccl_comm_name(rank)``.

    ``rank`` is the calling rank's id (torch_npu's doc says the global rank id; for the
    world group that is its rank). The current NPU must be set (the communicator does).
    Raises ValueError when ``group`` has no HCCL backend (e.g. gloo on CPU).
    """
    try:
        backend = group._get_backend(_npu_device())
        getter = backend.get_hccl_comm_name
    except (AttributeError, RuntimeError, ValueError) as exc:
        raise ValueError(
            f"hccl_group_name: {group!r} has no HCCL backend ({type(exc).__name__}: {exc}); MC2 operators "
            "need a process group created with backend 'hccl' on an Ascend NPU"
        ) from exc
    return getter(rank)


def _npu_device() -> torch.device:
    """``torch.device("npu")``: a valid device string only once torch_npu has been imported."""
    return torch.device("npu")

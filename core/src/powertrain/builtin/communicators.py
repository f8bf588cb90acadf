"""The builtin communicators: ``single-process`` and ``torch-distributed``.

``single-process`` serves world size 1 exactly (every collective is the identity),
so a one-device engine needs no process group at all. ``torch-distributed`` runs on
``torch.distributed`` with the platform's backend (gloo on cpu, nccl on cuda, hccl on
npu). Both validate arguments the same way and before any collective: an invalid
call raises on the calling rank instead of leaving its peers waiting in a mismatched
collective.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from powertrain import hookimpl
from powertrain.components import Availability, CommunicatorRecord, PlatformInfo
from powertrain.distributed import TorchDistributedCommunicator, as_tensor, check_all_to_all, check_src
from powertrain.interfaces import CommunicatorContext

POWERTRAIN_HOOK_API = 1


class SingleProcessCommunicator:
    """World size 1: every collective is exact and free, with no process group."""

    def __init__(self, ctx: CommunicatorContext) -> None:
        if ctx.world_size != 1 or ctx.rank != 0:
            raise ValueError(
                f"the single-process communicator serves world_size 1 (rank 0), got "
                f"rank={ctx.rank}, world_size={ctx.world_size}; choose 'torch-distributed' "
                "(or another multi-process communicator) for more ranks"
            )
        self.rank = 0
        self.world_size = 1
        self.device = ctx.device
        self.group = None  # no process group at world size 1

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return as_tensor("all_reduce", tensor, 0).to(self.device)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return as_tensor("all_gather", tensor, 0, min_dim=1).to(self.device)

    def all_to_all(
        self,
        tensor: torch.Tensor,
        send_counts: Sequence[int],
        recv_counts: Sequence[int] | None = None,
    ) -> torch.Tensor:
        t, _, _ = check_all_to_all(tensor, send_counts, recv_counts, 1, 0)
        return t.to(self.device)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        t = as_tensor("broadcast", tensor, 0)
        check_src(src, 1, 0)
        return t.to(self.device)

    def barrier(self) -> None:
        return None

    def close(self) -> None:
        return None


def _torch_distributed_check(platform: PlatformInfo) -> Availability:
    """Whether this torch build has the platform's backend (hccl comes with torch_npu)."""
    import torch.distributed as dist

    if not dist.is_available():
        return Availability.no(f"torch {torch.__version__} was built without torch.distributed")
    backend = platform.dist_backend
    probes = {"gloo": dist.is_gloo_available, "nccl": dist.is_nccl_available}
    if backend in probes and not probes[backend]():
        return Availability.no(f"torch {torch.__version__} was built without the {backend} backend")
    return Availability.yes(f"torch.distributed with {backend}")


@hookimpl
def powertrain_communicators() -> list[CommunicatorRecord]:
    return [
        CommunicatorRecord(
            name="single-process",
            factory=SingleProcessCommunicator,
            platforms={"cpu", "cuda", "npu"},
            max_world_size=1,
            priority=10,
            description="world size 1: exact identity collectives, no process group",
        ),
        CommunicatorRecord(
            name="torch-distributed",
            factory=TorchDistributedCommunicator,
            platforms={"cpu", "cuda", "npu"},
            priority=0,
            check=_torch_distributed_check,
            description="torch.distributed with the platform's backend (gloo, nccl, hccl)",
        ),
    ]

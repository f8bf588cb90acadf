"""Collectives on torch.distributed, with the argument checks every communicator shares.

``TorchDistributedCommunicator`` runs on the platform's backend (gloo on cpu, nccl on
cuda, hccl on npu); the builtin ``torch-distributed`` record serves it, and a kernel
pack whose platform needs more (e.g. Ascend: torch_npu imported before HCCL) builds it
from its own record. The checks run on the calling rank before any collective: an
invalid call raises there instead of leaving its peers waiting in a mismatched one.
"""

from __future__ import annotations

import datetime
import operator
from collections.abc import Sequence
from types import ModuleType

import torch

from powertrain.interfaces import CommunicatorContext

#: How long a collective (and group creation) may wait for peers before torch
#: raises; long enough for slow model loads on other ranks, short enough that a
#: dead peer is reported instead of hanging an engine forever.
DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)


# --------------------------------------------------------------------------- validation


def as_tensor(op: str, tensor: object, rank: int, *, min_dim: int = 0) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{op} on rank {rank}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() < min_dim:
        raise ValueError(
            f"{op} on rank {rank}: works over dim 0, so the tensor needs at least {min_dim} "
            f"dimension(s); got a {tensor.dim()}-d tensor of shape {tuple(tensor.shape)}"
        )
    return tensor


def check_counts(op: str, name: str, counts: Sequence[int], world_size: int, rank: int, rows: int | None) -> list[int]:
    """``counts`` as a list of ints, or a ValueError saying what is wrong and what was expected.

    ``rows`` (when given) is what the counts must sum to: the rows of the tensor sent.
    """
    try:
        values = [operator.index(c) for c in counts]
    except TypeError as exc:
        raise TypeError(f"{op} on rank {rank}: {name} must be a sequence of ints, got {counts!r}") from exc
    if len(values) != world_size:
        raise ValueError(
            f"{op} on rank {rank}: {name} has {len(values)} entries {values}, "
            f"expected one per rank (world_size={world_size})"
        )
    negative = [i for i, c in enumerate(values) if c < 0]
    if negative:
        raise ValueError(
            f"{op} on rank {rank}: {name} {values} has negative counts at ranks {negative}; "
            "counts are row numbers, expected >= 0"
        )
    if rows is not None and sum(values) != rows:
        raise ValueError(
            f"{op} on rank {rank}: {name} {values} sums to {sum(values)}, expected the "
            f"{rows} rows (dim 0) of the tensor being sent"
        )
    return values


def check_all_to_all(
    tensor: object,
    send_counts: Sequence[int],
    recv_counts: Sequence[int] | None,
    world_size: int,
    rank: int,
) -> tuple[torch.Tensor, list[int], list[int] | None]:
    t = as_tensor("all_to_all", tensor, rank, min_dim=1)
    send = check_counts("all_to_all", "send_counts", send_counts, world_size, rank, t.shape[0])
    if recv_counts is None:
        return t, send, None
    recv = check_counts("all_to_all", "recv_counts", recv_counts, world_size, rank, None)
    if recv[rank] != send[rank]:
        raise ValueError(
            f"all_to_all on rank {rank}: recv_counts[{rank}]={recv[rank]} but this rank sends "
            f"itself send_counts[{rank}]={send[rank]} rows; expected them equal"
        )
    return t, send, recv


def check_src(src: object, world_size: int, rank: int) -> int:
    try:
        value = operator.index(src)  # type: ignore[arg-type]
    except TypeError as exc:
        raise TypeError(f"broadcast on rank {rank}: src must be an int rank, got {src!r}") from exc
    if not 0 <= value < world_size:
        raise ValueError(
            f"broadcast on rank {rank}: src={value} is not a rank; expected 0 <= src < world_size={world_size}"
        )
    return value


# --------------------------------------------------------------------------- single process


# --------------------------------------------------------------------------- torch.distributed


class TorchDistributedCommunicator:
    """Collectives over torch.distributed's default group.

    Creates the group (and then owns it: ``close`` destroys it) unless one is already
    initialised, in which case it joins that one and leaves it alone on ``close``.
    """

    def __init__(self, ctx: CommunicatorContext, *, timeout: datetime.timedelta = DEFAULT_TIMEOUT) -> None:
        import torch.distributed as dist

        if not dist.is_available():
            raise RuntimeError(f"torch {torch.__version__} was built without torch.distributed")
        if ctx.world_size < 1 or not 0 <= ctx.rank < ctx.world_size:
            raise ValueError(
                f"torch-distributed: rank={ctx.rank}, world_size={ctx.world_size} is not a valid "
                "placement; expected world_size >= 1 and 0 <= rank < world_size"
            )
        self.rank = ctx.rank
        self.world_size = ctx.world_size
        self.device = ctx.device
        self._closed = False
        # The platform's backend wants the device named in barriers (NCCL): only when the
        # group runs that backend and this rank has an indexed device.
        self._barrier_device_ids = ctx.platform.barrier_needs_device_ids and ctx.device.index is not None
        self._platform_backend = ctx.platform.dist_backend
        if dist.is_initialized():
            have_rank, have_size = dist.get_rank(), dist.get_world_size()
            if (have_rank, have_size) != (ctx.rank, ctx.world_size):
                raise RuntimeError(
                    f"torch-distributed: torch.distributed is already initialised as rank {have_rank} "
                    f"of {have_size}, but this communicator was asked for rank {ctx.rank} of "
                    f"{ctx.world_size}; launch with matching ranks, or destroy the existing group first"
                )
            self._owns_group = False
            self.group = dist.group.WORLD
            self.backend = str(dist.get_backend())
            return
        backend = ctx.platform.dist_backend
        if ctx.platform.set_device is not None and ctx.device.index is not None:
            # nccl/hccl pick the current device for group setup and barriers.
            ctx.platform.set_device(ctx.device)
        dist.init_process_group(
            backend=backend,
            init_method=ctx.init_method,
            rank=ctx.rank,
            world_size=ctx.world_size,
            timeout=timeout,
        )
        self._owns_group = True
        #: The process group, for expert dispatchers whose ops need it (e.g. an HCCL comm name).
        self.group = dist.group.WORLD
        self.backend = backend

    def _dist(self) -> ModuleType:
        """torch.distributed, once this communicator is known to be open."""
        import torch.distributed as dist

        if self._closed:
            raise RuntimeError(f"torch-distributed communicator of rank {self.rank} is closed")
        return dist

    def _prepare(self, op: str, tensor: object, *, min_dim: int = 0) -> torch.Tensor:
        return as_tensor(op, tensor, self.rank, min_dim=min_dim).to(self.device).contiguous()

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        dist = self._dist()
        t = self._prepare("all_reduce", tensor)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        dist = self._dist()
        t = self._prepare("all_gather", tensor, min_dim=1)
        out = torch.empty((self.world_size * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
        dist.all_gather_into_tensor(out, t)
        return out

    def all_to_all(
        self,
        tensor: torch.Tensor,
        send_counts: Sequence[int],
        recv_counts: Sequence[int] | None = None,
    ) -> torch.Tensor:
        dist = self._dist()
        checked, send, recv = check_all_to_all(tensor, send_counts, recv_counts, self.world_size, self.rank)
        t = checked.to(self.device).contiguous()
        if recv is None:
            sent = torch.tensor(send, dtype=torch.int64, device=self.device)
            received = torch.empty_like(sent)
            dist.all_to_all_single(received, sent)
            recv = [int(c) for c in received.tolist()]
        out = torch.empty((sum(recv), *t.shape[1:]), dtype=t.dtype, device=t.device)
        dist.all_to_all_single(out, t, output_split_sizes=recv, input_split_sizes=send)
        return out

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        dist = self._dist()
        t = self._prepare("broadcast", tensor)
        dist.broadcast(t, src=check_src(src, self.world_size, self.rank))
        return t

    def barrier(self) -> None:
        dist = self._dist()
        if self._barrier_device_ids and self.backend == self._platform_backend:
            dist.barrier(device_ids=[self.device.index])
        else:
            dist.barrier()

    def close(self) -> None:
        """Destroy the group if this communicator created it; closing twice is harmless."""
        if self._closed:
            return
        self._closed = True
        if self._owns_group:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()

"""``hccl``: collectives on torch.distributed with the platform's backend (HCCL on Ascend).

Behaves like core's ``torch-distributed`` communicator -- the same argument checks,
made on the calling rank before any communication, the same 10-minute collective
timeout, the same create-or-join rule for the process group -- but is its own small
class (core's builtin plugins are reached through hooks, not imported), and adds what
Ascend needs: torch_npu imported before HCCL is asked for (it registers the backend and
``torch.npu``), the current NPU set before the group is created, and the HCCL
communicator name that MC2 operators such as ``npu_moe_distribute_dispatch`` take as
``group_ep`` (``hccl_group_name``).
"""

from __future__ import annotations

import datetime
import importlib
import operator
from collections.abc import Sequence
from typing import Any

import torch

from powertrain.interfaces import CommunicatorContext

#: How long a collective (and group creation) waits for peers before torch raises:
#: long enough for slow model loads on other ranks, short enough that a dead peer is
#: reported instead of hanging the engine (as core's torch-distributed communicator).
DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)


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


# --------------------------------------------------------------------------- argument checks


def _tensor(op: str, tensor: object, rank: int, *, min_dim: int = 0) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{op} on rank {rank}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() < min_dim:
        raise ValueError(
            f"{op} on rank {rank}: works over dim 0, so the tensor needs at least {min_dim} dimension(s), "
            f"got shape {tuple(tensor.shape)}"
        )
    return tensor


def _counts(name: str, counts: Sequence[int], world_size: int, rank: int, rows: int | None) -> list[int]:
    """``counts`` as ints, one per rank, none negative, summing to ``rows`` when given."""
    try:
        values = [operator.index(c) for c in counts]
    except TypeError as exc:
        raise TypeError(f"all_to_all on rank {rank}: {name} must be a sequence of ints, got {counts!r}") from exc
    if len(values) != world_size:
        raise ValueError(
            f"all_to_all on rank {rank}: {name} has {len(values)} entries {values}, expected one per rank "
            f"(world_size={world_size})"
        )
    if any(c < 0 for c in values):
        raise ValueError(f"all_to_all on rank {rank}: {name} {values} has negative counts; expected >= 0")
    if rows is not None and sum(values) != rows:
        raise ValueError(
            f"all_to_all on rank {rank}: {name} {values} sums to {sum(values)}, expected the {rows} rows "
            "(dim 0) of the tensor being sent"
        )
    return values


class HcclCommunicator:
    """Collectives over torch.distributed's default group, on ``context.device``.

    Creates the group with ``context.platform.dist_backend`` (and then owns it: ``close``
    destroys it) unless one is already initialised, which it joins and leaves alone.
    ``group`` is the ProcessGroup, for expert dispatchers (``hccl_group_name``).
    """

    def __init__(self, context: CommunicatorContext, *, timeout: datetime.timedelta = DEFAULT_TIMEOUT) -> None:
        import torch.distributed as dist

        if not dist.is_available():
            raise RuntimeError(f"torch {torch.__version__} was built without torch.distributed")
        if context.world_size < 1 or not 0 <= context.rank < context.world_size:
            raise ValueError(
                f"hccl: rank={context.rank}, world_size={context.world_size} is not a valid placement; "
                "expected world_size >= 1 and 0 <= rank < world_size"
            )
        self.rank = context.rank
        self.world_size = context.world_size
        self.device = context.device
        self.backend = context.platform.dist_backend
        self._closed = False
        if self.backend == "hccl":
            importlib.import_module("torch_npu")  # registers the hccl backend and torch.npu
        if self.device.type != "cpu" and self.device.index is not None:
            # HCCL (like NCCL) builds the communicator on the current device.
            getattr(torch, self.device.type).set_device(self.device)
        if dist.is_initialized():
            have = (dist.get_rank(), dist.get_world_size())
            if have != (context.rank, context.world_size):
                raise RuntimeError(
                    f"hccl: torch.distributed is already initialised as rank {have[0]} of {have[1]}, but this "
                    f"communicator was asked for rank {context.rank} of {context.world_size}"
                )
            self._owns_group = False
            self.backend = str(dist.get_backend())
        else:
            dist.init_process_group(
                backend=self.backend,
                init_method=context.init_method,
                rank=context.rank,
                world_size=context.world_size,
                timeout=timeout,
            )
            self._owns_group = True
        self.group = dist.group.WORLD

    def hccl_group_name(self) -> str:
        """This group's HCCL communicator name (``group_ep`` of the MC2 dispatch/combine ops)."""
        return hccl_group_name(self.group, self.rank)

    def _dist(self) -> Any:
        import torch.distributed as dist

        if self._closed:
            raise RuntimeError(f"hccl communicator of rank {self.rank} is closed")
        return dist

    def _prepare(self, op: str, tensor: object, *, min_dim: int = 0) -> torch.Tensor:
        return _tensor(op, tensor, self.rank, min_dim=min_dim).to(self.device).contiguous()

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        dist = self._dist()
        t = self._prepare("all_reduce", tensor)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return t

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        dist = self._dist()
        t = self._prepare("all_gather", tensor, min_dim=1)
        out = torch.empty((self.world_size * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
        dist.all_gather_into_tensor(out, t, group=self.group)
        return out

    def all_to_all(
        self,
        tensor: torch.Tensor,
        send_counts: Sequence[int],
        recv_counts: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Uneven all-to-all over dim 0; counts are checked here before anything is sent."""
        dist = self._dist()
        t = _tensor("all_to_all", tensor, self.rank, min_dim=1)
        send = _counts("send_counts", send_counts, self.world_size, self.rank, t.shape[0])
        recv = None
        if recv_counts is not None:
            recv = _counts("recv_counts", recv_counts, self.world_size, self.rank, None)
            if recv[self.rank] != send[self.rank]:
                raise ValueError(
                    f"all_to_all on rank {self.rank}: recv_counts[{self.rank}]={recv[self.rank]} but this rank "
                    f"sends itself send_counts[{self.rank}]={send[self.rank]} rows; expected them equal"
                )
        t = t.to(self.device).contiguous()
        if recv is None:
            sent = torch.tensor(send, dtype=torch.int64, device=self.device)
            received = torch.empty_like(sent)
            dist.all_to_all_single(received, sent, group=self.group)
            recv = [int(c) for c in received.tolist()]
        out = torch.empty((sum(recv), *t.shape[1:]), dtype=t.dtype, device=t.device)
        dist.all_to_all_single(out, t, output_split_sizes=recv, input_split_sizes=send, group=self.group)
        return out

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        dist = self._dist()
        t = self._prepare("broadcast", tensor)
        try:
            source = operator.index(src)
        except TypeError as exc:
            raise TypeError(f"broadcast on rank {self.rank}: src must be an int rank, got {src!r}") from exc
        if not 0 <= source < self.world_size:
            raise ValueError(
                f"broadcast on rank {self.rank}: src={source} is not a rank; expected 0 <= src < "
                f"world_size={self.world_size}"
            )
        dist.broadcast(t, src=source, group=self.group)
        return t

    def barrier(self) -> None:
        self._dist().barrier(group=self.group)

    def close(self) -> None:
        """Destroy the group if this communicator created it; closing twice is harmless."""
        if self._closed:
            return
        self._closed = True
        if self._owns_group:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()

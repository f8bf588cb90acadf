"""hccl communicator: the conformance kit over gloo on CPU, and the HCCL group name.

No NPU here, so the kit's spawned ranks build the ``hccl`` record's communicator on
the ``cpu`` platform (torch.distributed with gloo): everything but the backend is the
code an Ascend machine runs.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from powertrain.components import PlatformInfo
from powertrain.interfaces import CommunicatorContext
from powertrain.plugins import PluginManager, Provided
from powertrain.testing import CommunicatorSuite
from powertrain.testing.base import find_component
from powertrain_cann_ascend import communicator
from powertrain_cann_ascend.communicator import hccl_communicator, hccl_group_name


class TestHcclCommunicator(CommunicatorSuite):
    component = "hccl"
    # The record's AscendDispatcher needs torch_npu's distribute ops (tests/test_dispatch.py
    # checks its argument mapping); here the expert exchange runs the core's all-to-all one.
    record_dispatcher = False

    @classmethod
    def _platform_for(cls, manager: PluginManager, provided: Provided) -> PlatformInfo:
        # The record runs on npu, absent here; each rank builds it on the cpu platform
        # instead (dist_backend gloo, device cpu). The kit has no public setting for
        # that, so this overrides its platform choice.
        return manager.platforms()["cpu"]


def test_registered_for_npu_with_hccl(powertrain_plugins: PluginManager) -> None:
    record = find_component(powertrain_plugins, "communication", "hccl").record
    assert record.platforms == {"npu"}
    assert powertrain_plugins.platforms()["npu"].dist_backend == "hccl"


def test_rejects_bad_placement(powertrain_plugins: PluginManager) -> None:
    cpu = powertrain_plugins.platforms()["cpu"]
    with pytest.raises(ValueError, match="rank=2, world_size=2"):
        hccl_communicator(CommunicatorContext(platform=cpu, device=torch.device("cpu"), rank=2, world_size=2))


def test_hccl_group_name_asks_the_npu_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """As torch_npu documents: group._get_backend(torch.device("npu")).get_hccl_comm_name(rank)."""
    npu = object()  # torch.device("npu") exists only with torch_npu imported
    monkeypatch.setattr(communicator, "_npu_device", lambda: npu)
    asked = []

    class Backend:
        def get_hccl_comm_name(self, rank: int) -> str:
            asked.append(rank)
            return f"hccl_world_{rank}"

    class Group:
        def _get_backend(self, device: object) -> Backend:
            asked.append(device)
            return Backend()

    assert hccl_group_name(Group(), 3) == "hccl_world_3"
    assert asked == [npu, 3]


def test_hccl_group_name_refuses_groups_without_hccl() -> None:
    # Here torch.device("npu") itself fails (no torch_npu); on an NPU a gloo group has no
    # get_hccl_comm_name. Either way the caller learns the group is not an HCCL one.
    with pytest.raises(ValueError, match="no HCCL backend"):
        hccl_group_name(SimpleNamespace(), 0)

"""Registers the pack (entry point ``cann_ascend``): the ``npu`` platform and its
attention backend, MoE backend and HCCL communicator.

Nothing here imports torch_npu: ``support.detect_npu`` does when CANN is present,
and the factories import the backends, which take torch_npu's operators through
``ops.npu_ops``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from powertrain import hookimpl
from powertrain.components import AttentionBackendRecord, CommunicatorRecord, MoEBackendRecord, PlatformRecord
from powertrain_cann_ascend.capabilities import ABSENT_ATTENTION, ATTENTION_CAPABILITIES, MOE_ABSENT, MOE_CAPABILITIES
from powertrain_cann_ascend.support import detect_npu

if TYPE_CHECKING:
    from powertrain.interfaces import AttentionBackendContext, CommunicatorContext, MoEBackendContext

POWERTRAIN_HOOK_API = 1

NAME = "ascend-cann"


def build_attention(context: AttentionBackendContext) -> Any:
    from powertrain_cann_ascend.attention import AscendAttention
    from powertrain_cann_ascend.ops import npu_ops

    return AscendAttention(context, npu_ops())


def build_moe(context: MoEBackendContext) -> Any:
    from powertrain_cann_ascend.moe import AscendMoE
    from powertrain_cann_ascend.ops import npu_ops

    return AscendMoE(context, npu_ops())


def build_communicator(context: CommunicatorContext) -> Any:
    from powertrain_cann_ascend.communicator import hccl_communicator

    return hccl_communicator(context)


def build_dispatcher(communicator: Any) -> Any:
    from powertrain_cann_ascend.dispatch import AscendDispatcher
    from powertrain_cann_ascend.ops import npu_ops

    return AscendDispatcher(communicator, npu_ops())


@hookimpl
def powertrain_platforms() -> list[PlatformRecord]:
    return [
        PlatformRecord(
            name="npu",
            device_type="npu",
            dist_backend="hccl",
            detect=detect_npu,
            priority=100,
            description="Huawei Ascend NPUs through torch_npu (CANN)",
        )
    ]


@hookimpl
def powertrain_attention_backends() -> list[AttentionBackendRecord]:
    return [
        AttentionBackendRecord(
            name=NAME,
            platforms={"npu"},
            capabilities=ATTENTION_CAPABILITIES,
            absent=ABSENT_ATTENTION,
            priority=50,
            factory=build_attention,
            description=(
                "npu_fused_infer_attention_score over the paged cache (GQA, and MLA with query/key rope); "
                "npu_sparse_flash_attention and npu_lightning_indexer for DeepSeek-V3.2"
            ),
        )
    ]


@hookimpl
def powertrain_moe_backends() -> list[MoEBackendRecord]:
    return [
        MoEBackendRecord(
            name=NAME,
            platforms={"npu"},
            capabilities=MOE_CAPABILITIES,
            absent=MOE_ABSENT,
            priority=50,
            factory=build_moe,
            description="npu_moe_gating_top_k routing, npu_grouped_matmul experts",
        )
    ]


@hookimpl
def powertrain_communicators() -> list[CommunicatorRecord]:
    return [
        CommunicatorRecord(
            name="hccl",
            platforms={"npu"},
            priority=20,
            factory=build_communicator,
            dispatcher=build_dispatcher,
            description="torch.distributed on HCCL; expert-parallel exchange by npu_moe_distribute_dispatch/combine",
        )
    ]

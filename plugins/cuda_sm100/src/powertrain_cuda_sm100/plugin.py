"""Registers the pack (entry point ``cuda_sm100``): one attention and one MoE backend.

Both serve the ``cuda`` platform at compute capability >= 9.0 (``support.TARGETS``
lists what each kernel is compiled and tested for: SM100 first, SM90 too). Anywhere
else they load and report unavailable with the reason. No triton import happens
here: the factories import the backends, which import the kernels.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from powertrain import hookimpl
from powertrain.components import AttentionBackendRecord, MoEBackendRecord
from powertrain_cuda_sm100.capabilities import MOE_CAPABILITIES
from powertrain_cuda_sm100.support import availability

if TYPE_CHECKING:
    from powertrain.interfaces import AttentionBackendContext, MoEBackendContext
    from powertrain_cuda_sm100.attention import TritonAttention
    from powertrain_cuda_sm100.moe import TritonMoE

POWERTRAIN_HOOK_API = 1

NAME = "triton-sm100"


def build_attention(context: AttentionBackendContext) -> TritonAttention:
    from powertrain_cuda_sm100.attention import TritonAttention

    return TritonAttention(context)


ATTENTION_CAPABILITIES = frozenset(
    {
        "gqa", "mha", "mla", "sparse-mla", "v4-attention", "lightning-indexer", "paged", "prefill", "decode",
        "chunked-prefill", "sliding-window", "fused-rotary", "fused-rmsnorm", "cuda-graphs",
    }
)  # fmt: skip
#: Paths whose launches still size their KV splits from the batch: not in the invariant variant.
SPLITS_FROM_THE_BATCH = frozenset({"sparse-mla", "v4-attention", "lightning-indexer"})
#: The invariant variant's fixed KV splits per decode row (enough to fill an H200 from ~16 rows).
INVARIANT_SPLITS = 8


def build_invariant_attention(context: AttentionBackendContext) -> TritonAttention:
    from powertrain_cuda_sm100.attention import TritonAttention

    return TritonAttention(context, num_splits=INVARIANT_SPLITS)


def build_moe(context: MoEBackendContext) -> TritonMoE:
    from powertrain_cuda_sm100.moe import TritonMoE

    return TritonMoE(context)


@hookimpl
def powertrain_attention_backends() -> list[AttentionBackendRecord]:
    return [
        AttentionBackendRecord(
            name=NAME,
            platforms={"cuda"},
            capabilities=ATTENTION_CAPABILITIES,
            # Above the builtin torch backends (10, 0): "auto" prefers the kernels where they run.
            priority=50,
            check=availability,
            factory=build_attention,
            description=(
                "Triton paged attention: split-KV decode, flash prefill, absorbed MLA, sparse MLA (V3.2), "
                "V4 window + compressed entries + sinks, the Lightning Indexer's scores; "
                "fused rotary + cache write and RMSNorm"
            ),
        ),
        AttentionBackendRecord(
            name=f"{NAME}-invariant",
            platforms={"cuda"},
            # Its GQA/MLA decode cuts each row's keys into INVARIANT_SPLITS by the row's own
            # length; sparse MLA, V4 and the indexer are left to the invariant torch backend.
            capabilities=(ATTENTION_CAPABILITIES - SPLITS_FROM_THE_BATCH) | {"batch-invariant"},
            priority=40,  # below triton-sm100: "auto" takes it where batch invariance is required
            check=availability,
            factory=build_invariant_attention,
            description=f"triton-sm100 with {INVARIANT_SPLITS} fixed KV splits per decode row: batch-invariant",
        ),
    ]


@hookimpl
def powertrain_moe_backends() -> list[MoEBackendRecord]:
    return [
        MoEBackendRecord(
            name=NAME,
            platforms={"cuda"},
            capabilities=MOE_CAPABILITIES,
            priority=50,
            check=availability,
            factory=build_moe,
            description=(
                "Triton fused MoE: expert-sorted grouped GEMM with SiLU-and-mul and the routing combine fused; "
                "bf16, FP8 e4m3 128-block and packed FP4 (e2m1, ue8m0 per 32) experts"
            ),
        )
    ]

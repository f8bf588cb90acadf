"""The builtin attention backends, registered like any plugin: ``torch-reference``
(the oracle) and ``torch-bucketed`` (the portable default, batched decodes).

Importing this module stays cheap: the implementation is imported by the factory,
when assembly (or the conformance kit) actually builds a backend.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from powertrain import hookimpl
from powertrain.components import AttentionBackendRecord

if TYPE_CHECKING:
    from powertrain.builtin.bucketed_attention import BucketedAttention
    from powertrain.builtin.reference_attention import TorchReferenceAttention
    from powertrain.interfaces import AttentionBackendContext

POWERTRAIN_HOOK_API = 1


def build_reference(context: AttentionBackendContext) -> TorchReferenceAttention:
    # The reference needs nothing from the context: it follows its inputs' device and dtype.
    from powertrain.builtin.reference_attention import TorchReferenceAttention

    return TorchReferenceAttention()


def build_bucketed(context: AttentionBackendContext) -> BucketedAttention:
    from powertrain.builtin.bucketed_attention import BucketedAttention

    return BucketedAttention()


#: What ``torch-bucketed`` serves (a backend extending it starts from these).
BUCKETED_CAPABILITIES = frozenset(
    "gqa mha paged prefill decode chunked-prefill sliding-window non-causal kv-store batch-invariant".split()
)


@hookimpl
def powertrain_attention_backends() -> list[AttentionBackendRecord]:
    return [
        AttentionBackendRecord(
            name="torch-bucketed",
            platforms={"cpu", "cuda"},
            capabilities=BUCKETED_CAPABILITIES,
            priority=10,
            factory=build_bucketed,
            description="plain-torch paged attention with decodes batched by length bucket; portable default",
        ),
        AttentionBackendRecord(
            name="torch-reference",
            platforms={"cpu", "cuda"},
            # torch-bucketed's, and the other layer kinds; batch-invariant as it attends one
            # sequence at a time, so its shapes are its own (kit-checked).
            capabilities=BUCKETED_CAPABILITIES | {"mla", "sparse-mla", "v4-attention", "lightning-indexer"},
            priority=0,
            factory=build_reference,
            description="plain-torch paged attention (GQA/MHA/MLA, sparse MLA, V4, the indexer); the oracle, not fast",
        ),
    ]

"""The builtin ``torch-reference`` attention backend, registered like any plugin.

Importing this module stays cheap: the implementation is imported by the factory,
when assembly (or the conformance kit) actually builds a backend.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from powertrain import hookimpl
from powertrain.components import AttentionBackendRecord

if TYPE_CHECKING:
    from powertrain.builtin.reference_attention import TorchReferenceAttention
    from powertrain.interfaces import AttentionBackendContext

POWERTRAIN_HOOK_API = 1


def build_reference(context: AttentionBackendContext) -> TorchReferenceAttention:
    # The reference needs nothing from the context: it follows its inputs' device and dtype.
    from powertrain.builtin.reference_attention import TorchReferenceAttention

    return TorchReferenceAttention()


@hookimpl
def powertrain_attention_backends() -> list[AttentionBackendRecord]:
    return [
        AttentionBackendRecord(
            name="torch-reference",
            platforms={"cpu", "cuda"},
            capabilities={"gqa", "mha", "mla", "paged", "prefill", "decode", "chunked-prefill", "sliding-window"},
            priority=0,
            factory=build_reference,
            description="plain-torch paged attention (GQA/MHA/MLA); the oracle, not fast",
        )
    ]

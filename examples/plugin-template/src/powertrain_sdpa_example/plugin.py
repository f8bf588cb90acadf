"""Registration: what this plugin provides, and where it can run."""

from __future__ import annotations

from powertrain import hookimpl
from powertrain.components import AttentionBackendRecord

#: The hook API this plugin was written for; powertrain refuses it if unsupported.
POWERTRAIN_HOOK_API = 1


def _build(context):  # noqa: ANN001, ANN202 - AttentionBackendContext -> backend
    # Imported here, not at module level: this is where a vendor SDK would load.
    from powertrain_sdpa_example.backend import SdpaAttention

    return SdpaAttention(context)


@hookimpl
def powertrain_attention_backends() -> list[AttentionBackendRecord]:
    return [
        AttentionBackendRecord(
            name="sdpa",
            platforms={"cpu", "cuda"},
            capabilities={"gqa", "mha", "paged", "prefill", "decode", "chunked-prefill", "sliding-window"},
            # Below the builtin reference (0): an example should not win "auto".
            # A real kernel pack sets a positive priority so "auto" prefers it.
            priority=-10,
            factory=_build,
            description="torch.nn.functional.scaled_dot_product_attention over the paged cache",
        )
    ]

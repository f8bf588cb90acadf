"""The batch-invariance check of the attention kit (``testing.invariance``) can fail: a
backend whose arithmetic follows the batch is refused, one that does not passes."""

from __future__ import annotations

import pytest
import torch

from powertrain.builtin.reference_attention import TorchReferenceAttention
from powertrain.interfaces import AttentionLayerSpec
from powertrain.testing.base import fresh_seed
from powertrain.testing.invariance import check_batch_invariant

MLA = AttentionLayerSpec(
    kind="mla", num_heads=4, num_kv_heads=1, head_size=48, scale=48**-0.5, kv_lora_rank=32, qk_rope_head_dim=16
)
GQA = AttentionLayerSpec(kind="gqa", num_heads=4, num_kv_heads=2, head_size=32, scale=32**-0.5)


class SplitsByBatch(TorchReferenceAttention):
    """Stands for a kernel whose split count follows the batch size: the same sums, rounded
    once more when the batch is larger than one."""

    def forward_mla(self, layer, q_latent, q_rope, latent, k_rope, kv_cache, metadata):  # noqa: ANN001, ANN201
        out = super().forward_mla(layer, q_latent, q_rope, latent, k_rope, kv_cache, metadata)
        return out if metadata.batch_size == 1 else (out.double() * (1 + 2**-20)).to(out.dtype)

    def forward(self, layer, query, key, value, kv_cache, metadata):  # noqa: ANN001, ANN201
        out = super().forward(layer, query, key, value, kv_cache, metadata)
        return out if metadata.batch_size == 1 else (out.double() * (1 + 2**-20)).to(out.dtype)


@pytest.mark.parametrize("layer", [MLA, GQA], ids=["mla", "gqa"])
@pytest.mark.parametrize("target", [(21, 1), (9, 5)], ids=["decode", "chunk"])
def test_the_check_refuses_a_backend_that_follows_the_batch_and_passes_one_that_does_not(
    layer: AttentionLayerSpec, target: tuple[int, int]
) -> None:
    seed = fresh_seed()
    options = {"target": target, "block_size": 8, "dtype": torch.float32, "seed": seed}
    honest = TorchReferenceAttention()
    check_batch_invariant(honest, layer, honest.kv_cache_spec(layer, 8, torch.float32), **options)
    cheat = SplitsByBatch()
    with pytest.raises(AssertionError, match="gives other bits alone than at position"):
        check_batch_invariant(cheat, layer, cheat.kv_cache_spec(layer, 8, torch.float32), **options)

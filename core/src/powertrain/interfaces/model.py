"""The model contract: what an architecture's factory is given, and the decoder the
model runner drives."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import attrs
import torch

from powertrain.interfaces.attention import (
    AttentionBackend,
    AttentionLayerSpec,
    AttentionMetadata,
    LayerKVCache,
    MLAAttentionBackend,
)
from powertrain.interfaces.communication import Communicator, ExpertDispatcher
from powertrain.interfaces.moe import MoEBackend
from powertrain.interfaces.quantized import QuantizedLinearKernel


@attrs.frozen(kw_only=True)
class ModelContext:
    """What a model architecture's factory is given: the checkpoint's config (HF
    ``config.json`` semantics, whatever the file format) and the built components."""

    config: Mapping[str, Any]
    dtype: torch.dtype
    device: torch.device
    attention: AttentionBackend | MLAAttentionBackend
    #: For MoE architectures.
    moe: MoEBackend | None = None
    #: The checkpoint's FP8 block shape when the MoE backend multiplies FP8 experts itself:
    #: the model then keeps routed experts FP8 (and says which tensors through ``keep_fp8``).
    #: None: every weight reaches the model dequantized.
    fp8_block: tuple[int, int] | None = None
    #: The checkpoint's routed experts are packed FP4 and the MoE backend multiplies them
    #: itself (capability ``fp4``): the model keeps them packed (and says which tensors
    #: through ``keep_fp4``). False: they reach the model dequantized.
    fp4_experts: bool = False
    #: The kernel that multiplies quantised weights kept as stored (``[model] quantization``):
    #: the model then receives ``QuantizedWeight`` values for the tensors its ``keep_quantized``
    #: accepts. None: every weight reaches the model dequantized.
    quantized_linear: QuantizedLinearKernel | None = None
    #: For expert parallelism.
    communicator: Communicator | None = None
    #: Expert parallelism: this rank among ``expert_parallel_size``. The model loads and
    #: serves routed experts ``rank·E/size .. (rank+1)·E/size - 1`` and reaches the others'
    #: through ``expert_dispatcher``. Size 1: every expert is local.
    expert_parallel_rank: int = 0
    expert_parallel_size: int = 1
    expert_dispatcher: ExpertDispatcher | None = None
    #: Stored tensor name -> the safetensors file holding it, for tensors a model maps from
    #: the file instead of reading (DeepSeek-V4.1's Engram tables). Empty for GGUF.
    tensor_files: Mapping[str, Path] = attrs.field(factory=dict)
    #: The checkpoint's tokenizer (``powertrain.tokenizer.Tokenizer``), for a model whose
    #: computation depends on token texts (V4.1's Engram normalises them). None: not given.
    tokenizer: Any = None

    def local_experts(self, num_experts: int) -> tuple[int, int]:
        """``(first, count)`` of the routed experts this rank loads and serves."""
        return expert_slice(self.expert_parallel_rank, self.expert_parallel_size, num_experts)


def expert_slice(rank: int, size: int, num_experts: int) -> tuple[int, int]:
    """``(first, count)`` of the routed experts of ``rank`` among ``size`` expert-parallel
    ranks: an even, contiguous split. The model loads this slice and the dispatcher sends
    each expert's tokens to the rank holding it, so both read it from here."""
    if size == 1:
        return 0, num_experts
    if num_experts % size:
        raise ValueError(
            f"the model has {num_experts} routed experts, which expert_parallel={size} does not divide; "
            f"choose an expert_parallel that divides {num_experts}"
        )
    per_rank = num_experts // size
    return rank * per_rank, per_rank


@runtime_checkable
class CausalLM(Protocol):
    """A decoder the model runner drives: one flat batch of tokens per step.

    Optional, found by name: ``keep_quantized(name)`` (which tensors may stay quantised),
    and ``decoder_layer_parts()`` with ``use_fused_decoder(fused)`` (a Llama-shaped stack
    an attention pack may run whole: ``DecoderStackKernel``), and ``captures_decode``: a
    class attribute, True where a decode step's forward may be captured as a CUDA graph
    (``engine.cuda_graphs``: nothing outside the attention and MoE backends reads a value
    back to the host or builds a tensor from host data); ``tap_forms``, the hidden-state
    forms (``interfaces.TAP_FORMS``) its forward can hand a drafter, recorded into the
    ``TapRecorder`` the runner sets as the model's ``taps`` attribute (None: nothing asked);
    ``image_encoder``, an ``interfaces.images.ImageEncoder`` where the model reads images (None
    or absent: text only), whose ``forward`` then takes ``image_rows=`` (``ImageRows``) for
    the steps whose tokens cover image spans.
    """

    @property
    def attention_layers(self) -> Sequence[AttentionLayerSpec]:
        """One entry per attention layer, in order; the engine allocates one cache each."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Take tensors named as in the HF checkpoint; missing or unexpected names raise
        ValueError naming them."""
        ...

    def forward(
        self,
        input_ids: torch.Tensor,  # int64 [num_tokens]
        positions: torch.Tensor,  # int64 [num_tokens], position of each token in its sequence
        kv_caches: Sequence[LayerKVCache],  # one per attention layer
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[rows, hidden]`` -> float32 ``[rows, vocab]`` (only rows that are sampled)."""
        ...

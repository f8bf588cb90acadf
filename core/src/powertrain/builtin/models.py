"""The builtin model architectures, registered like any plugin.

Importing this module stays cheap: a model's implementation is imported by its
factory, when a checkpoint of that architecture is actually loaded.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from powertrain import hookimpl
from powertrain.components import ModelArchitectureRecord

if TYPE_CHECKING:
    from powertrain.interfaces import ModelContext
    from powertrain.models.deepseek_v3 import DeepseekV3ForCausalLM
    from powertrain.models.deepseek_v4 import DeepseekV4ForCausalLM
    from powertrain.models.deepseek_v32 import DeepseekV32ForCausalLM
    from powertrain.models.deepseek_v41 import DeepseekV41ForCausalLM
    from powertrain.models.gemma4 import Gemma4ForCausalLM
    from powertrain.models.llama import LlamaFamilyForCausalLM

POWERTRAIN_HOOK_API = 1

#: config.json model_types that the Llama family builds as Qwen3 (per-head q/k norms, maybe experts).
QWEN3_MODEL_TYPES = ("qwen3", "qwen3_moe")


def build_llama(context: ModelContext) -> LlamaFamilyForCausalLM:
    from powertrain.models.llama import LlamaForCausalLM, Qwen3ForCausalLM

    if context.config.get("model_type") in QWEN3_MODEL_TYPES:
        return Qwen3ForCausalLM(context)
    return LlamaForCausalLM(context)


def llama_requirements(config: Mapping[str, Any]) -> dict[str, set[str]]:
    """Paged GQA attention for prefill (chunked) and decode; a sliding window if any layer
    slides; a MoE backend if any layer routes to experts (Qwen3-MoE)."""
    from powertrain.models.llama import LlamaArgs

    args = LlamaArgs.from_config(config)
    needs: dict[str, set[str]] = {"attention": {"gqa", "paged", "prefill", "decode", "chunked-prefill"}}
    if any(window is not None for window in args.sliding_windows):
        needs["attention"].add("sliding-window")
    if args.sparse is not None:
        needs["moe"] = set()
    return needs


def build_gemma4(context: ModelContext) -> Gemma4ForCausalLM:
    from powertrain.models.gemma4 import Gemma4ForCausalLM

    return Gemma4ForCausalLM(context)


def gemma4_requirements(config: Mapping[str, Any]) -> dict[str, set[str]]:
    """Paged GQA attention for prefill (chunked) and decode, with a sliding window where a
    layer slides (Gemma 4's do unless every layer is full)."""
    from powertrain.models.gemma4 import Gemma4Args

    args = Gemma4Args.from_config(config)
    needs = {"gqa", "paged", "prefill", "decode", "chunked-prefill"}
    if any(layer.sliding_window is not None for layer in args.layers):
        needs.add("sliding-window")
    return {"attention": needs}


def build_deepseek(context: ModelContext) -> DeepseekV3ForCausalLM:
    from powertrain.models.deepseek_v3 import DeepseekV3ForCausalLM

    return DeepseekV3ForCausalLM(context)


def deepseek_requirements(config: Mapping[str, Any]) -> dict[str, set[str]]:
    """Paged MLA attention; a MoE backend when the checkpoint has routed experts."""
    needs: dict[str, set[str]] = {"attention": {"mla", "paged", "prefill", "decode", "chunked-prefill"}}
    if config.get("n_routed_experts") is not None:
        needs["moe"] = set()
    return needs


def build_deepseek_v32(context: ModelContext) -> DeepseekV32ForCausalLM:
    from powertrain.models.deepseek_v32 import DeepseekV32ForCausalLM

    return DeepseekV32ForCausalLM(context)


def deepseek_v32_requirements(config: Mapping[str, Any]) -> dict[str, set[str]]:
    """V3's needs plus sparse MLA: every V3.2 layer attends through its indexer's top-k."""
    needs = deepseek_requirements(config)
    needs["attention"] = needs["attention"] | {"sparse-mla"}
    return needs


def build_deepseek_v4(context: ModelContext) -> DeepseekV4ForCausalLM:
    from powertrain.models.deepseek_v4 import DeepseekV4ForCausalLM

    return DeepseekV4ForCausalLM(context)


def deepseek_v4_requirements(config: Mapping[str, Any]) -> dict[str, set[str]]:
    """A MoE backend with the clamped SwiGLU. Any attention backend will do: the layers use its
    ``forward_v4`` / ``index_topk`` where it declares ``v4-attention`` / ``lightning-indexer``,
    and compute the same in torch where it does not."""
    needs = {"moe": set()}
    if config.get("swiglu_limit") is not None:
        needs["moe"].add("swiglu-limit")
    return {"attention": set(), **needs}


def build_deepseek_v41(context: ModelContext) -> DeepseekV41ForCausalLM:
    from powertrain.models.deepseek_v41 import DeepseekV41ForCausalLM

    return DeepseekV41ForCausalLM(context)


def deepseek_v41_requirements(config: Mapping[str, Any]) -> dict[str, set[str]]:
    """As V4: a MoE backend (with the clamped SwiGLU); any attention backend (its ``forward_v4``
    where it declares ``v4-attention``, the same computation in torch where it does not)."""
    return deepseek_v4_requirements(config.get("text_config", config))


@hookimpl
def powertrain_model_architectures() -> list[ModelArchitectureRecord]:
    return [
        ModelArchitectureRecord(
            name="llama",
            architectures={
                "LlamaForCausalLM",
                "MistralForCausalLM",
                "Qwen2ForCausalLM",
                "Qwen3ForCausalLM",
                "Qwen3MoeForCausalLM",
            },
            factory=build_llama,
            requirements=llama_requirements,
            description="Llama-family decoders: Llama 2/3, SmolLM, Mistral, Qwen2, Qwen3, Qwen3-MoE "
            "(GQA, RoPE scaling, qkv bias, q/k norms, softmax-routed experts)",
        ),
        ModelArchitectureRecord(
            name="gemma4",
            architectures={"Gemma4ForCausalLM", "Gemma4ForConditionalGeneration"},
            factory=build_gemma4,
            requirements=gemma4_requirements,
            description="Gemma 4 text decoders: sliding and full layers with their own head sizes and RoPE, "
            "q/k/v norms, KV sharing across layers, per-layer embeddings, soft-capped logits "
            "(text; the multimodal releases' images and audio are not read)",
        ),
        ModelArchitectureRecord(
            name="deepseek-v3",
            architectures={"DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"},
            factory=build_deepseek,
            requirements=deepseek_requirements,
            description="DeepSeek-V2/V2-Lite/V3/V3.1/R1: MLA with a latent KV cache, DeepSeekMoE, MTP drafter",
        ),
        ModelArchitectureRecord(
            name="deepseek-v32",
            architectures={"DeepseekV32ForCausalLM"},
            factory=build_deepseek_v32,
            requirements=deepseek_v32_requirements,
            description="DeepSeek-V3.2: V3 with DeepSeek Sparse Attention (lightning indexer, sparse MLA)",
        ),
        ModelArchitectureRecord(
            name="deepseek-v4",
            architectures={"DeepseekV4ForCausalLM"},
            factory=build_deepseek_v4,
            requirements=deepseek_v4_requirements,
            description="DeepSeek-V4 (Flash, Pro): sliding-window + compressed (CSA/HCA) attention, mHC, hash MoE",
        ),
        ModelArchitectureRecord(
            name="deepseek-v41",
            architectures={"DeepseekV41ForCausalLM", "DeepseekV41ForConditionalGeneration"},
            factory=build_deepseek_v41,
            requirements=deepseek_v41_requirements,
            description="DeepSeek-V4.1-Flash: compressed KV shared across layers (CSA2), two-level top-k, Engram, "
            "lagged mHC (text; images and its DSpark drafter are not read yet)",
        ),
    ]

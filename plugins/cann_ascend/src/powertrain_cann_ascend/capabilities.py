"""What ascend-cann's backends run: the records declare it and the MoE backend's ``prepare``
refuses experts that need anything else (one module both import, so neither imports the
other). What they do not run, and why, is declared too: a capability is only claimed once
an operator's documented semantics pin down a stand-in the kit can check."""

#: swiglu-limit: DeepSeek-V4's clamped SwiGLU on npu_clipped_swiglu (op-plugin
#: docs/zh/custom_APIs/torch_npu/torch_npu-npu_clipped_swiglu.md pins its formula).
MOE_CAPABILITIES = frozenset({"bf16", "fp16", "fused-routing", "swiglu-limit"})

#: DeepSeek-V3.2's sparse MLA and indexer run on npu_sparse_flash_attention / npu_lightning_indexer.
ATTENTION_CAPABILITIES = frozenset(
    {"gqa", "mha", "mla", "paged", "prefill", "decode", "chunked-prefill", "sparse-mla", "lightning-indexer"}
)
#: DeepSeek-V4 capabilities the attention backend leaves to the torch backends, with why.
ABSENT_ATTENTION = {
    "v4-attention": (
        "no documented torch_npu operator found for attention with per-head sinks over a sliding window "
        "plus compressed entries (DeepSeek-V4): npu_sparse_flash_attention's sinks are not supported on "
        "Atlas A2/A3 and its window arguments take only their defaults; npu_fused_infer_attention_score_v2's "
        "learnable_sink takes a value head of at most 128 (V4's is 512) and no compressed entries; "
        "npu_sparse_attn_sharedkv is a CANN custom op whose README does not pin the sink, window or entry "
        "semantics; V4 layers on this backend compute it in torch"
    ),
}
MOE_ABSENT = {
    "fp4": (
        "no documented torch_npu grouped matmul found for e2m1 weights with ue8m0 scales per 32 columns on "
        "Atlas A2/A3 (npu_grouped_matmul_swiglu_quant_v2 takes float4_e2m1fn_x2 on Ascend 950 only, and its "
        "docs leave the scale blocks' and the packed nibbles' order unstated)"
    ),
}

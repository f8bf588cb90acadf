"""What ascend-cann's backends run: the records declare it and the MoE backend's ``prepare``
refuses experts that need anything else (one module both import, so neither imports the
other). What they do not run, and why, is declared too: a capability is only claimed once
an operator's documented semantics pin down a stand-in the kit can check."""

MOE_CAPABILITIES = frozenset({"bf16", "fp16", "fused-routing"})

#: DeepSeek-V3.2's sparse MLA and indexer run on npu_sparse_flash_attention / npu_lightning_indexer.
ATTENTION_CAPABILITIES = frozenset(
    {"gqa", "mha", "mla", "paged", "prefill", "decode", "chunked-prefill", "sparse-mla", "lightning-indexer"}
)
#: DeepSeek-V4 capabilities the attention backend leaves to the torch backends, with why.
ABSENT_ATTENTION = {
    "v4-attention": (
        "no documented torch_npu operator found for attention with per-head sinks over a sliding window "
        "plus compressed entries (DeepSeek-V4; vllm-ascend's own npu_sparse_attn_sharedkv serves it, but it is "
        "not torch_npu's and has no documented semantics); V4 layers on this backend compute it in torch"
    ),
}
MOE_ABSENT = {
    "fp4": "no documented torch_npu grouped matmul found for e2m1 weights with ue8m0 scales per 32 columns",
    "swiglu-limit": "npu_swiglu, which the experts go through, has no documented clamp; DeepSeek-V4 needs one",
}

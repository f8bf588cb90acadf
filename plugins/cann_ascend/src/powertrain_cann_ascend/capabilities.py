"""What ascend-cann's backends run: the records declare it and the MoE backend's ``prepare``
refuses experts that need anything else (one module both import, so neither imports the
other). What they do not run, and why, is declared too: a capability is only claimed once
an operator's documented semantics pin down a stand-in the kit can check."""

MOE_CAPABILITIES = frozenset({"bf16", "fp16", "fused-routing"})

#: DeepSeek-V3.2/V4 capabilities the attention backend leaves to the torch backends, with why.
ABSENT_ATTENTION = {
    "sparse-mla": (
        "not mapped: npu_sparse_flash_attention (CANN ops-transformer custom op, Atlas A3) is "
        "documented for D=512, D_rope=64, one KV head, attention_mode=2, but the docs found do not say "
        "how -1 padding in sparse_indices is treated or whether sparse_mode=3 masks the listed positions "
        "causally, so no stand-in can be pinned to it"
    ),
    "lightning-indexer": (
        "not mapped: torch.ops.npu.lightning_indexer (Atlas A3) is documented as Top-k of "
        "sum_h W*ReLU(Q K^T), but not what it returns for rows with fewer visible keys than sparse_count, "
        "nor for V4's one key per 4 tokens"
    ),
    "v4-attention": (
        "no documented torch_npu operator found for attention with per-head sinks over a sliding window "
        "plus compressed entries (DeepSeek-V4); V4 layers on this backend compute it in torch"
    ),
}
MOE_ABSENT = {
    "fp4": "no documented torch_npu grouped matmul found for e2m1 weights with ue8m0 scales per 32 columns",
    "swiglu-limit": "npu_swiglu, which the experts go through, has no documented clamp; DeepSeek-V4 needs one",
}

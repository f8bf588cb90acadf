"""What triton-sm100's MoE backend runs: its record declares it and its ``prepare`` refuses
experts that need anything else (one module both import, so neither imports the other)."""

MOE_CAPABILITIES = frozenset({"bf16", "fp16", "fp8-block", "fp4", "swiglu-limit", "cuda-graphs"})

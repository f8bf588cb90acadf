"""Tiny DeepSeek-V4.1 with ``triton-sm100`` attention, against DeepSeek's official exact math.

V4.1's attention is V4's contract (``forward_v4``: a window of raw keys plus listed
compressed entries, sinks, the output de-rotated), so the pack's kernel serves every V4.1
layer: the window-only one, the KV sources over their own entries, and the readers over
their source's (the very tensors, ``CacheGroupSpec.read_from``). V4.1's two-level indexer
has no backend contract yet and runs in torch on every backend. The kernels run under the
Triton interpreter (no GPU here); the oracle is the official code's float32 record in
``core/tests/fixtures/deepseek_v41`` (its README says how it was made).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from powertrain.builtin.grouped_moe import TorchGroupedMoE
from powertrain.components import PlatformInfo
from powertrain.interfaces import AttentionBackendContext, ModelContext
from powertrain.loader import load_checkpoint
from powertrain.models.deepseek_v41 import DeepseekV41ForCausalLM
from powertrain.testing.deepseek_v41 import write_tiny_deepseek_v41
from powertrain.testing.paged import PagedRunner

GOLDEN = Path(__file__).parents[3] / "core" / "tests" / "fixtures" / "deepseek_v41" / "golden.safetensors"
#: Entries per block: a multiple of the largest compress ratio (2).
BLOCK_SIZE = 4
#: Per row, relative to its largest logit: float32 sums of at most 1,024 terms (see the core test).
RELATIVE_TOLERANCE = 1e-4


def test_tiny_deepseek_v41_through_the_triton_backend(tmp_path: Path, interpreter_platform: PlatformInfo) -> None:
    from powertrain_cuda_sm100.attention import TritonAttention

    golden = load_file(GOLDEN)
    checkpoint = load_checkpoint(str(write_tiny_deepseek_v41(tmp_path, seed=0)))
    backend = TritonAttention(
        AttentionBackendContext(
            platform=interpreter_platform, device=torch.device("cpu"), dtype=torch.float32, block_size=BLOCK_SIZE
        )
    )
    rates: list[int | None] = []
    real = backend.forward_v4

    def counting(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - a spy on the real kernel path
        rates.append(kwargs["compress_rate"])
        return real(*args, **kwargs)

    backend.forward_v4 = counting
    context = ModelContext(
        config=checkpoint.config,
        dtype=torch.float32,
        device=torch.device("cpu"),
        attention=backend,
        moe=TorchGroupedMoE(),
        tensor_files=checkpoint.tensor_files,
        tokenizer=checkpoint.tokenizer,
    )
    model = DeepseekV41ForCausalLM(context)
    model.load_weights(checkpoint.tensors(wanted=model.wants_weight))
    runner = PagedRunner(model, backend, block_size=BLOCK_SIZE, num_blocks=48)
    prompt, tokens = golden["main.a.prompt"].tolist(), golden["main.a.tokens"].tolist()[:3]
    rows = [runner.step([("a", prompt)])[0]] + [runner.step([("a", [token])])[0] for token in tokens]
    ours = torch.cat(rows)
    reference = torch.cat([golden["main.a.exact_prefill_logits"], golden["main.a.exact_decode_logits"][:3]]).float()
    error = ((ours - reference).abs().amax(-1) / reference.abs().amax(-1)).max().item()
    print(f"{len(ours)} rows: max |diff| / max |logit| = {error:.2e}")
    assert rates == [None, 2, 2, 1, 1, 1] * (1 + len(tokens)), rates  # every layer through the kernel
    assert error <= RELATIVE_TOLERANCE

"""DeepSeek-V2/V3 against HF transformers, on tiny random checkpoints written per session.

The oracle is transformers' own DeepseekV3ForCausalLM / DeepseekV2ForCausalLM loaded
from the same folder (expanded MLA, its own routing and experts); ours runs the
absorbed form over a paged latent cache with shuffled block ids, through the
builtin reference attention and MoE backends. The MTP drafter is checked against a
float64 computation built from HF's decoder layer. Each session draws fresh weights.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from safetensors.torch import load_file

from powertrain import LLM, SamplingParams
from powertrain.assemble import build_engine
from powertrain.builtin.grouped_moe import TorchGroupedMoE
from powertrain.builtin.reference_attention import TorchReferenceAttention
from powertrain.config import CacheConfig, EngineConfig, ModelConfig
from powertrain.interfaces import ModelContext
from powertrain.layers.rotary import RopeParameters, inverse_frequencies
from powertrain.loader import load_checkpoint
from powertrain.models.deepseek_v3 import DeepseekV3ForCausalLM
from powertrain.testing.base import fresh_seed
from powertrain.testing.checkpoints import quantize_checkpoint_fp8, write_tiny_deepseek
from powertrain.testing.oracle import hf_greedy, hf_logits, startup_event
from powertrain.testing.paged import PagedRunner

VARIANTS = {
    "v3": {"variant": "v3"},
    "v3-no-q-lora": {"variant": "v3", "q_lora_rank": None},
    "v2-lite": {"variant": "v2-lite"},
}
#: Relative to the largest reference logit: float32 rounding through a few layers is ~1e-6.
RELATIVE_TOLERANCE = 1e-4
DECODE_STEPS = 32


@pytest.fixture(scope="module")
def weights_seed() -> int:
    value = fresh_seed()
    print(f"checkpoint seed={value}")
    return value


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory, weights_seed: int) -> dict[str, Path]:
    return {
        name: write_tiny_deepseek(tmp_path_factory.mktemp(name), seed=weights_seed, **kwargs)
        for name, kwargs in VARIANTS.items()
    }


def cpu_context(checkpoint: Any, fp8_block: tuple[int, int] | None = None) -> ModelContext:
    """float32 on CPU through the builtin reference attention and MoE backends."""
    return ModelContext(
        config=checkpoint.config,
        dtype=torch.float32,
        device=torch.device("cpu"),
        attention=TorchReferenceAttention(),
        moe=TorchGroupedMoE(),
        fp8_block=fp8_block,
    )


def load_ours(path: Path) -> DeepseekV3ForCausalLM:
    checkpoint = load_checkpoint(str(path))
    model = DeepseekV3ForCausalLM(cpu_context(checkpoint))
    model.load_weights(checkpoint.tensors())
    return model


def load_hf(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def assert_close(ours: torch.Tensor, reference: torch.Tensor, what: str) -> None:
    error = ((ours - reference).abs().max() / reference.abs().max()).item()
    assert error <= RELATIVE_TOLERANCE, f"{what}: logits off by {error:.2e} of the largest logit"


def vocab(path: Path) -> int:
    return json.loads((path / "config.json").read_text())["vocab_size"]


# --------------------------------------------------------------------------- against HF


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no-prefix-cache", "prefix-cache"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_match_hf_over_prefill_and_decode(
    checkpoints: dict[str, Path], variant: str, prefix_caching: bool, seed: int
) -> None:
    path = checkpoints[variant]
    ours, hf = load_ours(path), load_hf(path)
    prompt = torch.randint(0, vocab(path), (23,)).tolist()
    neighbour = torch.randint(0, vocab(path), (9,)).tolist()
    runner = PagedRunner(ours, TorchReferenceAttention(), block_size=4, num_blocks=64)
    skip = 0
    if prefix_caching:
        # An earlier request with the same first 18 tokens left its full blocks behind.
        runner.step([("earlier", prompt[:18] + neighbour)])
        skip = runner.share_prefix("s", "earlier", 18)
        assert skip == 16
    next_neighbour = int(torch.randint(0, vocab(path), ()).item())
    ours_logits, generated = runner.greedy_beside_a_neighbour(
        prompt, neighbour, [next_neighbour] * (DECODE_STEPS - 1), skip=skip
    )
    reference = hf_logits(hf, prompt + generated[:-1])[skip:]
    assert_close(ours_logits, reference, f"{variant} prefill + {DECODE_STEPS} decodes (seed={seed})")
    assert generated == hf_greedy(hf, prompt, DECODE_STEPS), f"{variant}: greedy continuation differs (seed={seed})"


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no-prefix-cache", "prefix-cache"])
def test_engine_greedy_continuations_equal_hf(checkpoints: dict[str, Path], prefix_caching: bool, seed: int) -> None:
    """The whole engine (scheduler, block manager, prefix cache, sampler) on the v3 model."""
    path = checkpoints["v3"]
    hf = load_hf(path)
    shared = torch.randint(0, vocab(path), (40,)).tolist()
    prompts = [shared + torch.randint(0, vocab(path), (n,)).tolist() for n in (3, 11, 6)]
    params = SamplingParams(temperature=0, max_tokens=DECODE_STEPS, ignore_eos=True)
    with LLM(str(path), dtype="float32", prefix_caching=prefix_caching, block_size=8, num_blocks=128) as llm:
        first = llm.generate(prompts[:1], params)
        rest = llm.generate(prompts[1:], params)
    outputs = first + rest
    if prefix_caching:
        assert all(o.num_cached_tokens == 40 for o in rest), [o.num_cached_tokens for o in rest]
    for prompt, output in zip(prompts, outputs, strict=True):
        assert list(output.outputs[0].token_ids) == hf_greedy(hf, prompt, DECODE_STEPS), f"seed={seed}"


def test_batch_invariant_engine_gives_a_request_the_same_tokens_alone_and_among_16(
    checkpoints: dict[str, Path], seed: int
) -> None:
    """``[engine] batch_invariant``: MLA through torch-reference, the experts through
    torch-grouped-invariant (both kit-checked for bit-equal rows) and the model's own
    matmuls in row tiles: greedy and seeded tokens, and their logprobs bit for bit, alone
    equal those in a batch of 16 mixed prompts."""
    path = checkpoints["v3"]
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, vocab(path), (int(torch.randint(1, 40, (1,), generator=gen)),)).tolist()
               for _ in range(16)]  # fmt: skip
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    sampled = [SamplingParams(temperature=1.0, max_tokens=8, seed=seed + i, ignore_eos=True) for i in range(16)]
    # No prefix cache: a hit would cut the prompt's prefill into another chunk, which is a
    # different computation (the attention's query rows in other matmul shapes), not another batch.
    with LLM(
        str(path), dtype="float32", batch_invariant=True, prefix_caching=False, block_size=8, num_blocks=256
    ) as llm:
        modules = list(llm.engine.runner.model.modules())
        backends = {type(getattr(m, "backend", None)).__name__ for m in modules}
        tiles = {getattr(m.backend, "row_tile", None) for m in modules if hasattr(m, "backend")}
        assert {"TorchReferenceAttention", "TorchGroupedMoE"} <= backends and 16 in tiles, (backends, tiles)
        together = [o.outputs[0] for o in llm.generate(prompts, greedy)]
        together_sampled = [o.outputs[0].token_ids for o in llm.generate(prompts, sampled)]
        for i in (0, 7, 15):
            [alone] = llm.generate([prompts[i]], greedy)
            assert alone.outputs[0].token_ids == together[i].token_ids, f"greedy, prompt {i} (seed={seed})"
            assert alone.outputs[0].logprobs == together[i].logprobs, f"logprobs, prompt {i} (seed={seed})"
            [alone] = llm.generate([prompts[i]], sampled[i])
            assert alone.outputs[0].token_ids == together_sampled[i], f"seeded, prompt {i} (seed={seed})"


# --------------------------------------------------------------------------- KV memory


def test_kv_cache_holds_only_latent_and_rope(checkpoints: dict[str, Path]) -> None:
    path = checkpoints["v3"]
    config = json.loads((path / "config.json").read_text())
    layers, rank, rope = config["num_hidden_layers"], config["kv_lora_rank"], config["qk_rope_head_dim"]
    engine = build_engine(
        EngineConfig(model=ModelConfig(path=str(path), dtype="float32"), cache=CacheConfig(num_blocks=32))
    )
    try:
        caches = engine.runner.kv_caches
        assert len(caches) == layers
        total = sum(t.nbytes for cache in caches for t in cache.values())
        assert {name for cache in caches for name in cache} == {"latent", "rope"}
        per_token = total // (32 * engine.block_manager.block_size)
        assert per_token == (rank + rope) * layers * 4
        heads, qk, v = config["num_attention_heads"], config["qk_nope_head_dim"] + rope, config["v_head_dim"]
        naive = engine.runner.model.naive_kv_bytes_per_token(torch.float32)
        assert naive == heads * (qk + v) * layers * 4
        assert per_token * 4 == naive  # this tiny shape: 4x smaller
    finally:
        engine.shutdown()


def test_generate_startup_log_states_both_cache_sizes(checkpoints: dict[str, Path]) -> None:
    path = checkpoints["v3"]
    kv = startup_event(path, "kv cache")
    config = json.loads((path / "config.json").read_text())
    latent_and_rope = config["kv_lora_rank"] + config["qk_rope_head_dim"]
    assert kv["bytes_per_token"] == latent_and_rope * config["num_hidden_layers"] * 4
    assert kv["dense_bytes_per_token"] > kv["bytes_per_token"]


# --------------------------------------------------------------------------- rope


@pytest.mark.parametrize(
    "rope",
    [
        {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 128,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        {
            "rope_type": "yarn",
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
        },
        {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "beta_fast": 16, "beta_slow": 2},
    ],
)
def test_yarn_frequencies_and_attention_factor_equal_hf(rope: dict[str, Any]) -> None:
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = DeepseekV3Config(rope_parameters={**rope, "rope_theta": 10000.0}, max_position_embeddings=512)
    want, factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    params = RopeParameters.from_config(config.to_dict())
    assert torch.equal(inverse_frequencies(params, config.qk_rope_head_dim), want)
    with torch.device("meta"):  # models are built under their device (cuda on a GPU): the table stays on the CPU
        assert torch.equal(inverse_frequencies(params, config.qk_rope_head_dim), want)
    from powertrain.layers.rotary import attention_factor

    assert attention_factor(params) == pytest.approx(factor, rel=1e-12)


# --------------------------------------------------------------------------- MTP


def checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def hf_block_state(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """A decoder layer's tensors in HF's module layout (routed experts fused per layer)."""
    state = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
    experts = sorted({int(k.split(".")[2]) for k in state if k.startswith("mlp.experts.")})
    if experts:

        def stacked(part: str) -> torch.Tensor:
            return torch.stack([state.pop(f"mlp.experts.{e}.{part}.weight") for e in experts])

        gate, up, down = stacked("gate_proj"), stacked("up_proj"), stacked("down_proj")
        state["mlp.experts.gate_up_proj"] = torch.cat([gate, up], dim=1)
        state["mlp.experts.down_proj"] = down
    return state


def rms_norm64(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


def test_mtp_drafter_equals_float64_formula(checkpoints: dict[str, Path], seed: int) -> None:
    """Depth 0 predicts t_{i+2} from the target's final hidden state h_i and token t_{i+1}:
    logits = head(norm(block(eh_proj([enorm(embed(t_{i+1})); hnorm(h_i)])))), the block
    attending causally over the MTP positions. The reference runs HF's decoder layer in
    float64 on the checkpoint's MTP tensors; ours runs prefill then decodes over its cache."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RotaryEmbedding

    path = checkpoints["v3"]
    ours = load_ours(path)
    assert ours.mtp is not None and len(ours.mtp.attention_layers) == 1
    n = 17
    tokens = torch.randint(0, vocab(path), (n + 1,)).tolist()
    target = PagedRunner(ours, TorchReferenceAttention(), block_size=4, num_blocks=32)
    metadata, positions = target.metadata([("s", tokens[:n])])
    with torch.inference_mode():
        hidden = ours(torch.tensor(tokens[:n]), positions, target.caches, metadata)

    drafter = PagedRunner(ours.mtp, TorchReferenceAttention(), block_size=4, num_blocks=32)
    next_tokens = torch.tensor(tokens[1:])
    rows = []
    chunks = [(0, n - 3), (n - 3, n - 2), (n - 2, n - 1), (n - 1, n)]  # a prefill, then decodes
    for start, end in chunks:
        meta, pos = drafter.metadata([("s", tokens[1 + start : 1 + end])])
        with torch.inference_mode():
            out = ours.mtp(0, next_tokens[start:end], pos, hidden[start:end], drafter.caches[0], meta)
            rows.append(ours.mtp.compute_logits(0, out))
    ours_logits = torch.cat(rows)

    config = DeepseekV3Config.from_pretrained(str(path))
    config._attn_implementation = "eager"
    layer = config.num_hidden_layers
    tensors = checkpoint_tensors(path)
    prefix = f"model.layers.{layer}."
    own = {
        k: tensors.pop(prefix + k)
        for k in [k[len(prefix) :] for k in list(tensors) if k.startswith(prefix)]
        if k.startswith(("enorm.", "hnorm.", "eh_proj.", "shared_head.", "embed_tokens."))
    }
    block = DeepseekV3DecoderLayer(config, layer_idx=layer).double().eval()
    block.load_state_dict({k: v.double() for k, v in hf_block_state(tensors, prefix).items()})
    eps = config.rms_norm_eps
    embedded = rms_norm64(own["embed_tokens.weight"].double()[next_tokens], own["enorm.weight"], eps)
    mixed = torch.cat([embedded, rms_norm64(hidden.double(), own["hnorm.weight"], eps)], dim=-1)
    x = mixed @ own["eh_proj.weight"].double().T
    position_ids = torch.arange(n)[None]
    cos, sin = DeepseekV3RotaryEmbedding(config)(x[None], position_ids)
    mask = torch.full((n, n), float("-inf"), dtype=torch.float64).triu(1)[None, None]
    with torch.no_grad():
        out = block(x[None], attention_mask=mask, position_ids=position_ids, position_embeddings=(cos, sin))[0]
    reference = rms_norm64(out, own["shared_head.norm.weight"], eps) @ own["shared_head.head.weight"].double().T
    assert_close(ours_logits.double(), reference, f"MTP depth 0 (seed={seed})")


# --------------------------------------------------------------------------- FP8


def rewritten_copy(original: Path, destination: Path, fp8: Path, weight: Any) -> Path:
    """``original`` with every weight the FP8 checkpoint quantized replaced by
    ``weight(original_tensor, fp8_tensor, scale_inv, block)``."""
    import shutil

    from safetensors.torch import save_file

    block = tuple(json.loads((fp8 / "config.json").read_text())["quantization_config"]["weight_block_size"])
    quantized = checkpoint_tensors(fp8)
    shutil.copytree(original, destination)
    for file in destination.glob("*.safetensors"):
        tensors = load_file(file)
        for name, tensor in tensors.items():
            scale = quantized.get(f"{name}_scale_inv")
            if scale is not None:
                tensors[name] = weight(tensor, quantized[name], scale, block).float()
        save_file(tensors, str(file), metadata={"format": "pt"})
    return destination


def dequantize64(
    original: torch.Tensor, fp8: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    """The FP8 weight times its block scales, computed here (float64, torch.kron),
    independently of the loader."""
    rows, cols = fp8.shape
    return fp8.double() * torch.kron(scale.double(), torch.ones(block, dtype=torch.float64))[:rows, :cols]


def relative_drift(logits: torch.Tensor, reference: torch.Tensor) -> float:
    return ((logits - reference).norm() / reference.norm()).item()


def test_fp8_checkpoint_loads_with_its_scales(checkpoints: dict[str, Path], tmp_path: Path, seed: int) -> None:
    """An FP8 block-quantized checkpoint must give exactly the logits of its dequantized
    weights (float32 rounding only), and move the original's logits no more than FP8
    rounding implies.

    The bound: e4m3 keeps 3 mantissa bits, so rounding moves each weight by up to 2^-4
    of itself. A random model this small is chaotic (routing flips, no training to
    make it smooth), so no fixed logit tolerance would mean anything; instead the same
    weights get independent uniform noise of that size, w * (1 + U(-2^-4, 2^-4)), and
    the FP8 logits may drift at most twice as far as that noise moves them (mean of
    three draws). A wrong scale or a weight quantized twice lands far outside."""
    original = checkpoints["v3"]
    fp8 = quantize_checkpoint_fp8(original, tmp_path / "fp8")
    assert load_checkpoint(str(fp8)).fp8_block == (128, 128)
    ours = load_ours(fp8)
    tokens = torch.randint(0, vocab(original), (30,)).tolist()
    got = PagedRunner(ours, TorchReferenceAttention()).step([("s", tokens)])[0]
    dequantized = rewritten_copy(original, tmp_path / "dequantized", fp8, dequantize64)
    assert_close(
        got, hf_logits(load_hf(dequantized), tokens), f"FP8 checkpoint vs its dequantized weights (seed={seed})"
    )

    unquantized = hf_logits(load_hf(original), tokens)
    noise_drifts = []
    for draw in range(3):
        generator = torch.Generator().manual_seed(seed + draw)

        def noisy(w: torch.Tensor, *_: Any, generator: torch.Generator = generator) -> torch.Tensor:
            return w.double() * (1 + (torch.rand(w.shape, generator=generator, dtype=torch.float64) * 2 - 1) / 16)

        noisy_logits = hf_logits(load_hf(rewritten_copy(original, tmp_path / f"noise{draw}", fp8, noisy)), tokens)
        noise_drifts.append(relative_drift(noisy_logits, unquantized))
    drift, noise = relative_drift(got, unquantized), sum(noise_drifts) / len(noise_drifts)
    print(f"FP8 logits drift {drift:.3f}, FP8-sized noise drift {noise:.3f} (relative L2)")
    assert 0 < drift <= 2 * noise, f"FP8 drift {drift:.3f} vs noise {noise:.3f} (seed={seed})"


def test_fp8_experts_kept_for_a_backend_that_multiplies_fp8(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """With ``ModelContext.fp8_block`` the routed experts stay float8 + block scales (the
    loader passes them through ``keep_fp8``) and the backend dequantizes per use; the
    logits equal loading everything dequantized. 32x32 blocks: the tiny experts'
    intermediate size (64) must be whole blocks for gate and up to stack."""
    fp8 = quantize_checkpoint_fp8(checkpoints["v3"], tmp_path / "fp8", block=(32, 32))
    checkpoint = load_checkpoint(str(fp8))
    context = cpu_context(checkpoint, fp8_block=checkpoint.fp8_block)
    kept = DeepseekV3ForCausalLM(context)
    kept.load_weights(checkpoint.tensors(keep_fp8=kept.keep_fp8))
    experts = kept.model.layers[1].mlp.experts.prepared
    assert experts.w13.dtype == torch.float8_e4m3fn and experts.block_shape == (32, 32)
    assert experts.w13_scale.shape == (8, 2 * 64 // 32, 256 // 32)
    tokens = torch.randint(0, vocab(fp8), (20,)).tolist()
    got = PagedRunner(kept, TorchReferenceAttention()).step([("s", tokens)])[0]
    want = PagedRunner(load_ours(fp8), TorchReferenceAttention()).step([("s", tokens)])[0]
    assert_close(got, want, "FP8-kept experts vs dequantized at load")
    with pytest.raises(ValueError, match="multiple of 128"):
        DeepseekV3ForCausalLM(attrs.evolve(context, fp8_block=(128, 128)))


def test_load_weights_names_missing_and_unexpected_tensors(checkpoints: dict[str, Path]) -> None:
    checkpoint = load_checkpoint(str(checkpoints["v3"]))
    context = cpu_context(checkpoint)
    tensors = list(checkpoint.tensors())
    without_expert = [(n, t) for n, t in tensors if n != "model.layers.1.mlp.experts.3.up_proj.weight"]
    with pytest.raises(ValueError, match=r"mlp\.experts\.3\.up_proj\.weight"):
        DeepseekV3ForCausalLM(context).load_weights(without_expert)
    without_norm = [(n, t) for n, t in tensors if n != "model.layers.0.input_layernorm.weight"]
    with pytest.raises(ValueError, match=r"missing tensors: model\.layers\.0\.input_layernorm\.weight"):
        DeepseekV3ForCausalLM(context).load_weights(without_norm)
    extra = [*tensors, ("model.layers.0.self_attn.surprise.weight", torch.ones(2))]
    with pytest.raises(ValueError, match=r"unexpected tensors: model\.layers\.0\.self_attn\.surprise\.weight"):
        DeepseekV3ForCausalLM(context).load_weights(extra)
    wrong = [(n, t[:-1] if n == "model.norm.weight" else t) for n, t in tensors]
    with pytest.raises(ValueError, match=r"'model\.norm\.weight' has shape"):
        DeepseekV3ForCausalLM(context).load_weights(wrong)

"""DeepSeek's DSpark block drafter (``[dspark] drafter = "block"``) on a tiny Qwen3 target.

The drafter is a tiny random DeepSpec checkpoint (``write_tiny_deepspec_drafter``); a
"mimic" copy has its Markov head rewritten to predict the target's own greedy bigrams,
so its drafts are accepted often and rejected often, by construction. Checked here:

- every proposal the engine's drafter makes equals the drafter computed from scratch by
  a dense float64 implementation below (written from DeepSpec's modeling code and fed
  transformers' hidden states of the target): the context entries were written from the
  right rows through chunked prefill, accepted and rejected drafts, preemption and
  prefix-cache hits;
- greedy speculation gives plain decoding's tokens;
- sampled speculation (drafts drawn one after another from the Markov-corrected block
  distribution, which verification gets as q) keeps the target's law at temperatures 0.6
  and 1.0 with top-p (chi-square over the first two tokens), and a control that hands
  verification the distribution before the Markov bias fails the same test;
- a drafter that does not fit the target, or no drafter folder, is refused with the reason;
- on a tiny Gemma 4 target (sliding and full layers, KV sharing, soft-capped logits) DeepSpec's
  Gemma 4 drafter speculates too, and greedy runs give plain decoding's tokens.

DeepSpec's own code is checked against in ``test_deepspec_fixtures.py`` (Qwen3) and
``test_deepspec_gemma4_fixtures.py`` (Gemma 4).
"""

from __future__ import annotations

import json
import math
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import pytest
import structlog
import structlog.testing
import torch
import transformers
from safetensors.torch import load_file, save_file

import powertrain.assemble.building as building
from powertrain import LLM, SamplingParams
from powertrain.assemble.planning import plan
from powertrain.config import EngineConfig
from powertrain.interfaces import target_probs
from powertrain.layers.linear import Linear
from powertrain.llm import apply_overrides
from powertrain.models.dspark import BlockDrafterModel
from powertrain.testing import sampling_law, write_tiny_deepspec_drafter, write_tiny_gemma4, write_tiny_qwen3
from powertrain.testing.base import fresh_seed
from powertrain.testing.drafters import spy_on_block_drafts
from powertrain.testing.sampling_law import SIGNIFICANCE
from powertrain_dspark import block as block_module
from powertrain_dspark.block import BlockDrafter
from powertrain_dspark.plugin import DSparkConfig

PROFILE = [1, 2]
#: The module's checkpoints' seed (set by their fixture; failure messages name it).
CHECKPOINT_SEED = [0]
#: Draft argmaxes closer than this may differ between two correct runs (float32 rounding).
TIE = 1e-4
DRAFT_BLOCK = 7


@pytest.fixture
def seed() -> int:
    value = fresh_seed()
    print(f"seed={value}")
    return value


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    seed = fresh_seed()
    print(f"checkpoint seed={seed}")
    CHECKPOINT_SEED[0] = seed
    target = write_tiny_qwen3(tmp_path_factory.mktemp("target"), seed=seed, num_hidden_layers=4)
    drafter = write_tiny_deepspec_drafter(
        tmp_path_factory.mktemp("drafter"), target, seed=seed + 1, block_size=DRAFT_BLOCK
    )
    return {"target": target, "drafter": drafter}


@pytest.fixture(scope="module")
def hf_target(checkpoints: dict[str, Path]) -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(str(checkpoints["target"]), dtype=torch.float32).eval()


def engine_config(
    checkpoints: dict[str, Path], speculative: str, drafter: str = "drafter", **settings: Any
) -> EngineConfig:
    dspark = {
        "drafter": "block",
        "draft_model": str(checkpoints[drafter]),
        "profile_sequences": PROFILE,
        "max_draft_tokens": DRAFT_BLOCK,
        **settings.pop("dspark", {}),
    }
    base = {"path": str(checkpoints["target"]), "dtype": "float32", "speculative": speculative, "block_size": 4}
    config = apply_overrides(EngineConfig(), {**base, **settings})
    return attrs.evolve(config, sections={"dspark": dspark}) if speculative != "none" else config


def prompts(seed: int, lengths: Sequence[int] = (3, 11, 29, 45)) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 500, (n,), generator=generator).tolist() for n in lengths]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def generate(config: EngineConfig, batch: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    with LLM(config=config) as llm:
        return [list(o.outputs[0].token_ids) for o in llm.generate(batch, params)]


# --------------------------------------------------------------------------- the oracle


class ScratchDrafter:
    """The DSpark block drafter in dense float64 from its safetensors, as DeepSpec's
    ``Qwen3DSparkModel`` computes a block at inference (context keys/values from the
    projected target hidden states, non-causal attention, Markov and confidence heads)."""

    def __init__(self, folder: Path) -> None:
        self.config = json.loads((folder / "config.json").read_text())
        self.w = {name: t.double() for name, t in load_file(str(folder / "model.safetensors")).items()}
        c = self.config
        self.heads, self.kv_heads, self.head_dim = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        self.eps = c["rms_norm_eps"]
        theta = c.get("rope_parameters", {}).get("rope_theta", c.get("rope_theta", 10000.0))
        self.inv_freq = 1.0 / theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float64) / self.head_dim)

    def norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.w[name]

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # x [n, heads, dim]
        angles = positions[:, None].double() * self.inv_freq[None, :]
        cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None], torch.cat([angles.sin()] * 2, -1)[:, None]
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * cos + rotated * sin

    def block(self, taps: Sequence[torch.Tensor], tokens: Sequence[int], anchor: int) -> dict[str, torch.Tensor]:
        """``taps``: the target's tapped layer outputs over positions < anchor."""
        w, size = self.w, self.config["block_size"]
        context = self.norm(torch.cat([t.double() for t in taps], -1) @ w["fc.weight"].T, "hidden_norm.weight")
        ids = torch.tensor([tokens[anchor]] + [self.config["mask_token_id"]] * (size - 1))
        hidden = w["embed_tokens.weight"][ids]
        positions = torch.arange(anchor + size)
        group = self.heads // self.kv_heads
        for i in range(self.config["num_hidden_layers"]):
            p = f"layers.{i}."
            x = self.norm(hidden, p + "input_layernorm.weight")
            q = (x @ w[p + "self_attn.q_proj.weight"].T).view(size, self.heads, self.head_dim)
            q = self.rope(self.norm(q, p + "self_attn.q_norm.weight"), positions[anchor:])
            sources = torch.cat([context, x])
            k = (sources @ w[p + "self_attn.k_proj.weight"].T).view(-1, self.kv_heads, self.head_dim)
            k = self.rope(self.norm(k, p + "self_attn.k_norm.weight"), positions)
            v = (sources @ w[p + "self_attn.v_proj.weight"].T).view(-1, self.kv_heads, self.head_dim)
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
            scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(self.head_dim)
            attended = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(size, -1)
            hidden = hidden + attended @ w[p + "self_attn.o_proj.weight"].T
            x = self.norm(hidden, p + "post_attention_layernorm.weight")
            gate, up = x @ w[p + "mlp.gate_proj.weight"].T, x @ w[p + "mlp.up_proj.weight"].T
            hidden = hidden + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
        hidden = self.norm(hidden, "norm.weight")
        return {"hidden": hidden, "base": hidden @ w["lm_head.weight"].T}

    def markov(self, previous: int, hidden: torch.Tensor) -> torch.Tensor:
        w = self.w
        if "markov_head.markov_w1.weight" not in w:
            return torch.zeros(w["lm_head.weight"].shape[0], dtype=torch.float64)
        embedded = w["markov_head.markov_w1.weight"][previous]
        if "markov_head.gate_proj.weight" in w:
            gate = torch.cat([hidden, embedded]) @ w["markov_head.gate_proj.weight"].T + w["markov_head.gate_proj.bias"]
            embedded = torch.sigmoid(gate) * embedded
        return embedded @ w["markov_head.markov_w2.weight"].T

    def confidence(self, previous: int, hidden: torch.Tensor) -> float:
        w = self.w
        features = hidden
        if self.config.get("confidence_head_with_markov"):
            features = torch.cat([hidden, w["markov_head.markov_w1.weight"][previous]])
        logit = features @ w["confidence_head.proj.weight"][0] + w["confidence_head.proj.bias"][0]
        return float(torch.sigmoid(logit))

    def greedy_drafts(
        self, taps: Sequence[torch.Tensor], tokens: Sequence[int], anchor: int, count: int
    ) -> tuple[list[int], list[float], list[float]]:
        """Drafts, confidences and each draft's top-two logit margin."""
        out = self.block(taps, tokens, anchor)
        drafts, confidences, margins = [], [], []
        previous = tokens[anchor]
        for k in range(count):
            logits = out["base"][k] + self.markov(previous, out["hidden"][k])
            top = logits.topk(2).values
            confidences.append(self.confidence(previous, out["hidden"][k]))
            previous = int(logits.argmax())
            drafts.append(previous)
            margins.append(float(top[0] - top[1]))
        return drafts, confidences, margins


def tapped(hf: Any, tokens: Sequence[int], layers: Sequence[int]) -> list[torch.Tensor]:
    """transformers' outputs of the tapped layers at every position of ``tokens``."""
    with torch.no_grad():
        states = hf(torch.tensor([list(tokens)]), output_hidden_states=True).hidden_states
    return [states[layer + 1][0] for layer in layers]


def mimic(folder: Path, out: Path, bigrams: dict[int, int], strength: float = 40.0) -> Path:
    """A copy of the drafter whose Markov head predicts ``bigrams`` (previous -> next token)
    for as many previous tokens as its rank allows: drafts the target often accepts."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text((folder / "config.json").read_text())
    tensors = load_file(str(folder / "model.safetensors"))
    w1, w2 = tensors["markov_head.markov_w1.weight"], tensors["markov_head.markov_w2.weight"]
    w1.zero_()
    w2.zero_()
    for slot, (previous, following) in enumerate(list(bigrams.items())[: w1.shape[1]]):
        w1[previous, slot] = 1.0
        w2[following, slot] = strength
    save_file(tensors, str(out / "model.safetensors"))
    return out


# --------------------------------------------------------------------------- proposals


@pytest.fixture(scope="module")
def plain(checkpoints: dict[str, Path]) -> dict[int, list[list[int]]]:
    """Plain decoding's greedy tokens, per prompt seed (memoised)."""
    return {}


def plain_tokens(plain: dict, checkpoints: dict[str, Path], seed: int, batch: list[list[int]], n: int) -> list:
    if seed not in plain:
        plain[seed] = generate(engine_config(checkpoints, "none"), batch, [greedy(n)] * len(batch))
    return plain[seed]


@pytest.mark.parametrize("case", ["chunked", "preempted", "prefix-hit", "overlapped"])
def test_every_proposal_equals_the_drafter_from_scratch(
    checkpoints: dict[str, Path], hf_target: Any, plain: dict, case: str, seed: int, tmp_path: Path
) -> None:
    """Proposals of the engine's drafter against the dense oracle over the sequence so
    far (drafts up to the first near tie, confidences through it), and greedy outputs
    equal to plain decoding's. Preemption recomputes a sequence's entries; a prefix hit
    reads entries another sequence wrote; overlapped steps (async scheduling) draft on the
    device thread after the step before, as synchronous ones do."""
    batch = prompts(seed)
    if case == "prefix-hit":  # the later prompts extend the first, which runs alone first
        batch = [batch[3]] + [batch[3] + extra for extra in batch[:3]]
    expected = plain_tokens(plain, checkpoints, seed if case != "prefix-hit" else -seed, batch, 24)
    bigrams = {a: b for out in expected for a, b in zip(out, out[1:], strict=False)}
    checkpoints = {**checkpoints, "mimic": mimic(checkpoints["drafter"], tmp_path / "mimic", bigrams)}
    settings: dict[str, Any] = {"max_num_batched_tokens": 24, "prefix_caching": case == "prefix-hit"}
    if case == "overlapped":
        settings["speculative_overlap"] = "on"
    if case == "preempted":
        settings["num_blocks"] = 26  # 104 tokens: too few for every sequence at once
    config = engine_config(checkpoints, "fixed-k", "mimic", **settings)
    with LLM(config=config) as llm:
        drafter = llm.speculative_policy.drafter  # type: ignore[union-attr]
        assert isinstance(drafter, BlockDrafter)
        for cache in drafter.caches:  # an entry never written would show as NaN
            for tensor in cache.values():
                tensor.fill_(float("nan"))
        drafted = spy_on_block_drafts(drafter)
        params = [greedy(24)] * len(batch)
        if case == "prefix-hit":
            got = [list(llm.generate(batch[:1], params[:1])[0].outputs[0].token_ids)]
            got += [list(o.outputs[0].token_ids) for o in llm.generate(batch[1:], params[1:])]
        else:
            got = [list(o.outputs[0].token_ids) for o in llm.generate(batch, params)]
        stats, overlapped = llm.engine.stats(), llm.engine.runner.overlapped_steps
    proposals = drafted()  # the drafts each step's rule drew
    where = f"{case}, seed={seed}, checkpoint seed={CHECKPOINT_SEED[0]}"
    assert (overlapped > 0) == (case == "overlapped"), where
    assert got == expected, where
    assert stats.speculative_accepted_tokens > 0, where
    assert stats.speculative_verified_tokens > stats.speculative_accepted_tokens, where
    if case == "preempted":
        assert stats.preemptions > 0, where
    if case == "prefix-hit":
        assert stats.prefix_cache_hit_tokens > 0, where
    oracle = ScratchDrafter(checkpoints["mimic"])
    layers = oracle.config["target_layer_ids"]
    sequences = [p + out for p, out in zip(batch, expected, strict=True)]
    taps = [tapped(hf_target, tokens, layers) for tokens in sequences]
    checked = 0
    for history, drafts, confidences in proposals:
        if not drafts:
            continue
        index = next(i for i, tokens in enumerate(sequences) if tokens[: len(history)] == history)
        anchor = len(history) - 1
        context = [t[:anchor] for t in taps[index]]
        want, want_confidences, margins = oracle.greedy_drafts(context, history, anchor, len(drafts))
        tie = next((k for k, margin in enumerate(margins) if margin < TIE), len(drafts))
        at = f"{where}, history of {len(history)} tokens"
        assert drafts[:tie] == want[:tie], at
        assert confidences[: tie + 1] == pytest.approx(want_confidences[: tie + 1], rel=1e-4, abs=1e-6), at
        checked += 1
    assert checked > 10, f"only {checked} proposals had drafts ({where})"


def test_a_drafter_kept_as_q8_keeps_plain_decodings_tokens(
    checkpoints: dict[str, Path], plain: dict, seed: int, tmp_path: Path
) -> None:
    """``[dspark] draft_quantization = "q8"``: every linear of the drafter but the target's
    head (shared, so unused) multiplies 8-bit codes through the platform's kernel; outputs
    stay plain decoding's, and a drafter that predicts still gets drafts accepted."""
    batch = prompts(seed)
    expected = plain_tokens(plain, checkpoints, seed, batch, 24)
    bigrams = {a: b for out in expected for a, b in zip(out, out[1:], strict=False)}
    checkpoints = {**checkpoints, "mimic": mimic(checkpoints["drafter"], tmp_path / "mimic", bigrams)}
    config = engine_config(checkpoints, "fixed-k", "mimic", dspark={"draft_quantization": "q8"})
    with LLM(config=config) as llm:
        drafter = llm.speculative_policy.drafter  # type: ignore[union-attr]
        got = [list(o.outputs[0].token_ids) for o in llm.generate(batch, [greedy(24)] * len(batch))]
        stats = llm.engine.stats()
    linears = {name: m for name, m in drafter.model.named_modules() if isinstance(m, Linear)}
    kept = sorted(name for name, m in linears.items() if m.kernel is not None)
    where = f"seed={seed}, checkpoint seed={CHECKPOINT_SEED[0]}"
    assert kept == sorted(name for name, m in linears.items() if name != "lm_head" and m.in_features % 16 == 0)
    assert {"fc", "markov_head.markov_w2", "layers.0.mlp.down_proj"} <= set(kept), where
    assert {linears[name].quantized.format for name in kept} == {"q8"}, where
    assert got == expected, where
    assert stats.speculative_accepted_tokens > 0, where


def test_q8_is_refused_for_a_targets_own_drafter_and_where_no_kernel_multiplies_it(
    checkpoints: dict[str, Path],
) -> None:
    """Refused before anything loads: the target's own drafter shares the target's weights,
    and a platform without a quantised-linear kernel (a stand-in context: none exists here)
    cannot multiply q8."""
    config = engine_config(checkpoints, "fixed-k", dspark={"draft_quantization": "q8", "draft_model": ""})
    with pytest.raises(ValueError, match="rounds a drafter loaded from draft_model"):
        LLM(config=config)
    no_kernel = types.SimpleNamespace(build_quantized_linear=None)
    section = DSparkConfig(drafter="block", draft_model=str(checkpoints["drafter"]), draft_quantization="q8")
    with pytest.raises(ValueError, match="no quantised-linear kernel"):
        BlockDrafter.from_context(no_kernel, section)


# --------------------------------------------------------------------------- a Gemma 4 target


@pytest.fixture(scope="module")
def gemma4_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny Gemma 4 target as Google's releases are saved (``Gemma4ForConditionalGeneration``,
    ``global_head_dim``) without per-layer inputs (DeepSpec's drafter refuses them), and a
    three-layer DeepSpec Gemma 4 drafter for it."""
    seed = fresh_seed()
    print(f"gemma4 checkpoint seed={seed}")
    target = write_tiny_gemma4(
        tmp_path_factory.mktemp("gemma4-target"),
        seed=seed,
        conditional_generation=True,
        global_head_keys=True,
        hidden_size_per_layer_input=0,
    )
    drafter = write_tiny_deepspec_drafter(
        tmp_path_factory.mktemp("gemma4-drafter"),
        target,
        seed=seed + 1,
        block_size=DRAFT_BLOCK,
        num_layers=3,
        target_layer_ids=(1, 3),
        mask_token_id=4,
    )
    return {"target": target, "drafter": drafter}


@pytest.mark.parametrize("speculative", ["dspark", "fixed-k"])
@pytest.mark.usefixtures("steady_step_time")
def test_a_gemma4_drafter_gives_plain_decodings_greedy_tokens(
    gemma4_checkpoints: dict[str, Path], speculative: str, seed: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``[speculative] dspark`` (and ``fixed-k``) with ``[dspark] drafter = "block"`` and a
    DeepSpec Gemma 4 drafter on a Gemma 4 target: greedy outputs equal plain decoding's. The
    drafter is the mimic copy (its Markov head predicts the target's greedy bigrams), so drafts
    are accepted and rejected; with every draft verified (``fixed-k``) both must happen."""
    batch = prompts(seed, (5, 13, 30))
    # A fixed cache: the drafter's gets as many blocks as the target's few full-attention layers.
    sized = {"num_blocks": 128}
    expected = generate(engine_config(gemma4_checkpoints, "none", **sized), batch, [greedy(20)] * len(batch))
    bigrams = {a: b for out in expected for a, b in zip(out, out[1:], strict=False)}
    checkpoints = {**gemma4_checkpoints, "mimic": mimic(gemma4_checkpoints["drafter"], tmp_path / "mimic", bigrams)}
    config = engine_config(checkpoints, speculative, "mimic", max_num_batched_tokens=24, **sized)
    recorder = structlog.testing.CapturingLogger()  # the module's logger (a cached one bypasses capture_logs)
    monkeypatch.setattr(building, "log", recorder)
    with LLM(config=config) as llm:
        drafter = llm.speculative_policy.drafter  # type: ignore[union-attr]
        assert isinstance(drafter, BlockDrafter)
        got = [list(o.outputs[0].token_ids) for o in llm.generate(batch, [greedy(20)] * len(batch))]
        stats = llm.engine.stats()
    # The drafter's cache sits beside the target's KV budget: startup says how big it is.
    (said,) = [call.kwargs for call in recorder.calls if call.args == ("drafter kv cache",)]
    held = sum(t.numel() * t.element_size() for cache in drafter.caches for t in cache.values())
    assert said == {"layers": len(drafter.caches), "gib": round(held / 2**30, 3), "outside_kv_budget": True}
    assert held > 0
    where = f"{speculative}, seed={seed}"
    print(f"{where}: {stats.speculative_accepted_tokens} of {stats.speculative_verified_tokens} drafts accepted")
    assert got == expected, where
    assert stats.speculative_accepted_tokens > 0, where
    if speculative == "fixed-k":
        assert stats.speculative_accepted_tokens < stats.speculative_verified_tokens, where


# --------------------------------------------------------------------------- sampling law

GENERATED = 3
RUNS = 1500
#: A fixed target, drafter and prompt for the law: with them the control below is known to
#: have power.
LAW_SEEDS = {"target": 7, "drafter": 8, "prompt": 11}


@pytest.fixture(scope="module")
def law_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The target, its transformers model and prompt, and a mimic drafter for its greedy bigrams."""
    target = write_tiny_qwen3(tmp_path_factory.mktemp("law-target"), seed=LAW_SEEDS["target"], num_hidden_layers=4)
    weights = load_file(str(target / "model.safetensors"))
    weights["lm_head.weight"] *= 6.0  # a sharper target: top-p 0.9 then cuts its top 4
    save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
    drafter = write_tiny_deepspec_drafter(
        tmp_path_factory.mktemp("law-drafter"), target, seed=LAW_SEEDS["drafter"], block_size=DRAFT_BLOCK
    )
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    prompt = prompts(LAW_SEEDS["prompt"], (9,))[0]
    with torch.inference_mode():
        continued = hf.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False)[0].tolist()
    bigrams = dict(zip(continued, continued[1:], strict=False))
    mimicked = mimic(drafter, tmp_path_factory.mktemp("law-mimic"), bigrams)
    return {"target": target, "mimic": mimicked, "hf": hf, "prompt": prompt}


@pytest.mark.parametrize("temperature", [0.6, 1.0])
@pytest.mark.usefixtures("steady_step_time")
def test_sampled_drafts_keep_the_targets_law(
    law_models: dict[str, Any], temperature: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seeded requests at ``temperature`` with top-p 0.9 (and top-k 4, so the law of the
    first three tokens has at most 64 outcomes) under DSpark with the block drafter: drafts
    drawn one after another from the Markov-corrected block distribution, processed as the
    target's, which verification gets as q. The output law must be the target's.

    The control: verification handed the distribution before the Markov bias (what the
    block alone predicts) as q, while the drafts come from the corrected one, must fail."""
    params = SamplingParams(temperature=temperature, top_k=4, top_p=0.9, max_tokens=GENERATED, ignore_eos=True)
    hf, prompt = law_models["hf"], law_models["prompt"]
    with torch.inference_mode():
        law = sampling_law.exact_law(lambda tokens: hf(torch.tensor([tokens])).logits[0, -1], prompt, params, GENERATED)
    checkpoints = {"target": law_models["target"], "drafter": law_models["mimic"]}
    requests = [attrs.evolve(params, seed=30_000 + i) for i in range(RUNS)]
    counts = {}
    for control in (False, True):
        if control:
            monkeypatch.setattr(block_module, "draw_drafts", _q_before_the_markov_bias(monkeypatch))
        config = engine_config(checkpoints, "dspark", dspark={"profile_sequences": [1, 32]}, max_num_seqs=32)
        with LLM(config=config) as llm:
            outputs = llm.generate([prompt] * RUNS, requests)
            stats = llm.engine.stats()
        counts[control] = sampling_law.count_outcomes(outputs)
        print(f"control={control}: {stats.speculative_accepted_tokens} of {stats.speculative_verified_tokens} accepted")
        if not control:
            assert 0 < stats.speculative_accepted_tokens < stats.speculative_verified_tokens, stats
    assert set(counts[False]) <= set(law), "an outcome the target cannot produce"
    p_value = sampling_law.chi_square_p(counts[False], law, RUNS)
    p_control = sampling_law.chi_square_p(counts[True], law, RUNS)
    print(f"{len(law)} outcomes; chi-square p = {p_value:.3g}, control (q before the Markov bias) p = {p_control:.3g}")
    assert p_value > SIGNIFICANCE, f"output law differs from the target's: chi-square p = {p_value:.2e}"
    assert p_control < SIGNIFICANCE, f"the control passed (p = {p_control:.2e}): the test has no power"


def _q_before_the_markov_bias(monkeypatch: pytest.MonkeyPatch) -> Any:
    """``draw_drafts`` that draws as it should but reports as q the distribution of the
    block's logits before the Markov bias (the control's mistake)."""
    seen: dict[str, torch.Tensor] = {}
    corrected = BlockDrafterModel.corrected_logits

    def remember(self: Any, base: torch.Tensor, previous: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        seen["base"] = base
        return corrected(self, base, previous, hidden)

    monkeypatch.setattr(BlockDrafterModel, "corrected_logits", remember)
    draw = block_module.draw_drafts

    def wrong_q(logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[Any]) -> Any:
        tokens, raw, q = draw(logits, params, generators)
        base = seen["base"]
        return (
            tokens,
            raw,
            [None if d is None else target_probs(base[row][None], params[row])[0] for row, d in enumerate(q)],
        )

    return wrong_q


# --------------------------------------------------------------------------- refusals


def test_the_block_drafter_asks_assembly_for_non_causal_attention() -> None:
    """Its layers attend both ways inside a block: planning adds the capability to the
    attention requirements, so auto picks a backend that has it and a named one that lacks
    it is refused by name."""
    sections = {"dspark": {"drafter": "block", "draft_model": "unused"}}
    auto = attrs.evolve(apply_overrides(EngineConfig(), {"speculative": "dspark"}), sections=sections)
    chosen = plan(auto, strict=False).resolutions["attention"]
    assert "non-causal" in chosen.provided.record.capabilities  # type: ignore[union-attr]
    named = attrs.evolve(
        apply_overrides(EngineConfig(), {"speculative": "dspark", "attention": "sdpa"}), sections=sections
    )
    refused = plan(named, strict=False).resolutions["attention"]
    assert "sdpa" in refused.error and "non-causal" in refused.error
    ngram = attrs.evolve(named, sections={"dspark": {"drafter": "ngram"}})
    assert plan(ngram, strict=False).resolutions["attention"].name == "sdpa"


def test_a_drafter_that_does_not_fit_the_target_is_refused(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """A drafter trained for another target (its width), no drafter folder, and a Markov
    head this engine does not run, each refused at startup with what to change."""
    other = write_tiny_qwen3(tmp_path / "other", seed=1, num_hidden_layers=4, hidden_size=32, head_dim=8)
    wrong = {**checkpoints, "wrong": write_tiny_deepspec_drafter(tmp_path / "wrong", other)}
    with pytest.raises(
        ValueError, match=r"does not fit the target model: its hidden_size is 32, the target's hidden_size is 64"
    ):
        LLM(config=engine_config(wrong, "dspark", "wrong"))
    with pytest.raises(ValueError, match=r"needs draft_model = <folder of a DeepSpec DSpark drafter>"):
        LLM(config=engine_config(checkpoints, "dspark", dspark={"draft_model": ""}))
    rnn = tmp_path / "rnn"
    rnn.mkdir()
    config = json.loads((checkpoints["drafter"] / "config.json").read_text())
    (rnn / "config.json").write_text(json.dumps({**config, "markov_head_type": "rnn"}))
    with pytest.raises(ValueError, match=r"markov_head_type='rnn'; supported: vanilla, gated"):
        LLM(config=engine_config({**checkpoints, "rnn": rnn}, "dspark", "rnn"))

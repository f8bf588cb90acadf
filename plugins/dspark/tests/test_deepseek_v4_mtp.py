"""DeepSeek-V4's MTP layer as the MTP drafter, in the real engine, on tiny V4 checkpoints.

``write_tiny_deepseek_v4(mtp_layers=1)`` stores the MTP layer as DeepSeek's release does
(``mtp.0.*``, vLLM's ``deepseek_v4_mtp.py`` loads those names): a V4 block fed the target's
streams before the hyper head (the ``head_streams`` hidden tap) and the next token, with its
own hyper head. transformers builds no V4 MTP layer, but its parts are the oracle of the
MTP's arithmetic: transformers' V4 one layer deeper, that layer and the final hyper head and
norm holding the MTP's weights, with the layer's input replaced (a forward pre-hook) by
DeepSeek's ``MTPBlock`` formula, ``e_proj(enorm(embed(next token))) + h_proj(hnorm(streams))``,
written out here. The MTP's incremental state in the engine (catch-up step by step, drafts
into scratch blocks, each retention class of its cache on its own block tables) is then
compared with the same module run from scratch over each sequence's whole history, from the
target's streams of a full forward. transformers' target model is the oracle of greedy ties.

Checkpoints as in test_mtp.py: ``random`` (drafts nearly always rejected) and ``mimic``
(``mimic_mtp_layers``: most drafts accepted), both with the release's sliding-window MTP
layer, and ``mimic-csa``, whose MTP layer is a CSA layer with a window of 16 tokens
(compressor rows and indexer keys over 8, entries over the whole history: three retention
classes in its cache, each on block tables of its own).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from powertrain import LLM, SamplingParams
from powertrain.builtin.grouped_moe import TorchGroupedMoE
from powertrain.builtin.reference_attention import TorchReferenceAttention
from powertrain.config import EngineConfig
from powertrain.engine.speculative import forward_with_taps
from powertrain.interfaces import HiddenTap, ModelContext
from powertrain.llm import apply_overrides
from powertrain.loader import load_checkpoint
from powertrain.models.deepseek_v4 import DeepseekV4ForCausalLM
from powertrain.testing.base import fresh_seed
from powertrain.testing.checkpoints import TINY_DEEPSEEK_V4_CONFIG, mimic_mtp_layers, write_tiny_deepseek_v4
from powertrain.testing.oracle import assert_same_greedy, relative_error
from powertrain.testing.paged import PagedRunner
from powertrain_dspark.confidence_head import ConfidenceLog
from powertrain_dspark.drafter import DraftBatch
from powertrain_dspark.mtp import MTPDrafter

PROFILE = [1, 2]
#: The largest compression rate of the tiny config (HCA): block sizes must be multiples of it.
BLOCK = 8
#: Relative to the largest logit: transformers' parts and ours, the same float32 arithmetic in
#: another order through five blocks (the V4 model tests' bound against transformers).
LOGIT_TOLERANCE = 1e-4
#: float32 throughout. The engine's MTP state and the from-scratch run do the same arithmetic
#: in other groupings (chunked prefill, other batch rows, decode-step reductions): each op
#: rounds differently by a few units of 2^-24 ~ 6e-8, over the target's four blocks and the
#: MTP's one (reductions up to 256 wide, mHC's 20 Sinkhorn rounds), which leaves ~1e-6 of the
#: largest value; 1e-4 is that with a wide margin, and far below what one missed or stale
#: cache entry moves (O(1e-1): a key of the window, an entry, a compressor row).
STATE_TOLERANCE = 1e-4
#: Draft confidences (the largest probability) come through the mimic's 4x-sharpened head:
#: logits within ~1e-5 of each other move a probability by ~1e-4 relative; 1e-3 holds that.
CONFIDENCE_TOLERANCE = 1e-3
#: Greedy picks closer than this may go either way between two correct runs (the V4 model
#: tests' bound: twice their 1e-4 logit tolerance).
TIE = 2e-4
CHECKPOINT_SEED = [0]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    seed = fresh_seed()
    print(f"checkpoint seed={seed}")
    CHECKPOINT_SEED[0] = seed
    make = write_tiny_deepseek_v4
    csa = {
        "layer_types": [*TINY_DEEPSEEK_V4_CONFIG["layer_types"], "compressed_sparse_attention"],
        "sliding_window": 16,
    }
    return {
        "random": make(tmp_path_factory.mktemp("random"), seed=seed, mtp_layers=1),
        "mimic": mimic_mtp_layers(make(tmp_path_factory.mktemp("mimic"), seed=seed, mtp_layers=1)),
        "mimic-csa": mimic_mtp_layers(make(tmp_path_factory.mktemp("csa"), seed=seed, mtp_layers=1, **csa)),
        "no-mtp": make(tmp_path_factory.mktemp("no-mtp"), seed=seed),
        # What transformers writes for V4: config.json counts an MTP layer, no tensor holds it.
        "counted-not-stored": make(tmp_path_factory.mktemp("counted"), seed=seed, num_nextn_predict_layers=1),
    }


@pytest.fixture(scope="module")
def oracle(checkpoints: dict[str, Path]) -> Callable[[str], Any]:
    """transformers' model of a checkpoint (which leaves its MTP layer out), loaded once."""
    models: dict[str, Any] = {}

    def model(name: str) -> Any:
        if name not in models:
            path = str(checkpoints[name])
            models[name] = transformers.DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        return models[name]

    return model


@pytest.fixture
def seed() -> int:
    value = fresh_seed()
    print(f"seed={value}")
    return value


def engine_config(path: Path, speculative: str, **settings: object) -> EngineConfig:
    dspark = {"drafter": "mtp", "profile_sequences": PROFILE, **settings.pop("dspark", {})}  # type: ignore[dict-item]
    base = {"path": str(path), "dtype": "float32", "speculative": speculative, "block_size": BLOCK}
    config = apply_overrides(EngineConfig(), {"num_blocks": 96, **base, **settings})
    return attrs.evolve(config, sections={"dspark": dspark}) if speculative != "none" else config


def requests(seed: int) -> list[tuple[list[int], SamplingParams]]:
    """Prompts of random tokens, the longer ones prefilled in chunks, and a neighbour that
    never speculates (it asks for logprobs) in the same batches."""
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(2, 500, (n,), generator=generator).tolist() for n in (3, 11, 29, 45)]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (18, 22, 3)]
    params.append(SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1))
    return list(zip(prompts, params, strict=True))


def generate(config: EngineConfig, batch: list[tuple[list[int], SamplingParams]]) -> tuple[list, Any]:
    with LLM(config=config) as llm:
        outputs = llm.generate([p for p, _ in batch], [s for _, s in batch])
        return [list(o.outputs[0].token_ids) for o in outputs], llm.engine.stats()


def load_model(path: Path, weights: Any = None) -> DeepseekV4ForCausalLM:
    checkpoint = load_checkpoint(str(path))
    context = ModelContext(
        config=checkpoint.config,
        dtype=torch.float32,
        device=torch.device("cpu"),
        attention=TorchReferenceAttention(),
        moe=TorchGroupedMoE(),
    )
    model = DeepseekV4ForCausalLM(context)
    model.load_weights(checkpoint.tensors() if weights is None else weights(checkpoint.tensors()))
    return model


# --------------------------------------------------------------------------- loading and refusal


def test_the_release_names_load_into_the_mtp_and_a_missing_one_is_named(checkpoints: dict[str, Path]) -> None:
    model = load_model(checkpoints["random"])
    assert model.mtp is not None and len(model.mtp.layers) == 1
    assert model.mtp.reads == HiddenTap(4, "head_streams")
    assert model.mtp.attention_layers[0].windows == {8}  # the release's MTP layer: a sliding window only
    csa = load_model(checkpoints["mimic-csa"]).mtp
    assert csa is not None and csa.attention_layers[0].windows == {16, 8, None}  # window, rows, entries

    def without_e_proj(tensors: Any) -> Any:
        return ((name, tensor) for name, tensor in tensors if name != "mtp.0.e_proj.weight")

    with pytest.raises(ValueError, match=r"missing tensors: mtp\.layers\.0\.e_proj\.weight"):
        load_model(checkpoints["random"], without_e_proj)
    assert load_model(checkpoints["counted-not-stored"]).mtp is None  # loads as before: no drafter


@pytest.mark.parametrize("checkpoint", ["no-mtp", "counted-not-stored"])
def test_refuses_a_checkpoint_without_mtp_layers(checkpoints: dict[str, Path], checkpoint: str) -> None:
    with pytest.raises(ValueError, match=r"needs a checkpoint with MTP layers \(num_nextn_predict_layers > 0\)"):
        LLM(config=engine_config(checkpoints[checkpoint], "dspark"))


# --------------------------------------------------------------------------- the MTP against transformers' parts


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def transformers_mtp(path: Path, folder: Path) -> Callable[[list[int]], torch.Tensor]:
    """``tokens -> logits [len - 1, vocab]``: the MTP at every position of ``tokens`` but the
    last (with the token after it) through transformers' parts (see the module doc)."""
    config = json.loads((path / "config.json").read_text())
    layers = config["num_hidden_layers"]
    tensors = {name: t for shard in sorted(path.glob("*.safetensors")) for name, t in load_file(shard).items()}
    own = {name.removeprefix("mtp.0."): tensors.pop(name) for name in list(tensors) if name.startswith("mtp.0.")}
    for part in ("fn", "base", "scale"):
        tensors[f"model.hc_head.hc_{part}"] = own.pop(f"hc_head_{part}")
    tensors["model.norm.weight"] = own.pop("norm.weight")
    mix = {name: own.pop(f"{name}.weight") for name in ("e_proj", "h_proj", "enorm", "hnorm")}
    tensors |= {f"model.layers.{layers}.{name}": tensor for name, tensor in own.items()}  # the block
    deeper = {**config, "num_hidden_layers": layers + 1, "num_nextn_predict_layers": 0}
    (folder / "config.json").write_text(json.dumps(deeper))
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    hf = transformers.DeepseekV4ForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    eps, next_ids = config["rms_norm_eps"], []

    def mtp_input(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        (streams,) = args  # [1, n, hc_mult, hidden]: the target's, before its hyper head
        embedded = rms_norm(hf.model.embed_tokens(next_ids[0]), mix["enorm"], eps) @ mix["e_proj"].T
        projected = rms_norm(streams, mix["hnorm"], eps) @ mix["h_proj"].T
        return (projected + embedded.unsqueeze(2),), {**kwargs, "input_ids": next_ids[0]}

    hf.model.layers[layers].register_forward_pre_hook(mtp_input, with_kwargs=True)

    def logits(tokens: list[int]) -> torch.Tensor:
        next_ids[:] = [torch.tensor([tokens[1:]])]
        with torch.inference_mode():
            return hf(input_ids=torch.tensor([tokens[:-1]])).logits[0].float()

    return logits


@pytest.mark.parametrize("checkpoint", ["random", "mimic-csa"])
def test_mtp_logits_equal_transformers_parts(
    checkpoints: dict[str, Path], checkpoint: str, tmp_path: Path, seed: int
) -> None:
    """The MTP run from scratch over a sequence (the target's streams at every position, the
    token after each) gives transformers' logits (sliding and CSA MTP layers)."""
    path = checkpoints[checkpoint]
    tokens = torch.randint(2, 500, (41,), generator=torch.Generator().manual_seed(seed)).tolist()
    model = load_model(path)
    streams = target_streams(model, tokens[:-1])
    runner = PagedRunner(model.mtp, TorchReferenceAttention(), block_size=BLOCK, num_blocks=32)
    metadata, positions = runner.metadata([("s", tokens[1:])])
    with torch.inference_mode():
        states = model.mtp(0, torch.tensor(tokens[1:]), positions, streams, runner.caches[0], metadata)
        ours = model.mtp.compute_logits(0, states)
    reference = transformers_mtp(path, tmp_path)(tokens)
    error = relative_error(ours, reference)
    print(f"largest logit error {error:.2e} of the largest logit")
    assert error < LOGIT_TOLERANCE, f"seed={seed}, checkpoint seed={CHECKPOINT_SEED[0]}"


# --------------------------------------------------------------------------- lossless (greedy)


@pytest.mark.parametrize(
    ("checkpoint", "speculative", "dspark"),
    [
        ("mimic", "dspark", {}),
        ("mimic", "fixed-k", {"max_draft_tokens": 3}),
        ("random", "fixed-k", {"max_draft_tokens": 4}),
    ],
)
@pytest.mark.usefixtures("steady_step_time")
def test_greedy_outputs_equal_plain_decoding(
    checkpoints: dict[str, Path],
    oracle: Callable[[str], Any],
    checkpoint: str,
    speculative: str,
    dspark: dict,
    seed: int,
) -> None:
    path = checkpoints[checkpoint]
    batch = requests(seed)
    plain, _ = generate(engine_config(path, "none", max_num_batched_tokens=32), batch)
    speculated, stats = generate(engine_config(path, speculative, max_num_batched_tokens=32, dspark=dspark), batch)
    what = f"speculated tokens (checkpoint seed={CHECKPOINT_SEED[0]})"
    assert_same_greedy(speculated, plain, [p for p, _ in batch], oracle(checkpoint), TIE, what)
    assert stats.speculative_verified_tokens > 0
    if checkpoint == "mimic":
        assert stats.speculative_accepted_tokens > 0


# --------------------------------------------------------------------------- state against a from-scratch run


def target_streams(model: DeepseekV4ForCausalLM, tokens: list[int]) -> torch.Tensor:
    """The target's streams before its hyper head over ``tokens`` in one prefill (causal: a
    prefix's are the first rows), as the MTP reads them (its ``reads`` tap)."""
    runner = PagedRunner(model, TorchReferenceAttention(), block_size=BLOCK, num_blocks=32)
    metadata, positions = runner.metadata([("s", tokens)])
    with torch.inference_mode():
        _, (streams,) = forward_with_taps(
            model, [model.mtp.reads], torch.tensor(tokens), positions, runner.caches, metadata
        )
    return streams


def from_scratch(mtp: Any, streams: torch.Tensor, tokens: list[int], count: int) -> tuple[torch.Tensor, list, list]:
    """The MTP over every position of ``tokens`` but the last, with the token after it, from
    a fresh cache (NaN: an entry read before it is written shows), then ``count`` recursive
    greedy drafts: (the state at the last position, drafts, [(confidence, top-2 margin)])."""
    runner = PagedRunner(mtp, TorchReferenceAttention(), block_size=BLOCK, num_blocks=32)
    drafts, scores = [], []
    with torch.inference_mode():
        metadata, positions = runner.metadata([("s", tokens[1:])])
        state = mtp(0, torch.tensor(tokens[1:]), positions, streams, runner.caches[0], metadata)[-1:]
        last = state
        for _ in range(count):
            logits = mtp.compute_logits(0, last).float()[0]
            top = logits.topk(2).values
            drafts.append(int(logits.argmax()))
            scores.append((float(logits.softmax(-1).max()), float(top[0] - top[1])))
            metadata, positions = runner.metadata([("s", drafts[-1:])])
            last = mtp(0, torch.tensor(drafts[-1:]), positions, last, runner.caches[0], metadata)
    return state[0], drafts, scores


@pytest.mark.parametrize(
    ("checkpoint", "num_blocks"),
    [("random", None), ("mimic", None), ("mimic-csa", None), ("mimic", 16), ("mimic-csa", 16)],
    ids=["random", "mimic", "mimic-csa", "mimic-preempted", "mimic-csa-preempted"],
)
def test_incremental_state_equals_a_from_scratch_mtp_run(
    checkpoints: dict[str, Path], checkpoint: str, num_blocks: int | None, seed: int
) -> None:
    """At every proposal, the drafter's state (the MTP's output streams at the sequence's last
    position, which its drafts grow from) is the MTP run from scratch over the sequence so
    far, within STATE_TOLERANCE of its largest value, and so are the drafts (up to the first
    greedy near-tie) and their confidences: the catch-up wrote every entry of every class
    (prompt chunks, accepted drafts, the rows after rejections, a preempted sequence's
    recomputation) as the from-scratch run has it. The confidence head's features are
    logged on the way (``collapse``: the streams through the MTP's hyper head)."""
    settings: dict[str, Any] = {"max_num_batched_tokens": 24, "prefix_caching": False}
    if num_blocks is not None:
        settings["num_blocks"] = num_blocks
    config = engine_config(checkpoints[checkpoint], "fixed-k", dspark={"max_draft_tokens": 3}, **settings)
    seen: list[tuple[list[int], torch.Tensor, list[int], list[float]]] = []
    with LLM(config=config) as llm:
        drafter = llm.speculative_policy.drafter  # type: ignore[union-attr]
        assert isinstance(drafter, MTPDrafter) and drafter.taps == (HiddenTap(4, "head_streams"),)
        drafter.log = ConfidenceLog()
        propose = drafter.propose

        def spy(slots: list) -> DraftBatch:
            drafted = propose(slots)
            for slot, tokens, confidences in zip(slots, drafted.tokens, drafted.confidences, strict=True):
                tail = drafter._sequences[slot.seq_id].tail
                if tokens:
                    seen.append((list(slot.token_ids), tail.hidden.clone(), list(tokens), list(confidences)))
            return drafted

        drafter.propose = spy  # type: ignore[method-assign]
        batch = requests(seed)[:3]
        if num_blocks is not None:  # longer outputs than the cache holds at once
            batch = [(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)) for prompt, _ in batch]
        outputs = llm.generate([p for p, _ in batch], [s for _, s in batch])
        stats = llm.engine.stats()
        model = llm.engine.runner.model
        features, _, _, _ = drafter.log.tensors()
    assert features.shape[1] == 2 * model.args.hidden_size
    if checkpoint.startswith("mimic"):
        assert stats.speculative_accepted_tokens > 0
    if num_blocks is not None:
        assert stats.preemptions > 0
    assert len(seen) > 10
    sequences = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outputs]
    streams = [target_streams(model, tokens) for tokens in sequences]
    worst = 0.0
    for history, state, drafts, confidences in seen:
        (index,) = [i for i, tokens in enumerate(sequences) if tokens[: len(history)] == history]
        expected, expected_drafts, scores = from_scratch(
            model.mtp, streams[index][: len(history) - 1], history, len(drafts)
        )
        where = f"history of {len(history)} tokens, seed={seed}, checkpoint seed={CHECKPOINT_SEED[0]}"
        error = float((state - expected).abs().max() / expected.abs().max())
        worst = max(worst, error)
        assert error < STATE_TOLERANCE, where
        # Compared up to the first near tie (its confidence included): there either token is
        # right, and the drafts after it continue different sequences.
        tie = next((k for k, (_, margin) in enumerate(scores) if margin < TIE), len(drafts))
        expected_confidences = [confidence for confidence, _ in scores]
        assert confidences[: tie + 1] == pytest.approx(
            expected_confidences[: tie + 1], rel=CONFIDENCE_TOLERANCE, abs=1e-6
        ), where
        assert drafts[:tie] == expected_drafts[:tie], where
    print(f"{len(seen)} proposals; largest state error {worst:.2e} of the largest value")


# --------------------------------------------------------------------------- sampling


@pytest.mark.usefixtures("steady_step_time")
def test_sampling_runs_and_is_reproducible_with_seeds(checkpoints: dict[str, Path], seed: int) -> None:
    """Seeded sampling requests with MTP drafts give the same tokens run again, and sampled
    drafts come with the distribution they were drawn from (verification's q)."""
    batch = [
        (prompt, SamplingParams(temperature=0.8, top_p=0.95, max_tokens=16, ignore_eos=True, seed=seed + i))
        for i, (prompt, _) in enumerate(requests(seed)[:3])
    ]
    config = engine_config(checkpoints["mimic"], "fixed-k", dspark={"max_draft_tokens": 3})
    with LLM(config=config) as llm:
        drafter = llm.speculative_policy.drafter  # type: ignore[union-attr]
        propose = drafter.propose
        seen = []

        def spy(slots: list) -> DraftBatch:
            drafted = propose(slots)
            seen.extend(zip(drafted.tokens, drafted.probs(), strict=True))
            return drafted

        drafter.propose = spy
        first = llm.generate([p for p, _ in batch], [s for _, s in batch])
        again = llm.generate([p for p, _ in batch], [s for _, s in batch])
        stats = llm.engine.stats()
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in again]
    assert stats.speculative_verified_tokens > 0 and stats.speculative_accepted_tokens > 0
    assert any(tokens for tokens, _ in seen)
    for tokens, probs in seen:
        if not tokens:
            continue
        assert probs is not None and probs.shape == (len(tokens), 512)
        assert torch.allclose(probs.sum(dim=-1), torch.ones(len(tokens)), atol=1e-5)
        assert all(probs[k, token] > 0 for k, token in enumerate(tokens))

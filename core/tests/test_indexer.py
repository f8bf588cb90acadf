"""LightningIndexer (powertrain.layers.indexer) against transformers' DeepseekV32Indexer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers  # the oracle; the locked dev group pins 5.24, which has DeepSeek-V3.2
from safetensors.torch import load_file
from transformers.models.deepseek_v32 import modeling_deepseek_v32 as hf_v32

from powertrain.layers.indexer import LightningIndexer
from powertrain.layers.rotary import RopeParameters, RotaryEmbedding
from powertrain.testing import fresh_seed, write_tiny_deepseek_v32
from powertrain.testing.checkpoints import TINY_DEEPSEEK_V32_CONFIG

CONFIG = {**TINY_DEEPSEEK_V32_CONFIG, "vocab_size": 512}
TOPK = CONFIG["index_topk"]


@pytest.fixture
def seed() -> int:
    seed = fresh_seed()
    print(f"seed={seed}")
    return seed


def hf_indexer(seed: int, dtype: torch.dtype) -> Any:
    """transformers' indexer with every parameter random (its LayerNorm too), eval mode."""
    config = transformers.DeepseekV32Config(**CONFIG)
    indexer = hf_v32.DeepseekV32Indexer(config, layer_idx=0).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in indexer.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1 + 0.1 * noise if name == "k_norm.weight" else noise / param.shape[-1] ** 0.5)
    return indexer.to(dtype), config


def ours_from(indexer: Any) -> LightningIndexer:
    ours = LightningIndexer.from_config(CONFIG)
    ours.load_state_dict(indexer.state_dict(), strict=True)  # the same names, 1:1
    return ours.to(indexer.wk.weight.dtype)


def rope() -> RotaryEmbedding:
    return RotaryEmbedding(
        CONFIG["qk_rope_head_dim"], RopeParameters.from_config(CONFIG), CONFIG["max_position_embeddings"]
    )


def hf_run(indexer: Any, config: Any, hidden: torch.Tensor, q_resid: torch.Tensor, monkeypatch: Any):
    """HF's indices ``[S, topk]`` and the scores it ranked ``[S, S]`` for one whole sequence from position 0."""
    length = hidden.shape[0]
    positions = torch.arange(length)[None]
    cos, sin = hf_v32.DeepseekV32RotaryEmbedding(config)(hidden[None], positions)
    causal = torch.ones(length, length, dtype=torch.bool).tril()[None]
    ranked = []
    original = torch.Tensor.topk

    def recording(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        ranked.append(self.detach().clone())
        return original(self, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(torch.Tensor, "topk", recording)
        indices = indexer(hidden[None], q_resid[None], (cos, sin), causal, positions)
    (scores,) = ranked
    return indices[0], scores[0]


def visible_sets(indices: torch.Tensor, positions: torch.Tensor) -> list[set[int]]:
    return [{int(i) for i in row if 0 <= i <= p} for row, p in zip(indices, positions.tolist(), strict=True)]


def assert_no_ties_at_the_cut(scores: torch.Tensor) -> None:
    """The k-th and (k+1)-th visible scores of each query differ, so the top-k set is well defined."""
    for query, row in enumerate(scores):
        visible = row[: query + 1].sort(descending=True).values
        if visible.numel() > TOPK:
            assert visible[TOPK - 1] - visible[TOPK] > 1e-6 * visible.abs().max(), f"tie at the cut of query {query}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_matches_transformers_on_a_flat_batch(seed: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two sequences in one flat batch: one prefilled whole (21 tokens), one whose last 4 of 19
    tokens are the queries (chunked prefill / decode) against keys cached earlier."""
    indexer, config = hf_indexer(seed, dtype)
    ours = ours_from(indexer)
    generator = torch.Generator().manual_seed(seed + 1)
    lengths, new = (21, 19), (21, 4)
    hiddens = [torch.randn(n, CONFIG["hidden_size"], generator=generator, dtype=dtype) for n in lengths]
    residuals = [torch.randn(n, CONFIG["q_lora_rank"], generator=generator, dtype=dtype) for n in lengths]
    rotary = rope()

    # Keys as the engine would store them: computed per token, in whatever chunks the steps had.
    cached = []
    for hidden, length in zip(hiddens, lengths, strict=True):
        positions = torch.arange(length)
        cos, sin = rotary(positions, length, dtype)
        cached.append(torch.cat([ours.keys(hidden[:9], cos[:9], sin[:9]), ours.keys(hidden[9:], cos[9:], sin[9:])]))

    query_positions = torch.cat(
        [torch.arange(length - count, length) for length, count in zip(lengths, new, strict=True)]
    )
    query_hidden = torch.cat([h[-count:] for h, count in zip(hiddens, new, strict=True)])
    query_resid = torch.cat([r[-count:] for r, count in zip(residuals, new, strict=True)])
    cos, sin = rotary(query_positions, max(lengths), dtype)
    with torch.no_grad():
        indices = ours.select(query_hidden, query_resid, query_positions, cos, sin, (0, 21, 25), cached)
    assert indices.dtype == torch.int32 and indices.shape == (25, TOPK)

    start = 0
    for seq, (length, count) in enumerate(zip(lengths, new, strict=True)):
        hf_indices, hf_scores = hf_run(indexer, config, hiddens[seq], residuals[seq], monkeypatch)
        assert_no_ties_at_the_cut(hf_scores)
        rows = slice(length - count, length)
        positions = query_positions[start : start + count]
        assert visible_sets(indices[start : start + count], positions) == visible_sets(hf_indices[rows], positions)
        # Best first, as HF's topk orders them.
        full = indices[start : start + count]
        assert torch.equal(full[positions >= TOPK - 1], hf_indices[rows][positions >= TOPK - 1])
        with torch.no_grad():
            scores = ours.scores(
                query_hidden[start : start + count],
                query_resid[start : start + count],
                cos[start : start + count],
                sin[start : start + count],
                cached[seq],
            )
        causal = torch.arange(length)[None, :] <= positions[:, None]
        torch.testing.assert_close(scores[causal], hf_scores[rows][causal].float(), rtol=1e-5, atol=1e-5)
        start += count


def test_causal_masking_and_padding(seed: int) -> None:
    """A query sees positions <= its own: the keys after it cannot change its choice, and a query
    with fewer than topk visible tokens picks all of them, then -1."""
    indexer, _ = hf_indexer(seed, torch.float64)
    ours = ours_from(indexer)
    generator = torch.Generator().manual_seed(seed + 2)
    length = 16
    hidden = torch.randn(length, CONFIG["hidden_size"], generator=generator, dtype=torch.float64)
    resid = torch.randn(length, CONFIG["q_lora_rank"], generator=generator, dtype=torch.float64)
    positions = torch.arange(length)
    cos, sin = rope()(positions, length, torch.float64)
    with torch.no_grad():
        keys = ours.keys(hidden, cos, sin)
        indices = ours.select(hidden, resid, positions, cos, sin, (0, length), [keys])
        future = keys.clone()
        future[10:] = torch.randn(length - 10, keys.shape[1], generator=generator, dtype=torch.float64) * 10
        changed = ours.select(hidden, resid, positions, cos, sin, (0, length), [future])
    assert torch.equal(indices[:10], changed[:10])
    assert not torch.equal(indices[10:], changed[10:])  # the later queries do read those keys
    for p, row in enumerate(indices.tolist()):
        chosen = [i for i in row if i >= 0]
        assert all(i <= p for i in chosen) and len(set(chosen)) == len(chosen)
        if p < TOPK:
            assert set(chosen) == set(range(p + 1)) and row[p + 1 :] == [-1] * (TOPK - p - 1)
        else:
            assert len(chosen) == TOPK


def test_sequences_shorter_than_topk_and_empty_ones(seed: int) -> None:
    indexer, _ = hf_indexer(seed, torch.float32)
    ours = ours_from(indexer)
    generator = torch.Generator().manual_seed(seed + 3)
    hidden = torch.randn(3, CONFIG["hidden_size"], generator=generator)
    resid = torch.randn(3, CONFIG["q_lora_rank"], generator=generator)
    positions = torch.tensor([0, 1, 2])
    cos, sin = rope()(positions, 3, torch.float32)
    with torch.no_grad():
        keys = ours.keys(hidden, cos, sin)
        # sequence 0 has no query this step; sequence 1 is 3 tokens long.
        indices = ours.select(hidden, resid, positions, cos, sin, (0, 0, 3), [keys[:1], keys])
    assert indices.shape == (3, 3)  # as wide as the longest sequence, not TOPK = 8
    assert sorted(indices[2].tolist()) == [0, 1, 2] and sorted(indices[1, :2].tolist()) == [0, 1]
    assert indices[0].tolist() == [0, -1, -1] and indices[1, 2] == -1


def test_off_by_one_positions_are_caught(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison with HF sees a rope table read one position late."""
    indexer, config = hf_indexer(seed, torch.float64)
    ours = ours_from(indexer)
    generator = torch.Generator().manual_seed(seed + 4)
    length = 40
    hidden = torch.randn(length, CONFIG["hidden_size"], generator=generator, dtype=torch.float64)
    resid = torch.randn(length, CONFIG["q_lora_rank"], generator=generator, dtype=torch.float64)
    positions = torch.arange(length)
    hf_indices, _ = hf_run(indexer, config, hidden, resid, monkeypatch)
    rotary = rope()
    with torch.no_grad():
        right_cos, right_sin = rotary(positions, length + 1, torch.float64)
        right = ours.select(
            hidden, resid, positions, right_cos, right_sin, (0, length), [ours.keys(hidden, right_cos, right_sin)]
        )
        # The query rotated one position late (keys right): relative distances shift by one.
        late_cos, late_sin = rotary(positions + 1, length + 1, torch.float64)
        wrong = ours.select(
            hidden, resid, positions, late_cos, late_sin, (0, length), [ours.keys(hidden, right_cos, right_sin)]
        )
    assert visible_sets(right, positions) == visible_sets(hf_indices, positions)
    assert visible_sets(wrong, positions) != visible_sets(hf_indices, positions)


def test_loads_the_tiny_checkpoint_by_name_and_matches_transformers_inside_the_model(tmp_path: Path, seed: int) -> None:
    """The indexer tensors of layer 1 load by name; fed what HF's attention feeds its indexer
    (the layer input and ``q_a_layernorm(q_a_proj(x))``), the layer picks what HF picks."""
    folder = write_tiny_deepseek_v32(tmp_path / "tiny-v32", seed=seed)
    config = json.loads((folder / "config.json").read_text())
    prefix = "model.layers.1.self_attn.indexer."
    stored = load_file(folder / "model.safetensors")
    ours = LightningIndexer.from_config(config)
    ours.load_state_dict(
        {name.removeprefix(prefix): t for name, t in stored.items() if name.startswith(prefix)}, strict=True
    )

    model = transformers.DeepseekV32ForCausalLM.from_pretrained(folder).eval()
    seen: dict[str, Any] = {}

    def capture(module: Any, args: tuple, kwargs: dict, output: torch.Tensor) -> None:
        seen["hidden"], seen["q_resid"], seen["indices"] = args[0][0], args[1][0], output[0]

    model.model.layers[1].self_attn.indexer.register_forward_hook(capture, with_kwargs=True)
    length = 30
    ids = torch.randint(0, config["vocab_size"], (1, length), generator=torch.Generator().manual_seed(seed + 5))
    with torch.no_grad():
        model(ids)
    attention = model.model.layers[1].self_attn
    # The q input is the normalised q-LoRA residual HF's attention computes from the same hidden.
    torch.testing.assert_close(seen["q_resid"], attention.q_a_layernorm(attention.q_a_proj(seen["hidden"])))
    positions = torch.arange(length)
    cos, sin = RotaryEmbedding(config["qk_rope_head_dim"], RopeParameters.from_config(config), 512)(
        positions, length, torch.float32
    )
    with torch.no_grad():
        keys = ours.keys(seen["hidden"], cos, sin)
        indices = ours.select(seen["hidden"], seen["q_resid"], positions, cos, sin, (0, length), [keys])
    assert visible_sets(indices, positions) == visible_sets(seen["indices"], positions)


def test_bfloat16_keys_are_what_transformers_caches(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """In bf16 the keys to store are bit-equal to those HF's indexer hands its cache (same casts:
    bf16 projection, LayerNorm and rope with a bf16 cos/sin table), and the float32 scores agree."""
    indexer, config = hf_indexer(seed, torch.bfloat16)
    ours = ours_from(indexer)
    generator = torch.Generator().manual_seed(seed + 6)
    length = 24
    hidden = torch.randn(length, CONFIG["hidden_size"], generator=generator).bfloat16()
    resid = torch.randn(length, CONFIG["q_lora_rank"], generator=generator).bfloat16()
    positions = torch.arange(length)

    class RecordingCache:
        def update_indexer(self, keys: torch.Tensor, layer_idx: int) -> torch.Tensor:
            self.keys = keys
            return keys

    cache = RecordingCache()
    cos_hf, sin_hf = hf_v32.DeepseekV32RotaryEmbedding(config)(hidden[None], positions[None])
    causal = torch.ones(length, length, dtype=torch.bool).tril()[None]
    ranked: list[torch.Tensor] = []
    original = torch.Tensor.topk
    monkeypatch.setattr(torch.Tensor, "topk", lambda self, *a, **k: ranked.append(self) or original(self, *a, **k))
    indexer(hidden[None], resid[None], (cos_hf, sin_hf), causal, positions[None], cache=cache)
    monkeypatch.undo()

    cos, sin = rope()(positions, length, torch.bfloat16)
    with torch.no_grad():
        keys = ours.keys(hidden, cos, sin)
        scores = ours.scores(hidden, resid, cos, sin, keys)
    assert keys.dtype == torch.bfloat16 and torch.equal(keys, cache.keys[0])
    causal_2d = causal[0]
    torch.testing.assert_close(scores[causal_2d], ranked[0][0][causal_2d], rtol=1e-4, atol=1e-4)

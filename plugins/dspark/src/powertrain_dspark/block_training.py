"""Training DeepSeek's DSpark block drafter for a target (``powertrain-dspark train-drafter``).

- ``record_corpus``: the target writes its own training text (chat prompts from a small
  built-in list of instructions, sampled) through powertrain's engine; then the engine runs
  each whole sequence again as a prompt while a drafter that drafts nothing
  (``HiddenStateLog``) keeps, for every row whose hidden state is final, the token, the
  tapped layer outputs (``HiddenTap``) and the final normed hidden state (two passes: taps
  take decoding off the fused fast path, and prompt rows come in large batches). These
  are the engine's taps: the very tensors the block drafter reads when it drafts, from the
  same kernels and the same (possibly quantised) weights; transformers would need a second
  copy of the model and dequantises a GGUF file its own way.
- ``DenseBlockDrafter``: the drafter's training forward, dense and differentiable, with the
  parameter names of DeepSpec's checkpoint. Many blocks of a sequence run in one attention
  call under DeepSpec's mask: a block sees the context before its anchor and itself.
- ``dspark_loss``: DeepSpec's objective (``deepspec/modeling/dspark/loss.py``): CE to the
  next tokens plus L1 between the draft's Markov-corrected distribution and the target's
  (the target's logits are its frozen head on the stored final hidden state, as DeepSpec
  computes them), each position weighted ``exp(-k / gamma)`` over the supervised prefix of
  the block, and the confidence head's BCE against the acceptance probability
  ``1 - L1 / 2``. The Markov head's previous tokens are the true ones (teacher forcing).
- ``train`` and ``save_drafter``: AdamW with ``embed_tokens`` and ``lm_head`` copied from the
  target and frozen, then the checkpoint in DeepSpec's format (``powertrain.models.dspark`` loads it).
"""

from __future__ import annotations

import json
import math
import random
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from powertrain.interfaces import DraftSlot, ExecutedStep, HiddenTap
from powertrain.layers.rotary import RotaryEmbedding, apply_rotary
from powertrain.models.dspark import BlockDrafterConfig
from powertrain_dspark.drafter import DraftBatch

# --------------------------------------------------------------------------- the corpus

TOPICS = (
    "the water cycle|photosynthesis|the history of the printing press|how a bicycle works|"
    "volcanoes|the solar system|healthy breakfast ideas|learning a new language|the stock market|"
    "recycling|the human heart|machine learning|the French Revolution|how bread is baked|"
    "saving money|time management|the Moon landing|honey bees|rain forests|electric cars|"
    "the internet|chess|writing a resume|climate change|the Roman Empire|gardening for beginners|"
    "how vaccines work|the ocean tides|friendship|public speaking|a trip to Japan|coffee|"
    "the life of a star|earthquakes|the piano|a rainy afternoon|sleep|the desert|trains|"
    "making a cup of tea|the immune system|black holes|a lost cat|the first day of school"
).split("|")
TASKS = (
    "Explain {topic} to a beginner.",
    "Write a short story about {topic}.",
    "List five facts about {topic}.",
    "Write a short poem about {topic}.",
    "Give me three practical tips about {topic}.",
    "Describe {topic} in one paragraph.",
    "What are the advantages and disadvantages of {topic}?",
    "Write a short email to a friend about {topic}.",
    "Summarize what most people should know about {topic}.",
    "Answer briefly: why does {topic} matter?",
    "Repeat the following text exactly, word for word:\n\n{text}",
    "Rewrite the following text in simpler words:\n\n{text}",
)
_OPENINGS = (
    "Many people think about|Scientists have studied|Children often ask about|Books describe|We talked about".split("|")
)
_ENDINGS = "for a long time|every single day|with great interest|in many countries|during the summer".split("|")


#: The tasks that hand the model a text to repeat or rework (their answers copy from the prompt).
TEXT_TASKS = tuple(task for task in TASKS if "{text}" in task)
_OTHER_TASKS = tuple(task for task in TASKS if task not in TEXT_TASKS)


def chat_prompts(
    render: Callable[[list[dict[str, str]]], str], count: int, seed: int, copy_share: float | None = None
) -> list[str]:
    """``count`` chat prompts drawn with ``seed`` from ``TASKS`` x ``TOPICS``, each rendered by
    ``render`` (the target's chat template). ``copy_share``: the fraction drawn from
    ``TEXT_TASKS`` (None: every task alike), for a drafter meant for copy-heavy traffic
    (editing, retrieval-augmented answers), where most of what it must learn is to copy."""
    if copy_share is not None and not 0 <= copy_share <= 1:
        raise ValueError(f"copy_share={copy_share}: give a fraction between 0 and 1")
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        text = " ".join(
            f"{rng.choice(_OPENINGS)} {rng.choice(TOPICS)} {rng.choice(_ENDINGS)}." for _ in range(rng.randint(2, 4))
        )
        tasks = TASKS if copy_share is None else TEXT_TASKS if rng.random() < copy_share else _OTHER_TASKS
        task = rng.choice(tasks).format(topic=rng.choice(TOPICS), text=text)
        prompts.append(render([{"role": "user", "content": task}]))
    return prompts


@attrs.frozen
class Sample:
    """One sequence of the corpus, a row per position."""

    tokens: torch.Tensor  # [T] int64
    taps: torch.Tensor  # [T, len(layers) * hidden]: the tapped layer outputs, concatenated
    final: torch.Tensor  # [T, hidden]: the final normed hidden state (the target's logits through its head)
    loss_mask: torch.Tensor  # [T] bool: the response's positions


class HiddenStateLog:
    """A drafter that drafts nothing and keeps, per sequence and position, the token, the
    tapped layer outputs and the final hidden state of every row whose hidden state is final
    (rows of rejected drafts are not; a later row at the same position replaces an earlier)."""

    max_draft_tokens = 1

    def __init__(self, layer_ids: Sequence[int], dtype: torch.dtype = torch.float16) -> None:
        self.taps = tuple(HiddenTap(layer, "layer_output") for layer in layer_ids)
        self.dtype = dtype
        self._chunks: dict[int, list[tuple[torch.Tensor, ...]]] = defaultdict(list)

    def propose(self, slots: Sequence[DraftSlot]) -> DraftBatch:
        return DraftBatch(tokens=[[] for _ in slots], confidences=[[] for _ in slots])

    def record(self, seq_id: int, verified: int, accepted: int) -> None:
        """Nothing to learn: it drafts nothing."""

    def observe(self, step: ExecutedStep) -> None:
        if not step.taps:  # taps switched off (``record_corpus`` generates without them)
            return
        starts = step.metadata.query_start_loc_host
        for i, seq_id in enumerate(step.seq_ids):
            computed = starts[i + 1] - starts[i]
            kept = step.accepted[i]
            final = computed - step.num_drafts[i] + len(kept) - 1 if kept else computed
            if final <= 0:
                continue
            rows = slice(starts[i], starts[i] + final)
            self._chunks[seq_id].append(
                (
                    step.positions[rows].cpu(),
                    step.input_ids[rows].cpu(),
                    torch.cat([tap[rows] for tap in step.taps], dim=-1).to("cpu", self.dtype),
                    step.hidden[rows].to("cpu", self.dtype),
                )
            )

    def sequences(self) -> dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per sequence: its tokens, taps and final hidden states at positions 0 .. n-1 (a
        sequence with a gap, e.g. positions a prefix-cache hit skipped, is left out)."""
        result = {}
        for seq_id, chunks in self._chunks.items():
            length = max(int(c[0].max()) + 1 for c in chunks)
            tokens = torch.full((length,), -1, dtype=torch.int64)
            taps = torch.empty(length, chunks[0][2].shape[1], dtype=self.dtype)
            final = torch.empty(length, chunks[0][3].shape[1], dtype=self.dtype)
            for positions, ids, tapped, hidden in chunks:  # in step order: later rows win
                tokens[positions], taps[positions], final[positions] = ids, tapped, hidden
            if (tokens >= 0).all():
                result[seq_id] = (tokens, taps, final)
        return result


def spread_layers(num_layers: int, count: int) -> list[int]:
    """``count`` target layers evenly from the second to the one before the last (DeepSpec's
    Qwen3-4B drafter taps 1, 9, 17, 25, 33 of 36; the last layer is not tapped)."""
    last = num_layers - 2
    if count == 1:
        return [last]
    return sorted({round(1 + i * (last - 1) / (count - 1)) for i in range(count)})


@attrs.frozen
class Corpus:
    samples: list[Sample]
    layer_ids: list[int]
    target_config: dict[str, Any]
    embed: torch.Tensor  # the target's token embedding [vocab, hidden], float32
    head: torch.Tensor  # the target's output head [vocab, hidden], float32


def record_corpus(
    model: str,
    layer_ids: Sequence[int] | None = None,
    *,
    num_taps: int = 4,
    count: int,
    max_tokens: int,
    temperature: float = 0.7,
    top_p: float = 0.95,
    seed: int = 0,
    dtype: str = "float32",
    max_num_seqs: int = 32,
    store_dtype: torch.dtype = torch.float16,
    copy_share: float | None = None,
    progress: Callable[[str], None] | None = None,
) -> Corpus:
    """Generate ``count`` responses with the target ``model`` and record them at ``layer_ids``
    (None: ``num_taps`` layers, ``spread_layers``), as the module docstring says."""
    from powertrain import LLM, EngineConfig, SamplingParams

    say = progress or (lambda _: None)
    config = EngineConfig(sections={"dspark": {"drafter": "ngram", "max_draft_tokens": 1}})
    settings = {"speculative": "fixed-k", "dtype": dtype, "prefix_caching": False, "max_num_seqs": max_num_seqs}
    with LLM(model, config=config, **settings) as llm:
        policy = llm.speculative_policy
        if policy is None or not hasattr(policy, "drafter"):
            raise ValueError(f"{model}: the engine built no DSpark policy to record the target's hidden states with")
        target_config = dict(llm.engine.model_config)  # type: ignore[attr-defined]
        if layer_ids is None:
            layer_ids = spread_layers(int(target_config["num_hidden_layers"]), num_taps)
        log = HiddenStateLog(layer_ids, store_dtype)
        policy.drafter = log  # type: ignore[attr-defined]
        prompts = chat_prompts(
            lambda messages: llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True),
            count,
            seed,
            copy_share,
        )
        params = [
            SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_tokens, seed=seed + i)
            for i in range(count)
        ]
        say(f"generating {count} responses of up to {max_tokens} tokens at temperature {temperature}")
        started = time.perf_counter()
        taps, log.taps = log.taps, ()  # generate on the engine's fast path, asking for no taps
        outputs = llm.generate(prompts, params)
        generated = sum(len(o.outputs[0].token_ids) for o in outputs)
        say(f"generated {generated} tokens in {time.perf_counter() - started:.0f} s; recording hidden states")
        started, log.taps = time.perf_counter(), taps
        sequences = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outputs]
        llm.generate(sequences, SamplingParams(temperature=0, max_tokens=1))  # every row a prompt row
        say(f"recorded {sum(map(len, sequences))} positions in {time.perf_counter() - started:.0f} s")
        embed, head = target_embedding_and_head(llm)
    prompt_lengths = {tuple(s): len(o.prompt_token_ids) for s, o in zip(sequences, outputs, strict=True)}
    samples = []
    for tokens, tapped, final in log.sequences().values():
        prompt = prompt_lengths.get(tuple(tokens.tolist()))
        if prompt is None or prompt >= len(tokens):
            continue
        mask = torch.arange(len(tokens)) >= prompt
        samples.append(Sample(tokens=tokens, taps=tapped, final=final, loss_mask=mask))
    samples.sort(key=lambda s: s.tokens.tolist())  # independent of the engine's sequence ids
    return Corpus(samples, list(layer_ids), target_config, embed, head)


def target_embedding_and_head(llm: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's token embedding and output head as float32 ``[vocab, hidden]`` tensors,
    read by running them (a GGUF model keeps both quantised: the embedding on every token
    id, the head on the identity)."""
    runner = llm.engine.runner
    model, device = runner.model, runner.device
    embedding = model.model.embed_tokens
    with torch.inference_mode():
        rows = embedding(torch.arange(embedding.num_embeddings, device=device))
        embed = rows.float().cpu()
        weight = getattr(model.lm_head, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.is_floating_point() and weight.shape == embed.shape:
            return embed, weight.float().cpu()
        eye = torch.eye(embed.shape[1], device=device, dtype=rows.dtype)
        return embed, model.lm_head(eye).float().T.contiguous().cpu()


# --------------------------------------------------------------------------- the model


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, config: BlockDrafterConfig) -> None:
        super().__init__()
        a = config.layers
        self.heads, self.kv_heads, self.head_dim = a.num_heads, a.num_kv_heads, a.head_dim
        self.q_proj = nn.Linear(a.hidden_size, a.num_heads * a.head_dim, bias=a.qkv_bias)
        self.k_proj = nn.Linear(a.hidden_size, a.num_kv_heads * a.head_dim, bias=a.qkv_bias)
        self.v_proj = nn.Linear(a.hidden_size, a.num_kv_heads * a.head_dim, bias=a.qkv_bias)
        self.o_proj = nn.Linear(a.num_heads * a.head_dim, a.hidden_size, bias=a.o_bias)
        self.q_norm = RMSNorm(a.head_dim, a.rms_norm_eps)
        self.k_norm = RMSNorm(a.head_dim, a.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, context: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor
    ) -> torch.Tensor:
        """``x`` ``[n, q, hidden]`` (the blocks), ``context`` ``[n, c, hidden]``; ``rotary``
        per key ``[n, c + q, half]`` (the queries take the last ``q``)."""
        n, q_len, _ = x.shape
        sources = torch.cat([context, x], dim=1)
        keys = sources.shape[1]
        cos, sin = rotary
        q = self.q_norm(self.q_proj(x).view(n * q_len, self.heads, self.head_dim))
        q = apply_rotary(q, cos[:, -q_len:].reshape(n * q_len, -1), sin[:, -q_len:].reshape(n * q_len, -1))
        k = self.k_norm(self.k_proj(sources).view(n * keys, self.kv_heads, self.head_dim))
        k = apply_rotary(k, cos.reshape(n * keys, -1), sin.reshape(n * keys, -1))
        v = self.v_proj(sources).view(n, keys, self.kv_heads, self.head_dim)
        q = q.view(n, q_len, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(n, keys, self.kv_heads, self.head_dim).transpose(1, 2)
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, 1), v.transpose(1, 2).repeat_interleave(group, 1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.head_dim**-0.5)
        return self.o_proj(out.transpose(1, 2).reshape(n, q_len, -1))


class MLP(nn.Module):
    def __init__(self, config: BlockDrafterConfig) -> None:
        super().__init__()
        a = config.layers
        self.gate_proj = nn.Linear(a.hidden_size, a.intermediate_size, bias=a.mlp_bias)
        self.up_proj = nn.Linear(a.hidden_size, a.intermediate_size, bias=a.mlp_bias)
        self.down_proj = nn.Linear(a.intermediate_size, a.hidden_size, bias=a.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, config: BlockDrafterConfig) -> None:
        super().__init__()
        eps = config.layers.rms_norm_eps
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.layers.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.layers.hidden_size, eps)

    def forward(
        self, x: torch.Tensor, context: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), context, rotary, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class MarkovHead(nn.Module):
    def __init__(self, config: BlockDrafterConfig) -> None:
        super().__init__()
        vocab, rank = config.layers.vocab_size, config.markov_rank
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = nn.Linear(rank, vocab, bias=False)
        gated = config.markov_head_type == "gated"
        self.gate_proj = nn.Linear(config.layers.hidden_size + rank, rank) if gated else None

    def bias(self, previous: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        embedded = self.markov_w1(previous)
        if self.gate_proj is not None:
            embedded = torch.sigmoid(self.gate_proj(torch.cat([hidden, embedded], dim=-1))) * embedded
        return self.markov_w2(embedded)


class ConfidenceHead(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, 1)


class DenseBlockDrafter(nn.Module):
    """The block drafter's training forward (module docstring); its ``state_dict`` is a
    DeepSpec checkpoint's tensors."""

    def __init__(self, config: BlockDrafterConfig) -> None:
        super().__init__()
        a = config.layers
        if not a.qk_norm:
            raise ValueError("the DSpark drafter's layers are Qwen3's, with q/k norms")
        self.config = config
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = nn.ModuleList(Layer(config) for _ in range(a.num_layers))
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.fc = nn.Linear(len(config.target_layer_ids) * a.hidden_size, a.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.lm_head = nn.Linear(a.hidden_size, a.vocab_size, bias=False)
        self.markov_head = MarkovHead(config) if config.markov_rank else None
        width = a.hidden_size + (config.markov_rank if config.confidence_head_with_markov else 0)
        self.confidence_head = ConfidenceHead(width) if config.confidence_head else None
        self.rotary = RotaryEmbedding(a.head_dim, a.rope, a.max_position_embeddings)

    def initialize(self, embed: torch.Tensor, head: torch.Tensor, seed: int) -> None:
        """Draw every weight as transformers' ``_init_weights`` does for DeepSpec's model
        (N(0, 0.02), biases 0, norms 1), then copy the target's ``embed`` and ``head`` and
        freeze them (DeepSpec's ``initialize_embeddings_and_head``)."""
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, parameter in sorted(self.named_parameters()):
                if name.endswith("norm.weight"):
                    parameter.fill_(1.0)
                elif name.endswith(".bias"):
                    parameter.zero_()
                else:
                    parameter.copy_(0.02 * torch.randn(parameter.shape, generator=generator))
            self.embed_tokens.weight.copy_(embed)
            self.lm_head.weight.copy_(head)
        self.embed_tokens.requires_grad_(False)
        self.lm_head.requires_grad_(False)

    def forward(self, taps: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """Final-normed block outputs ``[n, anchors, block, hidden]`` of the blocks anchored at
        ``anchors`` ``[n, a]`` of each sequence (``tokens`` ``[n, T]``, ``taps`` ``[n, T, width]``):
        the anchor token and mask tokens at the positions after it, attending to the
        context rows before the anchor and to their own block."""
        n, length = tokens.shape
        count, size = anchors.shape[1], self.config.block_size
        context = self.hidden_norm(self.fc(taps.to(self.fc.weight.dtype)))
        ids = torch.full((n, count, size), self.config.mask_token_id, dtype=torch.int64, device=tokens.device)
        ids[..., 0] = tokens.gather(1, anchors)
        hidden = self.embed_tokens(ids).view(n, count * size, -1)
        offsets = torch.arange(size, device=tokens.device)
        block_positions = (anchors[..., None] + offsets).view(n, count * size)
        positions = torch.cat([torch.arange(length, device=tokens.device).expand(n, length), block_positions], dim=1)
        cos, sin = self.rotary(positions.reshape(-1), int(positions.max()) + 1, hidden.dtype)
        rotary = (cos.view(n, positions.shape[1], -1), sin.view(n, positions.shape[1], -1))
        mask = block_mask(anchors, length, size)
        for layer in self.layers:
            hidden = layer(hidden, context, rotary, mask)
        return self.norm(hidden).view(n, count, size, -1)

    def corrected_logits(self, hidden: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        return logits if self.markov_head is None else logits + self.markov_head.bias(previous, hidden)

    def confidence_logits(self, hidden: torch.Tensor, previous: torch.Tensor) -> torch.Tensor | None:
        if self.confidence_head is None:
            return None
        features = hidden
        if self.config.confidence_head_with_markov:
            assert self.markov_head is not None
            features = torch.cat([hidden, self.markov_head.markov_w1(previous)], dim=-1)
        return self.confidence_head.proj(features).squeeze(-1)


def block_mask(anchors: torch.Tensor, length: int, size: int) -> torch.Tensor:
    """DeepSpec's ``create_dspark_attention_mask`` as a boolean ``[n, 1, a * size, length +
    a * size]``: a block's rows see the context before its anchor and their own block."""
    n, count = anchors.shape
    per_row = anchors.repeat_interleave(size, dim=1)  # [n, a * size]
    context = torch.arange(length, device=anchors.device)[None, None, :] < per_row[..., None]
    block = torch.arange(count * size, device=anchors.device) // size
    own = (block[:, None] == block[None, :]).expand(n, -1, -1)
    return torch.cat([context, own], dim=-1)[:, None]


# --------------------------------------------------------------------------- the objective


@attrs.frozen(kw_only=True)
class Objective:
    """DeepSpec's loss weights (``config/dspark/dspark_qwen3_4b.py``)."""

    loss_decay_gamma: float = 4.0
    ce_loss_alpha: float = 0.1
    l1_loss_alpha: float = 0.9
    confidence_head_alpha: float = 1.0


@attrs.frozen
class Batch:
    tokens: torch.Tensor  # [n, T]
    taps: torch.Tensor  # [n, T, width]
    final: torch.Tensor  # [n, T, hidden]
    loss_mask: torch.Tensor  # [n, T]


def collate(samples: Sequence[Sample]) -> Batch:
    """Sequences padded to the longest (padding is masked out of the loss and never attended:
    anchors lie before it)."""
    length = max(len(s.tokens) for s in samples)

    def pad(tensors: list[torch.Tensor], value: Any = 0) -> torch.Tensor:
        out = torch.full((len(tensors), length, *tensors[0].shape[1:]), value, dtype=tensors[0].dtype)
        for row, tensor in enumerate(tensors):
            out[row, : len(tensor)] = tensor
        return out

    return Batch(
        tokens=pad([s.tokens for s in samples]),
        taps=pad([s.taps for s in samples]).float(),
        final=pad([s.final for s in samples]).float(),
        loss_mask=pad([s.loss_mask for s in samples], False),
    )


def sample_anchors(
    loss_mask: torch.Tensor, count: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSpec's ``sample_anchor_positions``: per sequence up to ``count`` distinct anchors,
    drawn uniformly from the positions whose token and next token are supervised, sorted;
    unused slots are anchor 0 with ``keep`` False."""
    n = loss_mask.shape[0]
    valid = loss_mask[:, :-1] & loss_mask[:, 1:]
    anchors = torch.zeros(n, count, dtype=torch.int64)
    keep = torch.zeros(n, count, dtype=torch.bool)
    for row in range(n):
        candidates = valid[row].nonzero().squeeze(-1)
        chosen = candidates[torch.randperm(len(candidates), generator=generator)[:count]].sort().values
        anchors[row, : len(chosen)], keep[row, : len(chosen)] = chosen, True
    return anchors, keep


def dspark_loss(
    model: DenseBlockDrafter, batch: Batch, anchors: torch.Tensor, keep: torch.Tensor, objective: Objective
) -> tuple[torch.Tensor, dict[str, Any]]:
    """DeepSpec's ``compute_dspark_loss`` (one process) and its statistics: per block position
    the acceptance probability ``1 - L1 / 2`` and whether the draft's argmax is the target's."""
    n, length = batch.tokens.shape
    size = model.config.block_size
    labels_at = anchors[..., None] + torch.arange(1, size + 1)  # [n, a, size]
    safe = labels_at.clamp(max=length - 1)
    gather = lambda t: t.gather(1, safe.view(n, -1)).view(safe.shape)  # noqa: E731
    labels = gather(batch.tokens)
    supervised = (labels_at < length) & keep[..., None] & gather(batch.loss_mask)
    supervised = supervised.to(torch.int32).cumprod(dim=-1).bool()  # DeepSpec's build_eval_mask
    weights = supervised.float() * torch.exp(-torch.arange(size).float() / objective.loss_decay_gamma)
    previous = torch.cat([batch.tokens.gather(1, anchors)[..., None], labels[..., :-1]], dim=-1)

    hidden = model(batch.taps, batch.tokens, anchors)
    rows = supervised.view(-1).nonzero().squeeze(-1)  # unsupervised rows weigh 0: skip their vocabulary
    hidden_rows = hidden.reshape(-1, hidden.shape[-1])[rows]
    previous_rows, label_rows, weight_rows = previous.view(-1)[rows], labels.view(-1)[rows], weights.view(-1)[rows]
    logits = model.corrected_logits(hidden_rows, previous_rows).float()
    with torch.no_grad():  # the target's distribution at position a + k, predicting a + k + 1
        at = (safe - 1).view(-1)[rows]
        final = batch.final[torch.arange(n).repeat_interleave(safe[0].numel())[rows], at]
        target = torch.softmax(model.lm_head(final).float(), dim=-1)
    probs = torch.softmax(logits, dim=-1)
    l1 = (probs - target).abs().sum(dim=-1)
    accept = (1 - 0.5 * l1).clamp(0, 1)
    total = weight_rows.sum() + 1e-6
    ce_loss = (F.cross_entropy(logits, label_rows, reduction="none") * weight_rows).sum() / total
    l1_loss = (l1 * weight_rows).sum() / total
    loss = objective.ce_loss_alpha * ce_loss + objective.l1_loss_alpha * l1_loss
    confidence = model.confidence_logits(hidden_rows, previous_rows)
    confidence_loss = torch.zeros(())
    if confidence is not None:
        bce = F.binary_cross_entropy_with_logits(confidence.float(), accept.detach(), reduction="none")
        confidence_loss = (bce * weight_rows).sum() / total
        loss = loss + objective.confidence_head_alpha * confidence_loss
    with torch.no_grad():
        slot = torch.arange(size).repeat(n * anchors.shape[1])[rows]
        agree = (logits.argmax(-1) == target.argmax(-1)).float()
        stats = {
            "loss": float(loss),
            "ce": float(ce_loss),
            "l1": float(l1_loss),
            "confidence": float(confidence_loss),
            "count": torch.bincount(slot, minlength=size).tolist(),
            "accept_sum": torch.zeros(size).index_add_(0, slot, accept).tolist(),
            "agree_sum": torch.zeros(size).index_add_(0, slot, agree).tolist(),
        }
    return loss, stats


# --------------------------------------------------------------------------- training


@attrs.frozen(kw_only=True)
class TrainSettings:
    steps: int = 1000
    batch_size: int = 4
    num_anchors: int = 32
    lr: float = 6e-4
    warmup: float = 0.04
    max_grad_norm: float = 1.0
    seed: int = 0
    objective: Objective = Objective()


def train(
    model: DenseBlockDrafter,
    samples: Sequence[Sample],
    settings: TrainSettings,
    progress: Callable[[str], None] | None = None,
    log_every: int = 25,
) -> list[dict[str, Any]]:
    """AdamW on the trainable parameters (DeepSpec's: lr 6e-4, no weight decay, clipping at
    1), linear warm-up then cosine decay; each step ``batch_size`` sequences (shuffled
    epochs) with ``num_anchors`` blocks each. Returns every step's statistics."""
    say = progress or (lambda _: None)
    parameters = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(parameters, lr=settings.lr, weight_decay=0.0)
    warmup = max(1, int(settings.warmup * settings.steps))

    def scale(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, settings.steps - warmup)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, scale)
    generator = torch.Generator().manual_seed(settings.seed)
    order: list[int] = []
    history = []
    started = time.perf_counter()
    model.train()
    for step in range(settings.steps):
        if len(order) < settings.batch_size:
            order += torch.randperm(len(samples), generator=generator).tolist()
        picked, order = order[: settings.batch_size], order[settings.batch_size :]
        batch = collate([samples[i] for i in picked])
        anchors, keep = sample_anchors(batch.loss_mask, settings.num_anchors, generator)
        loss, stats = dspark_loss(model, batch, anchors, keep, settings.objective)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(parameters, settings.max_grad_norm)
        optimizer.step()
        scheduler.step()
        history.append(stats)
        if (step + 1) % log_every == 0 or step + 1 == settings.steps:
            recent = history[-log_every:]
            mean = {k: sum(s[k] for s in recent) / len(recent) for k in ("loss", "ce", "l1", "confidence")}
            say(
                f"step {step + 1}/{settings.steps}  loss {mean['loss']:.4f}  ce {mean['ce']:.3f}  "
                f"l1 {mean['l1']:.3f}  confidence {mean['confidence']:.4f}  ({time.perf_counter() - started:.0f} s)"
            )
    model.eval()
    return history


@torch.no_grad()
def evaluate(
    model: DenseBlockDrafter, samples: Sequence[Sample], *, num_anchors: int = 32, batch_size: int = 4, seed: int = 0
) -> dict[str, Any]:
    """The objective's terms on ``samples`` (anchors drawn with ``seed``), and per block
    position the mean acceptance probability ``1 - L1 / 2`` and how often the draft's argmax
    is the target's; ``expected_accepted`` sums their running products along a block: the
    drafts a block expects accepted (sampling at temperature 1, and greedy), teacher-forced."""
    generator = torch.Generator().manual_seed(seed)
    size = model.config.block_size
    totals = {"count": [0.0] * size, "accept_sum": [0.0] * size, "agree_sum": [0.0] * size}
    terms = {"loss": 0.0, "ce": 0.0, "l1": 0.0, "confidence": 0.0}
    weight = 0.0
    for start in range(0, len(samples), batch_size):
        batch = collate(samples[start : start + batch_size])
        anchors, keep = sample_anchors(batch.loss_mask, num_anchors, generator)
        _, stats = dspark_loss(model, batch, anchors, keep, Objective())
        for key in totals:
            totals[key] = [a + b for a, b in zip(totals[key], stats[key], strict=True)]
        blocks = stats["count"][0]
        for key in terms:
            terms[key] += stats[key] * blocks
        weight += blocks
    accept = [s / c if c else 0.0 for s, c in zip(totals["accept_sum"], totals["count"], strict=True)]
    agree = [s / c if c else 0.0 for s, c in zip(totals["agree_sum"], totals["count"], strict=True)]
    return {
        **{key: value / max(weight, 1.0) for key, value in terms.items()},
        "blocks": int(weight),
        "accept_rate": accept,
        "greedy_agreement": agree,
        "expected_accepted": sum(math.prod(accept[: k + 1]) for k in range(size)),
        "expected_accepted_greedy": sum(math.prod(agree[: k + 1]) for k in range(size)),
    }


# --------------------------------------------------------------------------- the checkpoint


def drafter_config(
    target: Mapping[str, Any],
    *,
    layer_ids: Sequence[int],
    num_layers: int,
    block_size: int,
    markov_rank: int,
    mask_token_id: int,
    num_anchors: int,
) -> dict[str, Any]:
    """config.json of a drafter for ``target`` (its config): the target's shapes with what
    DeepSpec's ``build_draft_config`` sets, its layers Qwen3's."""
    heads = int(target["num_attention_heads"])
    config = {key: value for key, value in target.items() if not key.startswith("_")}
    config.update(
        architectures=["Qwen3DSparkModel"],
        model_type="qwen3",
        head_dim=int(target.get("head_dim") or int(target["hidden_size"]) // heads),
        num_target_layers=int(target["num_hidden_layers"]),
        num_hidden_layers=num_layers,
        block_size=block_size,
        tie_word_embeddings=False,
        layer_types=["full_attention"] * num_layers,
        use_sliding_window=False,
        sliding_window=None,
        mask_token_id=mask_token_id,
        target_layer_ids=list(layer_ids),
        num_anchors=num_anchors,
        enable_confidence_head=True,
        confidence_head_with_markov=markov_rank > 0,
        markov_rank=markov_rank,
    )
    config.pop("layer_types_sliding", None)
    if markov_rank:
        config["markov_head_type"] = "vanilla"
    return config


def save_drafter(model: DenseBlockDrafter, config: Mapping[str, Any], folder: str | Path, report: Any = None) -> Path:
    """The drafter in DeepSpec's format: config.json and model.safetensors (and the
    training report, if given)."""
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(dict(config), indent=2, sort_keys=True, default=str) + "\n")
    tensors = {name: t.detach().contiguous().clone() for name, t in model.state_dict().items()}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    if report is not None:
        (path / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    return path


def split(samples: Sequence[Sample], held_out: float, seed: int) -> tuple[list[Sample], list[Sample]]:
    order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(seed)).tolist()
    cut = len(order) - max(1, int(len(order) * held_out))
    return [samples[i] for i in order[:cut]], [samples[i] for i in order[cut:]]


def train_drafter(
    model: str,
    out: str | Path,
    *,
    responses: int = 512,
    max_tokens: int = 256,
    temperature: float = 0.7,
    layer_ids: Sequence[int] | None = None,
    num_taps: int = 4,
    num_layers: int = 1,
    block_size: int = 7,
    markov_rank: int = 64,
    mask_token_id: int = 0,
    settings: TrainSettings = TrainSettings(),
    held_out: float = 0.1,
    dtype: str = "float32",
    copy_share: float | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Record a corpus with ``model``, train a drafter on most of it, evaluate it on the rest
    and write it to ``out``; returns the report (also written there as training.json)."""
    from powertrain.models.dspark import read_drafter_config

    say = progress or (lambda _: None)
    torch.manual_seed(settings.seed)
    started = time.perf_counter()
    corpus = record_corpus(
        model, layer_ids, num_taps=num_taps, count=responses, max_tokens=max_tokens, temperature=temperature,
        seed=settings.seed, dtype=dtype, copy_share=copy_share, progress=say,
    )  # fmt: skip
    samples, target, layer_ids = corpus.samples, corpus.target_config, corpus.layer_ids
    recorded = time.perf_counter() - started
    fitting, held = split(samples, held_out, settings.seed)
    positions = sum(len(s.tokens) for s in samples)
    say(f"{len(samples)} sequences ({positions} positions): {len(fitting)} train, {len(held)} held out")
    config = drafter_config(
        target, layer_ids=layer_ids, num_layers=num_layers, block_size=block_size, markov_rank=markov_rank,
        mask_token_id=mask_token_id, num_anchors=settings.num_anchors,
    )  # fmt: skip
    parsed = BlockDrafterConfig.from_config(config, str(out))
    parsed.check_target(target, str(out))
    drafter = DenseBlockDrafter(parsed)
    drafter.initialize(corpus.embed, corpus.head, settings.seed)
    before = evaluate(drafter, held, num_anchors=settings.num_anchors, seed=settings.seed)
    history = train(drafter, fitting, settings, say)
    after = evaluate(drafter, held, num_anchors=settings.num_anchors, seed=settings.seed)
    report = {
        "target": str(model),
        "target_layer_ids": list(layer_ids),
        "corpus": {"responses": responses, "max_tokens": max_tokens, "temperature": temperature,
                   "copy_share": copy_share, "sequences": len(samples), "train": len(fitting), "held_out": len(held),
                   "positions": sum(len(s.tokens) for s in samples)},
        "settings": attrs.asdict(settings),
        "train_loss_first": history[0]["loss"],
        "train_loss_last": sum(s["loss"] for s in history[-25:]) / len(history[-25:]),
        "held_out_before": before,
        "held_out_after": after,
        "seconds": {"record": recorded, "total": time.perf_counter() - started},
    }  # fmt: skip
    save_drafter(drafter, config, out, report)
    read_drafter_config(out)  # what the engine will read
    return report

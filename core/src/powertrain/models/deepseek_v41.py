"""DeepSeek-V4.1-Flash: V4's window attention, with compressed attention shared across layers
(CSA2), a two-level top-k, Engram memory, and mHC wired in a single lagged pass.

Read docs/deepseek_v41_notes.md first: this follows DeepSeek's official V4.1 inference code
(the oracle; ``core/tests/fixtures/deepseek_v41`` holds what it computed), with the
release's parameter names, except where that code is wrong (an index source whose ratio-2
group is still open scores another layer's keys there; here it scores its own group's).

- **Layer roles** (``V41Layout``). ``compress_ratios[i]``: 0, the layer attends its sliding
  window of raw keys only; 1 or 2, also one compressed entry per 1 or 2 tokens (2: the two
  tokens softmax-pooled per channel; 1: each token projected alone). Only the
  ``kv_source_layer_ids`` compute entries; each later layer of the same ratio, up to the
  next source, *reads the source's cache* (``CacheGroupSpec.read_from``: no copy, no second
  cache). The ``index_source_layer_ids`` pick, per query, the ``index_topk`` entries it
  attends (ReLU scores of the indexer's queries against keys its group's source computed
  beside each entry); the layers between index sources reuse the last one's picks. From
  ``candidate_source_layer_id`` on, the candidate source's top ``candidate_topk_blocks``
  blocks of ``candidate_block_size`` entries (its newest block always among them) bound
  what every later index source may pick.
- **Caches are declarations**: every layer's window (``kv``); a ratio-2 source's per-token
  compressor rows (float32, sliding over one group, so an open group survives preemption
  and rolls back with drafts); a source's entries and indexer keys (one group, full
  history, read by its consumers); and the compressed token ids Engram hashes (sliding over
  ``engram_max_ngram_size`` tokens, on the first Engram layer). Chunked prefill, prefix
  caching, preemption and rollback move block ids and lengths, and nothing else.
- **Engram** (``layers/engram.py``): the rows a step reads depend on token ids only, so they
  are hashed before the first layer runs and gathered from the memory-mapped tables (never
  read into RAM at load, never on the device) on a worker thread while the layers before
  theirs run (on an accelerator through pinned memory, copied without blocking the host),
  then gated into the streams before the blocks of ``engram_layer_ids``.
- **mHC, lagged**: a block's attention reads the streams collapsed by the weights the block
  *before* computed for its FFN site, and its FFN by the weights its own attention site
  computed; the last FFN site's weights collapse the streams for the final norm.
- **MoE**: sqrtsoftplus scores of the logits over ``gate_temp`` (folded into the router's
  weight at load), correction-bias picks, normalised top-k weights times the routed
  scaling, clamped SwiGLU experts, one shared expert.
- Logits come from a float32 head. ``mtp.*``, DSpark's drafter, is built and loaded as
  ``model.dspark`` when the config sets ``dspark_block_size`` (``deepseek_v41_dspark``; the
  target records the streams it reads, ``tap_forms``).
- **Images** (``deepseek_v41_vision``): where the config has a vision tower it is built as
  ``model.vision_tower`` (``vision.*``, ``aligner.*``, ``image_*``) with each layer's router
  bias for image positions (``ffn.gate.bias_vl``). ``forward(..., image_rows=ImageRows(...))``
  puts the encoded span rows in place of those rows' token embeddings; those rows route with
  ``bias_vl`` instead of ``bias``, and Engram skips them: their own gate is shut, and no
  n-gram reaches back across them (their compressed ids are cached as ``ENGRAM_DEAD``, so a
  later step still stops there). A text-only checkpoint's image tensors are not read; the
  load says so.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import attrs
import structlog
import torch
import torch.nn.functional as F
from torch import nn

from powertrain.interfaces import (
    AttentionLayerSpec,
    AttentionMetadata,
    CacheGroupSpec,
    KVTensorSpec,
    LayerKVCache,
    ModelContext,
    TapRecorder,
    V4AttentionBackend,
)
from powertrain.interfaces.moe import RoutingConfig
from powertrain.layers.compressed_attention import (
    GroupedLinear,
    V4RMSNorm,
    attend_window_and_entries,
    rotate_trailing,
)
from powertrain.layers.engram import EngramLayout, NgramHasher, compressed_token_map
from powertrain.layers.hyper_connections import HyperConnection, collapse_with
from powertrain.layers.linear import Linear
from powertrain.layers.moe import MoE, SharedExpertMoE
from powertrain.layers.paged import read_entries, write_entries
from powertrain.layers.rotary import RopeParameters, RotaryEmbedding, deepseek_rope_tables
from powertrain.loader.mapped_rows import MappedFp8Rows
from powertrain.models.config_reading import required_reader
from powertrain.models.deepseek_v41_dspark import DeepseekV41DSpark, DSparkArgs
from powertrain.models.deepseek_v41_vision import DeepseekV41Vision, ImageRows, VisionArgs
from powertrain.models.weights import check_complete, copy_checked, held_here

log = structlog.get_logger(__name__)

ARCHITECTURES = frozenset({"DeepseekV41ForCausalLM", "DeepseekV41ForConditionalGeneration"})
#: Checkpoint tensors another issue's component reads: prefix or pattern -> what reads them.
NOT_USED_YET: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"^(vision|aligner)\.|^image_"), "the vision tower (images)"),
    (re.compile(r"\.ffn\.gate\.bias_vl$"), "the image tokens' router bias (images)"),
)
#: With a vision tower, only DSpark's image router biases stay unread: drafts are text
#: (the official code runs its DSpark blocks without the image mask).
NOT_USED_WITH_VISION: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"^mtp\.\d+\.ffn\.gate\.bias_vl$"), "DSpark's image-token router bias (drafts are text)"),
)
#: The compressed id Engram caches for an image position: no n-gram reaches back across it.
ENGRAM_DEAD = -1
#: transformers' spelling (the pull request's ``DeepseekV41ForCausalLM`` keeps the release's
#: names under ``model.``, the head as ``lm_head``) -> the release's.
HF_NAMES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"^model\."), ""),
    (re.compile(r"^lm_head\.weight$"), "head.weight"),
)
#: The release's names -> this module's, where they differ.
RENAMES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"^layers\.(\d+)\.hc_(attn|ffn)_(fn|base|scale)$"), r"layers.\1.\2_hc.\3"),
    (re.compile(r"^layers\.(\d+)\.ffn\.gate\.bias_vl$"), r"layers.\1.image_router_bias"),
    (re.compile(r"^(vision\.|aligner\.|image_(start|end|newline)$)"), r"vision_tower.\1"),
    (re.compile(r"^mtp\.(\d+)\.hc_(attn|ffn)_(fn|base|scale)$"), r"dspark.stages.\1.\2_hc.\3"),
    (re.compile(r"^mtp\."), "dspark.stages."),
)
#: DSpark's copies of the target's embedding and head (the drafter uses the target's).
_DSPARK_COPIES = re.compile(r"^mtp\.\d+\.(embed|head)\.weight$")
_ENGRAM_TABLE = re.compile(r"^layers\.(\d+)\.engram\.embed\.(weight|weight_scale_inv|scale)$")
_ROUTED = re.compile(r"^(layers|dspark\.stages)\.(\d+)\.ffn\.((?:gate|experts)\..*)$")


# --------------------------------------------------------------------------- config


@attrs.frozen(kw_only=True)
class LayerRole:
    """What one layer computes and reads (see the module docstring)."""

    ratio: int
    #: The layer whose compressed entries (and indexer keys) this layer attends; None at ratio 0.
    group_source: int | None
    index_source: bool
    candidate_source: bool
    uses_candidates: bool

    @property
    def owns_group(self) -> bool:
        return self.ratio > 0 and self.group_source is None


@attrs.frozen(kw_only=True)
class EngramArgs:
    layer_ids: tuple[int, ...]
    max_ngram_size: int
    n_heads: int
    head_dim: int
    vocab_size: int
    pad_id: int
    compressed_vocab_size: int

    @property
    def layout(self) -> EngramLayout:
        return EngramLayout.build(self.layer_ids, self.max_ngram_size, self.n_heads, self.head_dim, self.vocab_size)


@attrs.frozen(kw_only=True)
class V41Args:
    """The ``text_config`` fields this model reads (the transformers pull request's names)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    roles: tuple[LayerRole, ...]
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    candidate_topk_blocks: int
    candidate_block_size: int
    num_experts: int
    top_k: int
    n_shared_experts: int
    moe_intermediate_size: int
    routed_scaling_factor: float
    gate_temp: float
    norm_topk_prob: bool
    swiglu_limit: float | None
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_norm_eps: float
    max_position_embeddings: int
    main_rope: RopeParameters
    compress_rope: RopeParameters
    engram: EngramArgs | None

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> V41Args:
        text = config.get("text_config", config)
        required = required_reader(text, "DeepSeek-V4.1 text_config")
        layers = int(required("num_hidden_layers"))
        head_dim = int(required("head_dim"))
        rope_dim = int(required("qk_rope_head_dim"))
        if text.get("scoring_func", "sqrtsoftplus") != "sqrtsoftplus":
            raise ValueError(
                f"DeepSeek-V4.1 routes with sqrtsoftplus scores, text_config says {text['scoring_func']!r}"
            )
        if text.get("topk_method", "noaux_tc") != "noaux_tc":
            raise ValueError(f"DeepSeek-V4.1 picks experts with noaux_tc, text_config says {text['topk_method']!r}")
        main, compress = deepseek_rope_tables(text, rope_dim / head_dim)
        limit = text.get("swiglu_limit")
        gate_temp = float(text.get("gate_temp") or 1.0)
        if gate_temp <= 0:
            raise ValueError(f"DeepSeek-V4.1 text_config gate_temp must be positive, got {gate_temp}")
        return cls(
            vocab_size=int(required("vocab_size")),
            hidden_size=int(required("hidden_size")),
            num_layers=layers,
            num_heads=int(required("num_attention_heads")),
            head_dim=head_dim,
            rope_head_dim=rope_dim,
            q_lora_rank=int(required("q_lora_rank")),
            o_groups=int(required("o_groups")),
            o_lora_rank=int(required("o_lora_rank")),
            sliding_window=int(required("sliding_window")),
            roles=layer_roles(text, layers),
            index_n_heads=int(text.get("index_n_heads") or 0),
            index_head_dim=int(text.get("index_head_dim") or 0),
            index_topk=int(text.get("index_topk") or 0),
            candidate_topk_blocks=int(text.get("candidate_topk_blocks") or 0),
            candidate_block_size=int(text.get("candidate_block_size") or 0),
            num_experts=int(required("n_routed_experts")),
            top_k=int(required("num_experts_per_tok")),
            n_shared_experts=int(text.get("n_shared_experts") or 0),
            moe_intermediate_size=int(required("moe_intermediate_size")),
            routed_scaling_factor=float(text.get("routed_scaling_factor") or 1.0),
            gate_temp=gate_temp,
            norm_topk_prob=bool(text.get("norm_topk_prob", True)),
            swiglu_limit=None if limit is None or float(limit) <= 0 else float(limit),
            hc_mult=int(required("hc_mult")),
            hc_sinkhorn_iters=int(required("hc_sinkhorn_iters")),
            hc_eps=float(required("hc_eps")),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(text.get("max_position_embeddings") or 4096),
            main_rope=main,
            compress_rope=compress,
            engram=_engram_args(text, layers),
        )

    @property
    def routing(self) -> RoutingConfig:
        return RoutingConfig(
            num_experts=self.num_experts,
            top_k=self.top_k,
            scoring="sqrtsoftplus",
            topk_method="noaux_tc",
            norm_topk_prob=self.norm_topk_prob,
            routed_scaling_factor=self.routed_scaling_factor,
        )


def layer_roles(text: Mapping[str, Any], layers: int) -> tuple[LayerRole, ...]:
    """Each layer's role from ``compress_ratios``, ``kv_source_layer_ids``,
    ``index_source_layer_ids`` and ``candidate_source_layer_id``; a schedule the official
    code would silently misread (a reader before any source, a source of another ratio, a
    group whose entries no index source picks) is refused naming the layer and the key to fix."""
    where = "DeepSeek-V4.1 text_config"
    ratios = [int(r) for r in text.get("compress_ratios") or []][:layers]
    if len(ratios) != layers or any(r not in (0, 1, 2) for r in ratios):
        raise ValueError(f"{where}: compress_ratios needs {layers} entries (then the MTP layers'), each 0, 1 or 2")
    kv_sources = sorted(int(i) for i in text.get("kv_source_layer_ids") or [])
    index_sources = sorted(int(i) for i in text.get("index_source_layer_ids") or [])
    candidate = int(text.get("candidate_source_layer_id", -1))
    for key, ids in (("kv_source_layer_ids", kv_sources), ("index_source_layer_ids", index_sources)):
        bad = [i for i in ids if not 0 <= i < layers or ratios[i] == 0]
        if bad:
            raise ValueError(f"{where}: {key} names layer(s) {bad}, which are not compressed layers (ratio 1 or 2)")
    roles: list[LayerRole] = []
    source: int | None = None
    last_index: int | None = None
    for layer, ratio in enumerate(ratios):
        if ratio == 0:
            roles.append(LayerRole(ratio=0, group_source=None, index_source=False, candidate_source=False,
                                   uses_candidates=False))  # fmt: skip
            continue
        if layer in kv_sources:
            source = layer
        if source is None or ratios[source] != ratio:
            raise ValueError(
                f"{where}: layer {layer} (compress ratio {ratio}) has no earlier KV source of ratio {ratio} to read; "
                "add one to kv_source_layer_ids"
            )
        # A source that is no index source fails here (nothing before it in its group picks),
        # so every index source's group has a source computing indexer keys.
        is_index = layer in index_sources
        if is_index:
            last_index = layer
        elif last_index is None or last_index < source:
            raise ValueError(
                f"{where}: layer {layer} attends KV source {source}'s entries but no index source of that group "
                "before it picks them; add one to index_source_layer_ids"
            )
        roles.append(
            LayerRole(
                ratio=ratio,
                group_source=None if source == layer else source,
                index_source=is_index,
                candidate_source=layer == candidate,
                uses_candidates=is_index and 0 <= candidate < layer,
            )
        )
    if candidate >= 0:
        if candidate >= layers or not roles[candidate].index_source:
            raise ValueError(f"{where}: candidate_source_layer_id {candidate} must be an index source")
        group = _group_of(roles, candidate)
        strays = [i for i, r in enumerate(roles) if r.uses_candidates and _group_of(roles, i) != group]
        if strays:
            raise ValueError(
                f"{where}: index sources {strays} come after candidate source {candidate} but read another KV "
                "group, whose entries its candidate blocks do not number"
            )
        if int(text.get("candidate_topk_blocks") or 0) < 1 or int(text.get("candidate_block_size") or 0) < 1:
            raise ValueError(f"{where}: a candidate source needs candidate_topk_blocks and candidate_block_size >= 1")
    return tuple(roles)


def _group_of(roles: Sequence[LayerRole], layer: int) -> int:
    source = roles[layer].group_source
    return layer if source is None else source


def _engram_args(text: Mapping[str, Any], layers: int) -> EngramArgs | None:
    ids = tuple(int(i) for i in text.get("engram_layer_ids") or [])
    if not ids:
        return None
    if any(not 0 <= i < layers for i in ids):
        raise ValueError(f"DeepSeek-V4.1 text_config: engram_layer_ids {list(ids)} must be layers 0..{layers - 1}")
    required = required_reader(text, "DeepSeek-V4.1 text_config (Engram)")
    return EngramArgs(
        layer_ids=ids,
        max_ngram_size=int(required("engram_max_ngram_size")),
        n_heads=int(required("engram_n_heads")),
        head_dim=int(required("engram_head_dim")),
        vocab_size=int(required("engram_vocab_size")),
        pad_id=int(text.get("engram_pad_id", 2)),
        compressed_vocab_size=int(required("engram_compressed_vocab_size")),
    )


# --------------------------------------------------------------------------- attention


@attrs.define
class StepPicks:
    """What an index source hands the layers after it within one forward: its picks
    (``[tokens, index_topk]`` entry numbers, -1 unused) and, from the candidate source,
    each sequence's allowed entries (bool ``[its tokens, entries]``)."""

    picks: torch.Tensor | None = None
    candidates: list[torch.Tensor | None] = attrs.field(factory=list)


class V41Compressor(nn.Module):
    """A KV source's entries: ratio 1, ``norm(wkv(x))`` per token; ratio 2, the two tokens'
    ``wkv(x)`` weighed per channel by the softmax of their ``wgate(x)``, in float32, then
    the norm. Its rows (projections and gate logits) are cached per token, so a group
    whose tokens arrive in two steps is pooled from both."""

    def __init__(self, hidden_size: int, head_dim: int, ratio: int, eps: float) -> None:
        super().__init__()
        self.ratio, self.head_dim = ratio, head_dim
        # DeepSeek keeps the pooled compressor's projections in float32.
        dtype = torch.float32 if ratio > 1 else None
        self.wkv = Linear(hidden_size, head_dim, bias=False, dtype=dtype)
        self.wgate = Linear(hidden_size, head_dim, bias=False, dtype=dtype) if ratio > 1 else None
        self.norm = V4RMSNorm(head_dim, eps)

    def rows(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 ``[n, 2 * head_dim]``: ``[wkv(x) | wgate(x)]`` (ratio 2 only)."""
        assert self.wgate is not None
        x = hidden.float()
        return torch.cat((self.wkv(x), self.wgate(x)), dim=-1)

    def pooled(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Entries ``[groups, head_dim]`` from whole groups' rows ``[groups * ratio, 2 * head_dim]``."""
        kv, gate = rows.float().view(-1, self.ratio, 2 * self.head_dim).split(self.head_dim, dim=-1)
        return self.norm((kv * gate.softmax(dim=1)).sum(dim=1).to(dtype))

    def direct(self, hidden: torch.Tensor) -> torch.Tensor:
        """Ratio 1: one entry per token."""
        return self.norm(self.wkv(hidden))


class V41Indexer(nn.Module):
    """An index source's picks: score ``sum_h w[h] relu(q[h] . k[e])`` for every visible entry
    ``e`` (float32), mask by the candidates where the layer uses them, take the top
    ``topk``, ties to the lower entry. Where it owns its group, it also turns each new
    entry's pre-RoPE latent into that entry's key."""

    def __init__(self, args: V41Args, owns_keys: bool) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.topk = args.index_n_heads, args.index_head_dim, args.index_topk
        self.wq_b = Linear(args.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.weights_proj = Linear(args.hidden_size, self.n_heads, bias=False)
        self.wk = Linear(args.head_dim, self.head_dim, bias=False) if owns_keys else None
        self.k_norm = V4RMSNorm(self.head_dim, args.rms_norm_eps) if owns_keys else None

    def keys(self, latent: torch.Tensor) -> torch.Tensor:
        assert self.wk is not None and self.k_norm is not None
        return self.k_norm(self.wk(latent))

    def scores(
        self, q_resid: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 rotated queries ``[n, heads, head_dim]`` and head weights ``[n, heads]``
        (every scale of the score folded in: the ReLU commutes with a positive one)."""
        q = self.wq_b(q_resid).view(-1, self.n_heads, self.head_dim)
        q = rotate_trailing(q, cos.unsqueeze(1), sin.unsqueeze(1)).float()
        weights = self.weights_proj(hidden).float() * (self.head_dim**-0.5 * self.n_heads**-0.5)
        return q, weights


def candidate_blocks(score: torch.Tensor, visible: torch.Tensor, top_blocks: int, block_size: int) -> torch.Tensor:
    """bool ``[q, entries]``: the entries of each query's top ``top_blocks`` blocks of
    ``block_size`` entries by their best score, the block of its newest visible entry always
    among them, blocks with nothing visible never (DeepSeek's ``select_candidate_blocks``)."""
    queries, width = score.shape
    blocks = -(-width // block_size)
    padded = F.pad(score, (0, blocks * block_size - width), value=float("-inf"))
    best = padded.view(queries, blocks, block_size).amax(dim=-1)
    newest = torch.div(visible - 1, block_size, rounding_mode="floor")  # -1: nothing visible, nothing pinned
    best = best.masked_fill(torch.arange(blocks, device=score.device)[None, :] == newest[:, None], float("inf"))
    values, chosen = stable_topk(best, min(top_blocks, blocks))
    keep = torch.zeros(queries, blocks, dtype=torch.bool, device=score.device)
    keep.scatter_(1, chosen, values > float("-inf"))
    return keep.repeat_interleave(block_size, dim=1)[:, :width]


def stable_topk(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest of each row, ties to the lower index: DeepSeek's ``topk`` leaves ties
    (exact-zero ReLU scores are common) to the kernel, which on a CPU picks by row width, so
    a prefill and a decode step of the same tokens could attend different entries."""
    ordered, index = torch.sort(values, dim=-1, descending=True, stable=True)
    return ordered[..., :k], index[..., :k]


class V41Attention(nn.Module):
    """One V4.1 attention layer: V4's shared-KV window attention with sinks and the grouped
    output projection, plus the compressed entries of its group as its role says."""

    def __init__(self, args: V41Args, layer: int, backend: object) -> None:
        super().__init__()
        self.args, self.layer = args, layer
        self.role = role = args.roles[layer]
        # The backend's kernel where it declares ``v4-attention`` (the same contract: a window
        # plus listed compressed entries); the same computation in torch where it does not.
        self.attend = backend.forward_v4 if isinstance(backend, V4AttentionBackend) else attend_window_and_entries
        h, heads, d = args.hidden_size, args.num_heads, args.head_dim
        self.wq_a = Linear(h, args.q_lora_rank, bias=False)
        self.q_norm = V4RMSNorm(args.q_lora_rank, args.rms_norm_eps)
        self.wq_b = Linear(args.q_lora_rank, heads * d, bias=False)
        self.wkv = Linear(h, d, bias=False)
        self.kv_norm = V4RMSNorm(d, args.rms_norm_eps)
        self.wo_a = GroupedLinear(heads * d // args.o_groups, args.o_groups * args.o_lora_rank, args.o_groups)
        self.wo_b = Linear(args.o_groups * args.o_lora_rank, h, bias=False)
        self.attn_sink = nn.Parameter(torch.empty(heads, dtype=torch.float32))
        self.rope = "main" if role.ratio == 0 else "compress"
        self.compressor = V41Compressor(h, d, role.ratio, args.rms_norm_eps) if role.owns_group else None
        self.indexer = V41Indexer(args, owns_keys=role.owns_group) if role.index_source else None
        self.spec = AttentionLayerSpec(
            kind="custom", num_heads=heads, num_kv_heads=1, head_size=d, scale=d**-0.5, cache_groups=self._groups()
        )

    def _groups(self) -> list[CacheGroupSpec]:
        a, role = self.args, self.role
        groups = [
            CacheGroupSpec(
                name="window", tensors=(KVTensorSpec(name="kv", shape=(a.head_dim,)),), sliding_window=a.sliding_window
            )
        ]
        if role.ratio == 0:
            return groups
        entries = compressed_group(a, role.ratio)
        groups.append(entries if role.owns_group else entries.read_from(role.group_source))
        if role.owns_group and role.ratio > 1:
            groups.append(
                CacheGroupSpec(
                    name="compressor_rows",
                    tensors=(KVTensorSpec(name="compressor_rows", shape=(2 * a.head_dim,)),),
                    sliding_window=role.ratio,
                    dtype=torch.float32,
                )
            )
        return groups

    def forward(
        self,
        hidden: torch.Tensor,  # [n, hidden]: the normed, collapsed streams
        positions: torch.Tensor,
        rope: Mapping[str, RotaryEmbedding],
        kv_cache: LayerKVCache,
        metadata: AttentionMetadata,
        step: StepPicks,
    ) -> torch.Tensor:
        a, ratio = self.args, self.role.ratio
        table = rope[self.rope]
        cos, sin = table(positions, metadata.max_seq_len, torch.float32)  # rotations in float32, as DeepSeek's
        q_resid = self.q_norm(self.wq_a(hidden))
        q = rotate_trailing(self.wq_b(q_resid).view(-1, a.num_heads, a.head_dim), cos.unsqueeze(1), sin.unsqueeze(1))
        kv = rotate_trailing(self.kv_norm(self.wkv(hidden)), cos, sin)
        metadata.for_window(a.sliding_window).store(kv_cache["kv"], kv)
        if self.compressor is not None:
            self._compress(hidden, table, kv_cache, metadata)
        if self.indexer is not None:
            step.picks = self._pick(q_resid, hidden, positions, cos, sin, kv_cache, metadata, step)
        out = self.attend(
            self.spec,
            q,
            kv_cache,
            metadata,
            self.attn_sink,
            window=a.sliding_window,
            compress_rate=ratio or None,
            entry_indices=step.picks if ratio else None,
            derotate=(cos, sin),
        )
        return self.wo_b(self.wo_a(out.flatten(1)))

    def _compress(
        self, hidden: torch.Tensor, table: RotaryEmbedding, kv_cache: LayerKVCache, metadata: AttentionMetadata
    ) -> None:
        """The entries of the groups that close in this step (and their indexer keys),
        rotated at their group's first position, into the group's cache."""
        compressor, ratio = self.compressor, self.role.ratio
        assert compressor is not None
        if ratio > 1:
            rows_view = metadata.for_window(ratio)
            rows_view.store(kv_cache["compressor_rows"], compressor.rows(hidden))
        else:
            made_all = compressor.direct(hidden)
        full = metadata.for_window(None)
        for seq, (context, seq_len) in enumerate(zip(metadata.context_lens_host, metadata.seq_lens_host, strict=True)):
            first, last = context // ratio, seq_len // ratio  # groups closing in this step: [first, last)
            if first >= last:
                continue
            if ratio > 1:
                rows = read_entries(
                    kv_cache["compressor_rows"], rows_view.block_tables[seq], first * ratio, last * ratio
                )
                latent = compressor.pooled(rows, hidden.dtype)
            else:
                start = metadata.query_start_loc_host[seq]
                latent = made_all[start : start + last - first]
            cos, sin = table(
                torch.arange(first, last, device=hidden.device) * ratio, metadata.max_seq_len, torch.float32
            )
            write_entries(kv_cache["compressed"], full.block_tables[seq], first, rotate_trailing(latent, cos, sin))
            if self.indexer is not None:
                keys = rotate_trailing(self.indexer.keys(latent), cos, sin)
                write_entries(kv_cache["index_keys"], full.block_tables[seq], first, keys)

    def _pick(
        self,
        q_resid: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: LayerKVCache,
        metadata: AttentionMetadata,
        step: StepPicks,
    ) -> torch.Tensor:
        """This index source's picks ``[n, index_topk]`` (entry numbers of its group, -1 unused)."""
        indexer, role, ratio = self.indexer, self.role, self.role.ratio
        assert indexer is not None
        queries, weights = indexer.scores(q_resid, hidden, cos, sin)
        picks = torch.full((hidden.shape[0], indexer.topk), -1, dtype=torch.int32, device=hidden.device)
        full = metadata.for_window(None)
        if role.candidate_source:
            step.candidates = [None] * metadata.batch_size
        for seq, seq_len in enumerate(metadata.seq_lens_host):
            start, end = metadata.query_start_loc_host[seq], metadata.query_start_loc_host[seq + 1]
            count = seq_len // ratio
            if count == 0:
                continue
            keys = read_entries(kv_cache["index_keys"], full.block_tables[seq], 0, count).float()
            score = _index_scores(queries[start:end], keys, weights[start:end])
            visible = torch.div(positions[start:end] + 1, ratio, rounding_mode="floor")
            score = score.masked_fill(torch.arange(count, device=score.device)[None, :] >= visible[:, None], -torch.inf)
            if role.candidate_source:
                step.candidates[seq] = candidate_blocks(
                    score, visible, self.args.candidate_topk_blocks, self.args.candidate_block_size
                )
            if role.uses_candidates:
                allowed = step.candidates[seq] if step.candidates else None
                if allowed is None or allowed.shape != score.shape:
                    raise RuntimeError(f"layer {self.layer} uses candidate blocks no candidate source made this step")
                score = score.masked_fill(~allowed, -torch.inf)
            _, index = stable_topk(score, min(indexer.topk, count))
            # As DeepSeek's: only entries not yet visible become -1; where candidates leave fewer
            # than topk visible, the top-k also takes masked ones (lowest first).
            index = torch.where(index < visible[:, None], index, -1)
            picks[start:end, : index.shape[1]] = index.to(torch.int32)
        return picks


def _index_scores(queries: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """float32 ``[q, entries]``: ``sum_h weights[:, h] * relu(queries[:, h] . keys[e])``, one head
    at a time (a ``[q, heads, entries]`` product would take heads times the memory)."""
    score = torch.zeros(queries.shape[0], keys.shape[0], dtype=torch.float32, device=queries.device)
    for head in range(queries.shape[1]):
        score += (queries[:, head] @ keys.T).relu_() * weights[:, head, None]
    return score


def compressed_group(args: V41Args, ratio: int) -> CacheGroupSpec:
    """A KV source's entries and indexer keys: one of each per ``ratio`` tokens, whole history."""
    return CacheGroupSpec(
        name="compressed",
        tensors=(
            KVTensorSpec(name="compressed", shape=(args.head_dim,)),
            KVTensorSpec(name="index_keys", shape=(args.index_head_dim,)),
        ),
        tokens_per_entry=ratio,
    )


# --------------------------------------------------------------------------- Engram


class EngramGate(nn.Module):
    """One Engram layer: its table rows for each token projected to a key per stream and one
    value; each stream adds the value times a gate from how well its normalised state
    matches its key (DeepSeek's ``Engram.forward``)."""

    def __init__(self, args: V41Args, engram: EngramArgs) -> None:
        super().__init__()
        hc, d = args.hc_mult, args.hidden_size
        self.hc, self.eps = hc, args.rms_norm_eps
        columns = (engram.max_ngram_size - 1) * engram.n_heads
        self.q_weight = nn.Parameter(torch.empty(hc, d, dtype=torch.float32), requires_grad=False)
        self.k_weight = nn.Parameter(torch.empty(hc, d, dtype=torch.float32), requires_grad=False)
        self.wkv = Linear(columns * engram.head_dim, d * (hc + 1), bias=False)
        #: The table, mapped from the checkpoint at load (never in RAM or on the device).
        self.table: MappedFp8Rows | None = None

    def forward(self, streams: torch.Tensor, rows: torch.Tensor, shut: torch.Tensor | None = None) -> torch.Tensor:
        """``streams`` ``[n, hc, D]``; ``rows`` ``[n, columns * head_dim]`` (the gathered table rows);
        ``shut`` (bool ``[n]``, image rows): those rows pass through unchanged."""
        n, hc, d = streams.shape
        kv = self.wkv(rows.to(streams.dtype))
        key, value = kv[:, : hc * d].float().view(n, hc, d), kv[:, hc * d :].float()
        h = streams.float()
        dot = (h * (self.q_weight * self.k_weight) * key).sum(-1)
        dot = dot * torch.rsqrt(h.square().mean(-1) + self.eps) * torch.rsqrt(key.square().mean(-1) + self.eps)
        dot = dot * d**-0.5
        gate = torch.sigmoid(dot.sign() * dot.abs().clamp(min=1e-6).sqrt())
        if shut is not None:
            gate = gate.masked_fill(shut[:, None], 0.0)
        return (h + gate[..., None] * value[:, None, :]).to(streams.dtype)


class EngramRows(nn.Module):
    """Which table rows each token reads, per Engram layer: its compressed id is cached (a
    sliding group of ``max_ngram_size`` tokens), the n-grams ending at it hashed."""

    def __init__(self, engram: EngramArgs, token_map: Sequence[int], images: bool = False) -> None:
        super().__init__()
        self.engram = engram
        #: Image positions may be cached (``ENGRAM_DEAD``): n-grams then stop at them.
        self.images = images
        self.hasher = NgramHasher(engram.layout, engram.compressed_vocab_size)
        self.register_buffer("token_map", torch.tensor(token_map, dtype=torch.int64), persistent=False)
        self.pad = int(token_map[engram.pad_id])

    @property
    def group(self) -> CacheGroupSpec:
        return CacheGroupSpec(
            name="engram_tokens",
            tensors=(KVTensorSpec(name="engram_tokens", shape=(1,)),),
            sliding_window=self.engram.max_ngram_size,
            dtype=torch.float32,  # compressed ids are below 2**24: exact
        )

    def __call__(
        self,
        input_ids: torch.Tensor,
        kv_cache: LayerKVCache,
        metadata: AttentionMetadata,
        image_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """int64 ``[n, engram layers, columns]``: the rows of every token of the step. Rows of
        ``image_mask`` are cached as ``ENGRAM_DEAD``; a look-back reaching one (at this step or an
        earlier one) reads the pad id from there on, as DeepSeek's ``NgramHashState`` does."""
        compressed = self.token_map[input_ids]
        if image_mask is not None:
            compressed = compressed.masked_fill(image_mask, ENGRAM_DEAD)
        view = metadata.for_window(self.engram.max_ngram_size)
        view.store(kv_cache["engram_tokens"], compressed.float()[:, None])
        back = self.engram.max_ngram_size - 1
        grams = []
        for seq, seq_len in enumerate(metadata.seq_lens_host):
            start, end = metadata.query_start_loc_host[seq], metadata.query_start_loc_host[seq + 1]
            first = seq_len - (end - start)
            lo = max(0, first - back)
            known = read_entries(kv_cache["engram_tokens"], view.block_tables[seq], lo, seq_len)[:, 0].long()
            history = torch.cat((torch.full((back - (first - lo),), self.pad, device=known.device), known))
            offsets = torch.arange(end - start, device=known.device)[:, None] + back
            grams.append(history[offsets - torch.arange(back + 1, device=known.device)])
        gram = torch.cat(grams)  # [n, back + 1]: the token, then one further back per column
        if self.images:
            gram = gram.masked_fill((gram == ENGRAM_DEAD).cummax(dim=1).values, self.pad)
        return self.hasher.rows(gram)


# --------------------------------------------------------------------------- blocks


class V41Block(nn.Module):
    """Attention then MoE, each between an mHC collapse and expand, the collapses lagged
    one site (module docstring); Engram, where the layer has it, first."""

    def __init__(self, args: V41Args, layer: int, ctx: ModelContext, images: bool = False) -> None:
        super().__init__()
        hc = (args.hidden_size, args.hc_mult, args.hc_sinkhorn_iters, args.hc_eps, args.rms_norm_eps)
        self.attn_hc, self.ffn_hc = HyperConnection(*hc), HyperConnection(*hc)
        self.attn_norm = V4RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.ffn_norm = V4RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.attn = V41Attention(args, layer, ctx.attention)
        self.ffn = SharedExpertMoE(
            ctx,
            args.routing,
            args.hidden_size,
            args.moe_intermediate_size,
            n_shared=args.n_shared_experts,
            swiglu_limit=args.swiglu_limit,
        )
        engram = args.engram
        self.engram = EngramGate(args, engram) if engram is not None and layer in engram.layer_ids else None
        #: The router's correction bias for image positions (``ffn.gate.bias_vl``).
        self.image_router_bias = (
            nn.Parameter(torch.empty(args.num_experts, dtype=torch.float32), requires_grad=False) if images else None
        )

    def forward(
        self,
        streams: torch.Tensor,  # [n, hc_mult, hidden]
        pre: torch.Tensor,  # [n, hc_mult] float32: the previous site's collapse weights
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        rope: Mapping[str, RotaryEmbedding],
        kv_cache: LayerKVCache,
        metadata: AttentionMetadata,
        step: StepPicks,
        image_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        attn_pre, post, comb = self.attn_hc.weights(streams)
        out = self.attn(self.attn_norm(collapse_with(streams, pre)), positions, rope, kv_cache, metadata, step)
        streams = HyperConnection.expand_in_float32(streams, out, post, comb)
        ffn_pre, post, comb = self.ffn_hc.weights(streams)
        hidden = self.ffn_norm(collapse_with(streams, attn_pre))
        if image_mask is None:
            out = self.ffn(hidden, input_ids)
        else:
            out = self.ffn(hidden, input_ids, correction_bias=self._router_bias(image_mask))
        return HyperConnection.expand_in_float32(streams, out, post, comb), ffn_pre

    def _router_bias(self, image_mask: torch.Tensor) -> torch.Tensor:
        """float32 ``[n, experts]``: ``bias_vl`` at image rows, ``bias`` elsewhere."""
        text_bias = self.ffn.experts.e_score_correction_bias
        if self.image_router_bias is None or text_bias is None:
            raise ValueError("image rows need a model built with a vision tower (and noaux_tc routing)")
        return torch.where(image_mask[:, None], self.image_router_bias, text_bias)


class DeepseekV41ForCausalLM(nn.Module):
    """Implements ``interfaces.CausalLM`` for DeepSeek-V4.1 (the release's names and layout)."""

    #: The compressors, the indexers and Engram's n-grams read host lengths per sequence.
    captures_decode = False
    #: DSpark's drafter reads the mean of the streams entering its target layers.
    tap_forms = frozenset({"streams_mean_in"})
    taps: TapRecorder | None = None

    def __init__(self, ctx: ModelContext) -> None:
        super().__init__()
        self.args = args = V41Args.from_config(ctx.config)
        if ctx.moe is None:
            raise ValueError("DeepSeek-V4.1 needs a MoE backend (ModelContext.moe)")
        self._expert_slice = None if ctx.expert_parallel_size == 1 else ctx.local_experts(args.num_experts)
        self._fp4_experts = ctx.fp4_experts
        self._tensor_files = dict(ctx.tensor_files)
        #: What the load found in the checkpoint and left to another component: reader -> tensors.
        self.not_used: dict[str, int] = {}
        #: The vision tower's sizes; None for a text-only checkpoint.
        self.vision_args = VisionArgs.from_config(ctx.config)
        images = self.vision_args is not None
        self.engram_rows = (
            None if args.engram is None else EngramRows(args.engram, _token_map(ctx, args.engram), images=images)
        )
        with torch.device(ctx.device):
            previous = torch.get_default_dtype()
            torch.set_default_dtype(ctx.dtype)
            try:
                self.embed = nn.Embedding(
                    args.vocab_size, args.hidden_size, _weight=torch.empty(args.vocab_size, args.hidden_size)
                )
                self.layers = nn.ModuleList(V41Block(args, i, ctx, images) for i in range(args.num_layers))
                self.vision_tower = DeepseekV41Vision(self.vision_args) if self.vision_args is not None else None
                self.norm = V4RMSNorm(args.hidden_size, args.rms_norm_eps)
                # DeepSeek's head is float32, fed the normed state widened.
                self.head = Linear(args.hidden_size, args.vocab_size, bias=False, dtype=torch.float32)
                # DSpark's drafter (its MoE runs outside the target's forward: one process only).
                dspark = DSparkArgs.from_config(ctx.config.get("text_config", ctx.config), args.num_layers,
                                                args.num_experts, args.top_k)  # fmt: skip
                self.dspark = (
                    DeepseekV41DSpark(args, dspark, ctx, self.embed, self.head)
                    if dspark is not None and ctx.expert_parallel_size == 1
                    else None
                )
            finally:
                torch.set_default_dtype(previous)
        self.rope = {
            "main": RotaryEmbedding(args.head_dim, args.main_rope, args.max_position_embeddings),
            "compress": RotaryEmbedding(args.head_dim, args.compress_rope, args.max_position_embeddings),
        }
        self.requires_grad_(False)
        specs = [layer.attn.spec for layer in self.layers]
        if self.engram_rows is not None:
            first = args.engram.layer_ids[0] if args.engram else 0
            specs[first] = attrs.evolve(specs[first], cache_groups=(*specs[first].cache_groups, self.engram_rows.group))
        self.attention_layers: tuple[AttentionLayerSpec, ...] = tuple(specs)
        self._engram_cache_layer = args.engram.layer_ids[0] if args.engram else None
        self._gatherer: ThreadPoolExecutor | None = None
        self.mtp = None  # V4's MTP drafter: V4.1 drafts with ``dspark`` instead

    @property
    def image_encoder(self) -> DeepseekV41Vision | None:
        """``CausalLM.image_encoder``: the vision tower (None for a text-only checkpoint)."""
        return self.vision_tower

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[LayerKVCache],
        metadata: AttentionMetadata,
        *,
        image_rows: ImageRows | None = None,
    ) -> torch.Tensor:
        """Final-normed hidden states ``[num_tokens, hidden]`` of the flat batch. ``image_rows``:
        the rows of image spans in this batch and what they hold (``vision_tower.encode``)."""
        image_mask = None if image_rows is None else self._image_mask(input_ids, image_rows)
        gathered = self._engram_rows(input_ids, kv_caches, metadata, image_mask)
        embeds = self.embed(input_ids)
        if image_rows is not None:
            embeds = embeds.index_copy(0, image_rows.rows.to(embeds.device), image_rows.embeds.to(embeds))
        streams = embeds.unsqueeze(1).expand(-1, self.args.hc_mult, -1).contiguous()
        pre = torch.zeros(input_ids.shape[0], self.args.hc_mult, device=streams.device)
        pre[:, 0] = 1.0  # the first site reads stream 0 as it is
        step = StepPicks()
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            if layer.engram is not None:
                streams = layer.engram(streams, _ready(gathered[index]), image_mask)
            if self.taps is not None and self.taps.wants(index, "streams_mean_in"):
                self.taps.record(index, "streams_mean_in", streams.mean(dim=1))  # DSpark's drafter reads it
            streams, pre = layer(streams, pre, input_ids, positions, self.rope, kv_cache, metadata, step, image_mask)
        return self.norm(collapse_with(streams, pre))

    def _image_mask(self, input_ids: torch.Tensor, image_rows: ImageRows) -> torch.Tensor:
        """bool ``[num_tokens]``, True at image rows; checked against the model and the batch."""
        if self.vision_tower is None:
            raise ValueError(
                "this DeepSeek-V4.1 checkpoint has no vision tower: its config has no vision_config layers"
            )
        n = input_ids.shape[0]
        if image_rows.embeds.shape[1] != self.args.hidden_size:
            raise ValueError(f"image rows are {image_rows.embeds.shape[1]} wide, the model {self.args.hidden_size}")
        rows = image_rows.rows
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= n):
            raise ValueError(f"image rows must index the batch's {n} tokens, got {int(rows.min())}..{int(rows.max())}")
        return image_rows.mask(n, input_ids.device)

    def _engram_rows(
        self,
        input_ids: torch.Tensor,
        kv_caches: Sequence[LayerKVCache],
        metadata: AttentionMetadata,
        image_mask: torch.Tensor | None = None,
    ) -> dict[int, Future[tuple[torch.Tensor, Any]]]:
        """Every Engram layer's table rows for this step, each gathered on a worker thread while
        the layers before it run (the row ids depend on token ids only): from the mapped file
        into pinned memory and, on an accelerator, copied without blocking the host."""
        if self.engram_rows is None:
            return {}
        ids = self.engram_rows(input_ids, kv_caches[self._engram_cache_layer], metadata, image_mask).cpu()
        if self._gatherer is None:
            self._gatherer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engram-rows")
        device = input_ids.device
        return {
            layer: self._gatherer.submit(_gather_rows, self.layers[layer].engram, ids[:, slot], device)
            for slot, layer in enumerate(self.args.engram.layer_ids)
        }

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden.float())

    def naive_kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """A dense cache of every layer's shared 512-wide key (= value) per token: what
        full attention without a window or compression would keep."""
        return self.args.head_dim * self.args.num_layers * torch.empty((), dtype=dtype).element_size()

    # ----------------------------------------------------------------------- loading

    def routed_expert_layers(self) -> list[MoE]:
        return [layer.ffn.experts for layer in self.layers]

    def keep_fp4(self, name: str) -> bool:
        """Routed experts stay packed FP4 when the MoE backend multiplies FP4 itself."""
        return self._fp4_experts and ".ffn.experts." in name

    def wants_weight(self, name: str) -> bool:
        """False for what is mapped instead of read (Engram tables), for DSpark's copies of the
        embedding and head (the drafter shares the target's), for another issue's tensors
        (noted, reported at the end of the load; ``mtp.*`` where no drafter is built), and for
        another expert-parallel rank's routed experts."""
        name = _renamed(name, HF_NAMES)
        if _ENGRAM_TABLE.match(name) or (self.dspark is not None and _DSPARK_COPIES.match(name)):
            return False
        unread = NOT_USED_YET if self.vision_tower is None else NOT_USED_WITH_VISION
        readers = [reader for pattern, reader in unread if pattern.search(name)]
        if self.dspark is None and name.startswith("mtp."):
            readers = ["DSpark's drafter (speculative decoding)"]
        for reader in readers[:1]:
            self.not_used[reader] = self.not_used.get(reader, 0) + 1
            return False
        return held_here(name, self._expert_slice)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy tensors in under the release's names or transformers' (``HF_NAMES``, then
        ``RENAMES`` where this module's differ);
        routed experts and routers go through their MoE layer (the router's weight divided
        by ``gate_temp``); the Engram tables are mapped from their files. Raises ValueError
        naming unexpected and missing tensors."""
        targets = {name: param.data for name, param in self.named_parameters() if ".ffn.experts." not in name}
        loaded: set[str] = set()
        unexpected: list[str] = []
        self.not_used = {}
        with torch.no_grad():
            for stored, tensor in weights:
                if not self.wants_weight(stored):
                    continue
                name = _renamed(_renamed(stored, HF_NAMES), RENAMES)
                if name in targets:
                    copy_checked(stored, targets[name], tensor)
                    loaded.add(name)
                elif not self._load_routed(name, tensor):
                    unexpected.append(stored)
            for moe in self._all_routed_layers():
                moe.finish_loading()
        check_complete(type(self).__name__, unexpected, sorted(targets.keys() - loaded))
        self._map_engram_tables()
        if self.vision_tower is not None:
            tower = list(self.vision_tower.parameters())
            log.info(
                "vision tower loaded",
                parameters=sum(p.numel() for p in tower),
                bytes=sum(p.numel() * p.element_size() for p in tower),
                layers=self.vision_args.num_layers if self.vision_args else 0,
            )
        if self.not_used:
            log.info("checkpoint tensors present, not used yet", **{reader: n for reader, n in self.not_used.items()})

    def _all_routed_layers(self) -> list[MoE]:
        drafter = [] if self.dspark is None else [stage.ffn.experts for stage in self.dspark.stages]
        return self.routed_expert_layers() + drafter

    def _load_routed(self, name: str, tensor: torch.Tensor) -> bool:
        match = _ROUTED.match(name)
        if match is None:
            return False
        blocks = self.layers if match.group(1) == "layers" else self.dspark.stages if self.dspark else []
        if int(match.group(2)) >= len(blocks):
            return False
        rest = match.group(3)
        if rest == "gate.weight":
            tensor = tensor.float() / self.args.gate_temp  # sqrtsoftplus(x W / t) = sqrtsoftplus(x (W / t))
        return blocks[int(match.group(2))].ffn.experts.load_weight(rest, tensor)

    def _map_engram_tables(self) -> None:
        """Map each Engram layer's table from its file, checked against the config's layout."""
        if self.engram_rows is None:
            return
        engram = self.engram_rows.engram
        stored = {_renamed(name, HF_NAMES): name for name in self._tensor_files}
        for layer, rows in zip(engram.layer_ids, self.engram_rows.hasher.layout.table_rows, strict=True):
            prefix = f"layers.{layer}.engram.embed"
            if f"{prefix}.weight" not in stored:
                raise ValueError(
                    f"the checkpoint has no {prefix}.weight (layer {layer}'s Engram table, engram_layer_ids "
                    f"{list(engram.layer_ids)}): it is not the model the config describes"
                )
            table = MappedFp8Rows(self._tensor_files, stored[f"{prefix}.weight"].removesuffix(".weight"))
            if table.shape != (rows, engram.head_dim):
                raise ValueError(
                    f"{prefix}.weight is {list(table.shape)} in {table.weight.path}, but the config's Engram layout "
                    f"needs [{rows}, {engram.head_dim}]; the checkpoint and its config.json disagree"
                )
            self.layers[layer].engram.table = table


def _renamed(name: str, rules: Sequence[tuple[re.Pattern[str], str]]) -> str:
    for pattern, replacement in rules:
        name = pattern.sub(replacement, name)
    return name


def _gather_rows(gate: EngramGate, ids: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, Any]:
    """One Engram layer's rows ``[n, columns * head_dim]`` (float32) on ``device``, and on an
    accelerator the event after their copy (the worker thread's stream is not the layers')."""
    if gate.table is None:
        raise RuntimeError("an Engram table was never mapped: load the weights first")
    rows = gate.table.rows(ids, torch.float32).flatten(1)
    if rows.device == device:  # the layers run where the rows were gathered: no copy
        return rows, None
    copied = rows.pin_memory().to(device, non_blocking=True)
    return copied, torch.accelerator.current_stream(device).record_event()


def _ready(pending: Future[tuple[torch.Tensor, Any]]) -> torch.Tensor:
    """A gathered layer's rows, once the layers' stream has waited for their copy."""
    rows, copied = pending.result()
    if copied is not None:
        torch.accelerator.current_stream(rows.device).wait_event(copied)
    return rows


def _token_map(ctx: ModelContext, engram: EngramArgs) -> list[int]:
    """The tokenizer's compressed ids, checked against ``engram_compressed_vocab_size``."""
    if ctx.tokenizer is None:
        raise ValueError("DeepSeek-V4.1 with Engram needs the checkpoint's tokenizer (ModelContext.tokenizer)")
    backend = getattr(ctx.tokenizer, "backend", ctx.tokenizer)
    mapping, size = compressed_token_map(backend)
    if size != engram.compressed_vocab_size:
        raise ValueError(
            f"Engram: the tokenizer normalises to {size} compressed ids, the config says "
            f"engram_compressed_vocab_size={engram.compressed_vocab_size}; the tokenizer is not the model's"
        )
    return mapping


__all__: Sequence[str] = ["ARCHITECTURES", "DeepseekV41ForCausalLM", "V41Args", "layer_roles"]

"""Llama-family decoders: Llama 2/3, SmolLM, Mistral, Qwen2, Qwen3 and Qwen3-MoE.

These differ only in details their config.json names: grouped-query attention
(``num_key_value_heads``), RoPE scaling (``layers/rotary.py``), tied embeddings, a
bias on q/k/v (Qwen2) or on every projection (``attention_bias``), Mistral's and
Qwen's sliding windows, Qwen3's RMSNorm over each head's query and key (``q_norm``,
``k_norm``, before RoPE) and Qwen3-MoE's routed experts in place of the MLP (softmax
router, greedy top-k, through the MoE backend; no shared expert). Each step runs one
flat batch of tokens from many sequences; attention reads and writes the paged cache
through the backend assembly chose.

The checkpoint's q/k/v and gate/up projections are stored fused here (one matmul
each instead of three and two); ``load_weights`` fills the fused matrices by rows.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs
import torch
from torch import nn

from powertrain.interfaces import (
    AttentionLayerSpec,
    AttentionMetadata,
    DecoderLayerParts,
    FusedDecoder,
    LayerKVCache,
    ModelContext,
    QuantizedWeight,
    RoutingConfig,
    TapRecorder,
)
from powertrain.layers.activation import SiluAndMul
from powertrain.layers.attention import Attention
from powertrain.layers.embedding import Embedding
from powertrain.layers.linear import Linear
from powertrain.layers.moe import MoE
from powertrain.layers.norm import RMSNorm
from powertrain.layers.rotary import RopeParameters, RotaryEmbedding
from powertrain.models.config_reading import required_reader
from powertrain.models.weights import check_complete, copy_checked, copy_or_keep, fused_targets, held_here, materialize

#: Checkpoint tensors that hold nothing to load (precomputed rotary tables).
_IGNORED = re.compile(r"\.rotary_emb\.")
_MLP_TENSOR = re.compile(r"^model\.layers\.(\d+)\.mlp\.(.+)$")
#: model_types whose config class turns a named sliding window on only with ``use_sliding_window``.
_WINDOW_SWITCHED = ("qwen2", "qwen3", "qwen3_moe")
#: model_types with an RMSNorm over each head's query and key.
_QK_NORM = ("qwen3", "qwen3_moe")


@attrs.frozen(kw_only=True)
class SparseArgs:
    """Qwen3-MoE's routed experts: which layers have them instead of the MLP, and how a
    token picks them (``Qwen3MoeSparseMoeBlock``: softmax over all experts in float32,
    the top ``num_experts_per_tok``, renormalised only with ``norm_topk_prob``)."""

    routing: RoutingConfig
    moe_intermediate_size: int
    layers: frozenset[int]

    @classmethod
    def from_config(cls, config: Mapping[str, Any], num_layers: int) -> SparseArgs | None:
        """None where no layer routes (no experts). Absent keys take Qwen3MoeConfig's defaults."""
        experts = int(config.get("num_experts", config.get("num_local_experts", 128)))
        if experts < 0:
            raise ValueError(f"num_experts={experts} must be 0 (no experts) or more")
        step = int(config.get("decoder_sparse_step", 1))
        if step < 1:
            raise ValueError(f"decoder_sparse_step={step} must be at least 1 (every step-th layer routes)")
        dense = config.get("mlp_only_layers") or []
        outside = [i for i in dense if not 0 <= int(i) < num_layers]
        if outside:
            raise ValueError(
                f"mlp_only_layers={list(dense)} names layers {outside} outside 0..{num_layers - 1} "
                f"(num_hidden_layers={num_layers})"
            )
        layers = frozenset(i for i in range(num_layers) if i not in dense and experts > 0 and (i + 1) % step == 0)
        if not layers:
            return None
        top_k = int(config.get("num_experts_per_tok", 8))
        if not 1 <= top_k <= experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be between 1 and num_experts={experts}")
        size = int(config.get("moe_intermediate_size", 768))
        if size < 1:
            raise ValueError(f"moe_intermediate_size={size} must be positive")
        routing = RoutingConfig(
            num_experts=experts,
            top_k=top_k,
            scoring="softmax",
            topk_method="greedy",
            norm_topk_prob=bool(config.get("norm_topk_prob", False)),
        )
        return cls(routing=routing, moe_intermediate_size=size, layers=layers)


@attrs.frozen(kw_only=True)
class LlamaArgs:
    """The config.json fields this model reads, with HF's defaults and meaning."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    #: Per layer: the sliding window, or None for full attention.
    sliding_windows: tuple[int | None, ...]
    rope: RopeParameters
    #: Qwen3: an RMSNorm of ``head_dim`` over each head's query and key, before RoPE.
    qk_norm: bool = False
    #: Qwen3-MoE: the layers whose MLP is routed experts; None: every layer has an MLP.
    sparse: SparseArgs | None = None

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> LlamaArgs:
        required = required_reader(config, "Llama-family")

        activation = config.get("hidden_act", "silu")
        if activation not in ("silu", "swish"):
            raise ValueError(f"Llama-family models use a silu MLP, but the config says hidden_act={activation!r}")
        hidden, heads = int(required("hidden_size")), int(required("num_attention_heads"))
        kv_heads = int(config.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise ValueError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        num_layers = int(required("num_hidden_layers"))
        attention_bias = bool(config.get("attention_bias", False))
        model_type = config.get("model_type")
        # Qwen3Config's head_dim defaults to 128, not hidden_size / heads.
        head_dim = config.get("head_dim") or (128 if model_type == "qwen3" else hidden // heads)
        return cls(
            vocab_size=int(required("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(required("intermediate_size")),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=int(head_dim),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(config.get("max_position_embeddings") or 2048),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v bias and never an o bias; Llama's attention_bias covers all four.
            qkv_bias=attention_bias or model_type == "qwen2",
            o_bias=attention_bias,
            mlp_bias=bool(config.get("mlp_bias", False)),
            sliding_windows=_sliding_windows(config, num_layers),
            rope=RopeParameters.from_config(config),
            qk_norm=model_type in _QK_NORM,
            sparse=SparseArgs.from_config(config, num_layers) if model_type == "qwen3_moe" else None,
        )


def _sliding_windows(config: Mapping[str, Any], num_layers: int) -> tuple[int | None, ...]:
    """Which layers attend through a sliding window, decided as HF decides it.

    Qwen2/Qwen3 configs turn a named window on with ``use_sliding_window`` (off by
    default; off, the window is dropped whatever else the config says). Then an explicit
    ``layer_types`` list says which layers slide; without one, Qwen2/Qwen3 keep the first
    ``max_window_layers`` layers (default 28) full, Qwen3-MoE slides every layer (its
    attention ignores both keys) and Mistral-style configs slide every layer.
    """
    window = config.get("sliding_window")
    model_type = config.get("model_type")
    switched = "use_sliding_window" in config or model_type in _WINDOW_SWITCHED
    if window is None or (switched and not config.get("use_sliding_window", False)):
        return (None,) * num_layers
    window = int(window)
    if model_type == "qwen3_moe":
        return (window,) * num_layers
    layer_types = config.get("layer_types")
    if layer_types is not None:
        if len(layer_types) != num_layers:
            raise ValueError(f"layer_types lists {len(layer_types)} layers, but num_hidden_layers={num_layers}")
        return tuple(window if kind == "sliding_attention" else None for kind in layer_types)
    if switched:
        first = config.get("max_window_layers")
        first = 28 if first is None else int(first)
        return tuple(window if i >= first else None for i in range(num_layers))
    return (window,) * num_layers


class LlamaAttention(nn.Module):
    def __init__(self, args: LlamaArgs, layer_index: int, backend: Any, causal: bool = True) -> None:
        """``causal`` False: a block drafter's attention (``AttentionLayerSpec.causal``)."""
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        self.q_size, self.kv_size = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
        self.qkv_proj = Linear(args.hidden_size, self.q_size + 2 * self.kv_size, bias=args.qkv_bias)
        self.o_proj = Linear(self.q_size, args.hidden_size, bias=args.o_bias)
        spec = AttentionLayerSpec(
            kind="gqa",
            num_heads=args.num_heads,
            num_kv_heads=args.num_kv_heads,
            head_size=args.head_dim,
            scale=args.head_dim**-0.5,
            sliding_window=args.sliding_windows[layer_index],
            causal=causal,
        )
        self.attn = Attention(spec, backend)
        self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps) if args.qk_norm else None

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: LayerKVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        q, k, v = self._qkv(hidden)
        return self.o_proj(self.attn(q, k, v, kv_cache, metadata, rotary=(cos, sin)))

    def store(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: LayerKVCache,
        metadata: AttentionMetadata,
    ) -> None:
        """Only the cache write of ``forward`` (``Attention.store``): a block drafter's context."""
        q, k, v = self._qkv(hidden)
        self.attn.store(q, k, v, kv_cache, metadata, rotary=(cos, sin))

    def _qkv(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v


class LlamaMLP(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.gate_up_proj = Linear(args.hidden_size, 2 * args.intermediate_size, bias=args.mlp_bias)
        self.down_proj = Linear(args.intermediate_size, args.hidden_size, bias=args.mlp_bias)
        self.act = SiluAndMul()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(hidden)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, args: LlamaArgs, layer_index: int, backend: Any, experts: MoE | None = None) -> None:
        """``experts``: the routed experts that replace this layer's MLP (Qwen3-MoE)."""
        super().__init__()
        self.self_attn = LlamaAttention(args, layer_index, backend)
        self.mlp: nn.Module = LlamaMLP(args) if experts is None else experts
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: LayerKVCache,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns the MLP output and the residual stream it has not been added to yet:
        the next norm adds them, so the add and the norm can be one fused kernel."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, cos, sin, kv_cache, metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, args: LlamaArgs, backend: Any, experts: Mapping[int, MoE] | None = None) -> None:
        super().__init__()
        # Given its weight, the embedding skips its random init: on the meta device that init
        # imports torch._dynamo (measured 1.5-6 s of startup), and load_weights overwrites it.
        weight = torch.empty(args.vocab_size, args.hidden_size)
        self.embed_tokens = Embedding(args.vocab_size, args.hidden_size, _weight=weight)
        experts = experts or {}
        self.layers = nn.ModuleList(LlamaDecoderLayer(args, i, backend, experts.get(i)) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(args.head_dim, args.rope, args.max_position_embeddings)
        #: The layers as one call, where a kernel pack fused them (``use_fused_decoder``).
        self.fused: FusedDecoder | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[LayerKVCache],
        metadata: AttentionMetadata,
        taps: TapRecorder | None = None,
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        # Every layer rotates by the same angles: look them up once per step.
        cos, sin = self.rotary_emb(positions, metadata.max_seq_len, hidden.dtype)
        residual: torch.Tensor | None = None
        start = 0  # the first layer still to run
        if self.fused is not None:
            hidden, residual, start = self._run_fused(hidden, cos, sin, kv_caches, metadata, taps)
        for index in range(start, len(self.layers)):
            hidden, residual = self.layers[index](hidden, residual, cos, sin, kv_caches[index], metadata)
            if taps is not None and taps.wants(index, "layer_output"):
                taps.record(index, "layer_output", hidden + residual)  # the add the next norm fuses
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def _run_fused(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_caches: Sequence[LayerKVCache],
        metadata: AttentionMetadata,
        taps: TapRecorder | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        """The layers through the fused stack, in segments ending at the layers whose outputs
        a drafter reads (recorded there): ``(hidden, residual, next layer)``, the layers from
        the next one on left to run one by one (all of them where the stack declines the step)."""
        assert self.fused is not None
        last = len(self.layers) - 1
        stops = [i for i in range(last) if taps is not None and taps.wants(i, "layer_output")] + [last]
        residual: torch.Tensor | None = None
        start = 0
        for stop in stops:
            layers = None if (start, stop) == (0, last) else range(start, stop + 1)
            segment_input = hidden if residual is None else hidden + residual
            ran = self.fused(segment_input, cos, sin, kv_caches, metadata, layers)
            if ran is None:
                break
            hidden, residual = ran
            if taps is not None and taps.wants(stop, "layer_output"):
                taps.record(stop, "layer_output", hidden + residual)
            start = stop + 1
        return hidden, residual, start


class LlamaFamilyForCausalLM(nn.Module):
    """Implements ``interfaces.CausalLM``. Weights are uninitialised until ``load_weights``.

    Build ``LlamaForCausalLM`` or ``Qwen3ForCausalLM``: they differ in what they offer a
    kernel pack, not in what they compute."""

    captures_decode = True
    #: A drafter may read layer outputs (``TapRecorder``, set as ``taps`` by the runner).
    tap_forms = frozenset({"layer_output"})
    taps: TapRecorder | None = None

    def __init__(self, ctx: ModelContext) -> None:
        super().__init__()
        self.args = args = LlamaArgs.from_config(ctx.config)
        self.dtype = ctx.dtype
        self.quantized_linear = ctx.quantized_linear
        #: ``(first, count)`` of the routed experts this rank holds; None: all of them.
        self._expert_slice = (
            ctx.local_experts(args.sparse.routing.num_experts)
            if args.sparse is not None and ctx.expert_parallel_size > 1
            else None
        )
        # Routed experts are built for real first: they keep host-side bookkeeping, and
        # their float32 router must not take the model dtype.
        experts = self._routed_experts(ctx)
        # Built on the meta device, then allocated uninitialised: initialising weights
        # that load_weights overwrites anyway costs seconds on large models.
        with torch.device("meta"):
            self.model = LlamaModel(args, ctx.attention, experts)
            self.lm_head = Linear(args.hidden_size, args.vocab_size, bias=False)
        materialize(self, ctx.dtype, ctx.device)
        if args.tie_word_embeddings:  # after materialize, which gives each its own tensor
            self.lm_head.weight = self.model.embed_tokens.weight
        self.requires_grad_(False)
        self.attention_layers: tuple[AttentionLayerSpec, ...] = tuple(
            layer.self_attn.attn.spec for layer in self.model.layers
        )
        #: Fused parameters -> the checkpoint tensors they stack, in row order, with their row counts.
        self._fused = {
            "qkv_proj": (
                ("q_proj", "k_proj", "v_proj"),
                (args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim, args.num_kv_heads * args.head_dim),
            ),
            "gate_up_proj": (("gate_proj", "up_proj"), (args.intermediate_size, args.intermediate_size)),
        }

    def _routed_experts(self, ctx: ModelContext) -> dict[int, MoE]:
        """Layer index -> its routed experts (Qwen3-MoE), through the MoE backend assembly chose."""
        sparse = self.args.sparse
        if sparse is None:
            return {}
        if ctx.moe is None:
            raise ValueError("a Qwen3-MoE model needs a MoE backend (ModelContext.moe)")
        first, count = self._expert_slice or (0, sparse.routing.num_experts)
        return {
            index: MoE(
                sparse.routing,
                self.args.hidden_size,
                sparse.moe_intermediate_size,
                ctx.moe,
                ctx.dtype,
                ctx.device,
                first_expert=first,
                local_experts=count,
                dispatcher=ctx.expert_dispatcher,
            )
            for index in sorted(sparse.layers)
        }

    def routed_expert_layers(self) -> list[MoE]:
        """The MoE layers ``forward`` runs, in order (expert-parallel lockstep replays
        them with no tokens on a rank that has none)."""
        return [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, MoE)]

    def wants_weight(self, name: str) -> bool:
        """False for another expert-parallel rank's routed experts: they are not read."""
        return held_here(name, self._expert_slice)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[LayerKVCache],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Final-normed hidden states ``[num_tokens, hidden]`` of the flat batch.

        Padded rows (past ``metadata.num_tokens``) need a valid position, e.g. 0.
        """
        return self.model(input_ids, positions, kv_caches, metadata, self.taps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # The matmul stays in the model dtype (a float32 copy of a 128k-row head per step
        # would cost more than it buys); only the result is widened for the sampler.
        return self.lm_head(hidden).float()

    # ----------------------------------------------------------------------- loading

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """Every HF tensor name this model needs -> the parameter rows it fills."""
        return fused_targets(self, self._fused)

    def keep_quantized(self, name: str) -> bool:
        """Whether checkpoint tensor ``name`` may arrive as a ``QuantizedWeight`` (only with a
        quantised-linear kernel): every projection, the embedding and the head, never a norm or bias."""
        return (
            self.quantized_linear is not None
            and ".mlp.experts." not in name  # routed experts go to the MoE backend dense
            and (name.endswith("_proj.weight") or name in ("model.embed_tokens.weight", "lm_head.weight"))
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]]) -> None:
        """Copy HF-named tensors in (cast to the model's dtype and device); quantised ones
        (``keep_quantized``) go to their layers as stored, fused parts stacked by rows.

        Raises ValueError naming unexpected tensors and, once ``weights`` is consumed,
        missing ones; a shape mismatch raises at once.
        """
        targets = self.checkpoint_tensors()
        loaded: set[str] = set()
        unexpected: list[str] = []
        quantized: dict[str, QuantizedWeight] = {}
        tied_head: torch.Tensor | QuantizedWeight | None = None
        with torch.no_grad():
            for name, tensor in weights:
                if _IGNORED.search(name):
                    continue
                if name == "lm_head.weight" and self.args.tie_word_embeddings:
                    tied_head = tensor  # checked against the embedding once both are seen
                    continue
                target = targets.get(name)
                if target is None:
                    if self._load_expert(name, tensor):
                        continue
                    unexpected.append(name)
                    continue
                copy_or_keep(name, target, tensor, quantized)
                loaded.add(name)
            if tied_head is not None:
                self._load_tied_head(tied_head, loaded, quantized)
        missing = sorted(targets.keys() - loaded)
        for index, layer in enumerate(self.model.layers):
            if isinstance(layer.mlp, MoE):
                missing += [f"model.layers.{index}.mlp.{name}" for name in layer.mlp.missing_weights()]
        check_complete(type(self).__name__, unexpected, missing)
        for experts in self.routed_expert_layers():
            experts.finish_loading()
        if quantized:
            self._use_quantized(quantized, targets)

    def _load_expert(self, name: str, tensor: torch.Tensor | QuantizedWeight) -> bool:
        """Hand a routed-experts tensor (router, experts, per-expert or fused) to its layer's
        MoE; False if ``name`` is none of a MoE layer's."""
        match = _MLP_TENSOR.match(name)
        if match is None or int(match.group(1)) >= len(self.model.layers):
            return False
        experts = self.model.layers[int(match.group(1))].mlp
        if not isinstance(experts, MoE) or isinstance(tensor, QuantizedWeight):
            return False
        return experts.load_weight(match.group(2), tensor)

    def _use_quantized(self, quantized: dict[str, QuantizedWeight], targets: dict[str, torch.Tensor]) -> None:
        """Hand every quantised weight to its layer, fused projections stacked in row order.
        A fused layer whose parts arrived partly dense stays dense (its quantised parts are
        dequantized into it)."""
        kernel = self.quantized_linear
        assert kernel is not None  # keep_quantized accepted nothing without one
        for module_name, module in self.named_modules():
            if isinstance(module, Embedding):
                if (table := quantized.get(f"{module_name}.weight")) is not None:
                    module.use_quantized(table, self.dtype)
                    if self.args.tie_word_embeddings:
                        self.lm_head.use_quantized(table, kernel)
                continue
            if not isinstance(module, Linear) or module.kernel is not None:
                continue
            parent, _, leaf = module_name.rpartition(".")
            parts = (
                [f"{parent}.{part}.weight" for part in self._fused[leaf][0]]
                if leaf in self._fused
                else [f"{module_name}.weight"]
            )
            found = [quantized[part] for part in parts if part in quantized]
            if not found:
                continue
            if len(found) == len(parts):
                module.use_quantized(QuantizedWeight.stack_rows(found), kernel)
                continue
            for part in parts:  # a part stored in a type that is not kept: the layer stays dense
                if part in quantized:
                    copy_checked(part, targets[part], quantized[part].dequantize(self.dtype))

    def _load_tied_head(
        self, head: torch.Tensor | QuantizedWeight, loaded: set[str], quantized: dict[str, QuantizedWeight]
    ) -> None:
        """With tied embeddings an lm_head tensor is redundant; accept it if it agrees."""
        name = "model.embed_tokens.weight"
        if isinstance(head, QuantizedWeight) or name in quantized:
            if name not in loaded:
                if isinstance(head, QuantizedWeight):
                    quantized[name] = head
                else:
                    self.model.embed_tokens.weight.copy_(head)
                loaded.add(name)
            elif not torch.equal(_dense(head), _dense(quantized.get(name, self.model.embed_tokens.weight))):
                raise ValueError(
                    "the config ties lm_head to the embedding (tie_word_embeddings), "
                    "but the checkpoint's lm_head.weight differs from model.embed_tokens.weight"
                )
            return
        self._load_dense_tied_head(head, loaded)

    def _load_dense_tied_head(self, head: torch.Tensor, loaded: set[str]) -> None:

        name = "model.embed_tokens.weight"
        embedding = self.model.embed_tokens.weight
        if head.shape != embedding.shape:
            raise ValueError(f"lm_head.weight has shape {tuple(head.shape)}, the embedding {tuple(embedding.shape)}")
        if name not in loaded:
            embedding.copy_(head)
            loaded.add(name)
        elif not torch.equal(head.to(embedding.device, embedding.dtype), embedding):
            raise ValueError(
                "the config ties lm_head to the embedding (tie_word_embeddings), "
                "but the checkpoint's lm_head.weight differs from model.embed_tokens.weight"
            )


class LlamaForCausalLM(LlamaFamilyForCausalLM):
    """Llama 2/3, SmolLM, Mistral and Qwen2: Llama-shaped layers, which a kernel pack may
    run as one fused stack (``DecoderStackKernel``)."""

    def __init__(self, ctx: ModelContext) -> None:
        model_type = ctx.config.get("model_type")
        if model_type in _QK_NORM:
            raise ValueError(
                f"model_type={model_type!r} has per-head q/k norms (and maybe routed experts), which "
                "LlamaForCausalLM's fused-stack parts cannot describe; build Qwen3ForCausalLM"
            )
        super().__init__(ctx)

    def decoder_layer_parts(self) -> tuple[DecoderLayerParts, ...]:
        """Each layer as a kernel pack may fuse it (``DecoderStackKernel``)."""
        return tuple(
            DecoderLayerParts(
                input_norm=layer.input_layernorm.weight,
                post_attention_norm=layer.post_attention_layernorm.weight,
                eps=layer.input_layernorm.eps,
                qkv=layer.self_attn.qkv_proj,
                o=layer.self_attn.o_proj,
                gate_up=layer.mlp.gate_up_proj,
                down=layer.mlp.down_proj,
                attention=layer.self_attn.attn.spec,
            )
            for layer in self.model.layers
        )

    def use_fused_decoder(self, fused: FusedDecoder | None) -> None:
        """Run small steps' layers through ``fused`` (None: one by one again)."""
        self.model.fused = fused


class Qwen3ForCausalLM(LlamaFamilyForCausalLM):
    """Qwen3 and Qwen3-MoE (their config.json's ``model_type`` says which). Their layers
    are not Llama-shaped (per-head q/k norms, routed experts), so unlike
    ``LlamaForCausalLM`` they offer a kernel pack no fused stack."""

    def __init__(self, ctx: ModelContext) -> None:
        model_type = ctx.config.get("model_type")
        if model_type not in _QK_NORM:
            raise ValueError(f"Qwen3ForCausalLM reads model_type 'qwen3' or 'qwen3_moe' configs, not {model_type!r}")
        super().__init__(ctx)


def _dense(weight: torch.Tensor | QuantizedWeight) -> torch.Tensor:
    return weight.dequantize() if isinstance(weight, QuantizedWeight) else weight.float()

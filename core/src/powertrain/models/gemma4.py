"""Gemma 4 text decoders, as transformers 5.24's ``modeling_gemma4`` computes them: ``Gemma4ForCausalLM``,
and the text model of ``Gemma4ForConditionalGeneration`` (the class Google's releases are saved as:
``text_config`` nested in the config, weights under ``model.language_model.``; its vision and
audio towers are not read, so images and audio are not served).

What sets them apart from the Llama family:

* the token embedding is scaled by sqrt(hidden_size), the factor rounded to the model dtype;
* four RMSNorms per layer, around attention and around the MLP ("sandwich" norms: a block's
  output is normed before it joins the residual). Gemma 4's RMSNorm scales by ``w`` (Gemma 2/3
  used ``1 + w``) and does so in float32;
* RMSNorms over each head's query and key (weighted) and value (unweighted), and so an
  attention scale of 1;
* sliding and full layers (``layer_types``), each kind with its own RoPE table
  (``rope_parameters[kind]``: the sliding layers plain, the full ones "proportional") and
  its own head size and key/value heads (``per_layer_config``, or ``global_head_dim`` and
  ``num_global_key_value_heads`` in configs written before it). With ``attention_k_eq_v`` the
  full layers have no value projection: the key projection's output is also the value;
* KV sharing: the last ``num_kv_shared_layers`` layers compute no keys or values; each attends
  over the cache of the last earlier layer of its kind. They hold no cache of their own
  (declared ``kind="custom"`` without cache groups) and hand the backend their source's cache
  and this step's keys, which it writes again, unchanged. With ``use_double_wide_mlp`` their
  MLP is twice as wide;
* per-layer embeddings (PLE, ``hidden_size_per_layer_input``): a second, packed token
  embedding plus a projection of the first give every layer a small vector, which gates a
  residual branch after the layer's MLP;
* each layer's output is multiplied by its learned ``layer_scalar``; the MLP is GELU-tanh
  gated; the logits are soft-capped (``final_logit_softcapping``).

Refused at load, naming the config key: routed experts (``enable_moe_block``: the MoE
backends run SwiGLU experts, Gemma 4's are GELU-tanh and add a dense MLP beside them),
bidirectional attention (``use_bidirectional_attention="all"``), another activation, and
RoPE types other than default and proportional.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from powertrain.interfaces import (
    AttentionLayerSpec,
    AttentionMetadata,
    LayerKVCache,
    ModelContext,
    QuantizedWeight,
    TapRecorder,
)
from powertrain.layers.attention import Attention
from powertrain.layers.embedding import Embedding
from powertrain.layers.linear import Linear
from powertrain.layers.rotary import RopeParameters, RotaryEmbedding
from powertrain.models.config_reading import required_reader
from powertrain.models.weights import check_complete, copy_or_keep, materialize

LAYER_TYPES = ("sliding_attention", "full_attention")
#: transformers' ``Gemma4TextConfig`` rope tables when a config names none.
_DEFAULT_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}
#: What a config's ``per_layer_config`` may override for a layer.
_LAYER_OVERRIDES = frozenset({"head_dim", "num_key_value_heads"})
#: A KV-sharing layer's tensors that an older checkpoint may still hold; transformers drops them unread.
_KV_TENSORS = ("k_proj", "v_proj", "k_norm", "v_norm")
_ACTIVATIONS = ("gelu_pytorch_tanh",)
#: ``Gemma4ForConditionalGeneration``'s text model, whose names are the causal LM's under ``model.``.
_LANGUAGE_MODEL = "model.language_model."
#: Its towers and their projections into the text model, which serving text never reads.
_NOT_TEXT = ("model.vision_tower.", "model.embed_vision.", "model.audio_tower.", "model.embed_audio.")


@attrs.frozen(kw_only=True)
class Gemma4LayerArgs:
    """One decoder layer's shape, as its layer type and ``per_layer_config`` make it."""

    kind: str
    sliding_window: int | None
    head_dim: int
    num_kv_heads: int
    rope: RopeParameters
    #: The earlier layer whose keys and values this one attends over; None: it computes its own.
    kv_source: int | None
    #: ``attention_k_eq_v`` on a full layer: the key projection's output is also the value.
    value_is_key: bool
    intermediate_size: int


@attrs.frozen(kw_only=True)
class Gemma4Args:
    """The config.json fields this model reads, with ``Gemma4TextConfig``'s defaults."""

    vocab_size: int
    hidden_size: int
    num_heads: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    final_logit_softcapping: float | None
    #: Per-layer embeddings: the width each layer gets (0: none) and the table's vocabulary.
    per_layer_size: int
    per_layer_vocab_size: int
    layers: tuple[Gemma4LayerArgs, ...]

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Gemma4Args:
        """A causal LM's config, or a ``Gemma4ForConditionalGeneration``'s (its ``text_config``;
        whether the head is tied is said at the top)."""
        tied = config.get("tie_word_embeddings")
        config = config.get("text_config") or config
        required = required_reader(config, "Gemma 4")
        _refuse_what_the_engine_cannot_run(config)
        num_layers = int(required("num_hidden_layers"))
        hidden, heads = int(required("hidden_size")), int(required("num_attention_heads"))
        per_layer_size = int(config.get("hidden_size_per_layer_input") or 0)
        vocab_size = int(required("vocab_size"))
        return cls(
            vocab_size=vocab_size,
            hidden_size=hidden,
            num_heads=heads,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(config.get("max_position_embeddings") or 131_072),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", True) if tied is None else tied),
            attention_bias=bool(config.get("attention_bias", False)),
            final_logit_softcapping=config.get("final_logit_softcapping"),
            per_layer_size=per_layer_size,
            per_layer_vocab_size=int(config.get("vocab_size_per_layer_input") or vocab_size),
            layers=_layers(config, num_layers, heads),
        )


def _refuse_what_the_engine_cannot_run(config: Mapping[str, Any]) -> None:
    if config.get("enable_moe_block"):
        raise ValueError(
            "enable_moe_block=True: Gemma 4's routed experts (GELU-tanh experts beside a dense MLP, a router with "
            "per-expert scales) cannot run on powertrain's MoE backends, which compute SwiGLU experts"
        )
    if config.get("use_bidirectional_attention") == "all":
        raise ValueError(
            "use_bidirectional_attention='all': every token attends to the ones after it too, which a causal "
            "paged attention backend cannot compute"
        )
    activation = config.get("hidden_activation", config.get("hidden_act", "gelu_pytorch_tanh"))
    if activation not in _ACTIVATIONS:
        raise ValueError(f"Gemma 4 models use a GELU-tanh MLP, but the config says hidden_activation={activation!r}")


def _layers(config: Mapping[str, Any], num_layers: int, heads: int) -> tuple[Gemma4LayerArgs, ...]:
    """Each layer's kind, window, head size, key/value heads, rope table, KV source and MLP width."""
    kinds = list(config.get("layer_types") or _default_layer_types(num_layers))
    if len(kinds) != num_layers:
        raise ValueError(f"layer_types lists {len(kinds)} layers, but num_hidden_layers={num_layers}")
    unknown = sorted(set(kinds) - set(LAYER_TYPES))
    if unknown:
        raise ValueError(f"layer_types names {unknown}; Gemma 4 layers are {' or '.join(LAYER_TYPES)}")
    kinds[-1] = "full_attention"  # as Gemma4TextConfig forces it
    overrides = _layer_overrides(config, kinds)
    ropes = _rope_tables(config, kinds)
    sources = _kv_sources(config, kinds)
    window = int(config.get("sliding_window") or 512)
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or 256)
    intermediate = int(config.get("intermediate_size") or 9216)
    double_wide = bool(config.get("use_double_wide_mlp", False))
    layers = []
    for index, kind in enumerate(kinds):
        layer = {"head_dim": head_dim, "num_key_value_heads": kv_heads, **overrides.get(index, {})}
        if heads % int(layer["num_key_value_heads"]):
            raise ValueError(
                f"layer {index}: num_attention_heads={heads} is not a multiple of its "
                f"num_key_value_heads={layer['num_key_value_heads']}"
            )
        shared = sources[index] is not None
        layers.append(
            Gemma4LayerArgs(
                kind=kind,
                sliding_window=window if kind == "sliding_attention" else None,
                head_dim=int(layer["head_dim"]),
                num_kv_heads=int(layer["num_key_value_heads"]),
                rope=ropes[kind],
                kv_source=sources[index],
                value_is_key=bool(config.get("attention_k_eq_v", False)) and kind == "full_attention",
                intermediate_size=intermediate * (2 if double_wide and shared else 1),
            )
        )
    for kind in set(kinds):
        sizes = sorted({layer.head_dim for layer in layers if layer.kind == kind})
        if len(sizes) > 1:
            raise ValueError(
                f"per_layer_config gives the {kind} layers head sizes {sizes}; their one RoPE table needs one"
            )
    for index, layer in enumerate(layers):
        source = layer.kv_source
        if source is not None and (layer.head_dim, layer.num_kv_heads) != (
            layers[source].head_dim,
            layers[source].num_kv_heads,
        ):
            raise ValueError(
                f"layer {index} reads the keys and values of layer {source}, but their head_dim / "
                "num_key_value_heads differ (per_layer_config)"
            )
    return tuple(layers)


def _default_layer_types(num_layers: int) -> list[str]:
    """Gemma4TextConfig's pattern: five sliding layers, then a full one."""
    return ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(num_layers)]


def _layer_overrides(config: Mapping[str, Any], kinds: Sequence[str]) -> dict[int, dict[str, Any]]:
    """Layer index -> what it overrides: the config's ``per_layer_config``, or for configs written
    without one, what transformers derives for the full layers (``global_head_dim``, default 512,
    and with ``attention_k_eq_v`` also ``num_global_key_value_heads``)."""
    given = config.get("per_layer_config")
    if given is None:
        full: dict[str, Any] = {"head_dim": int(config.get("global_head_dim") or 512)}
        if config.get("attention_k_eq_v") and config.get("num_global_key_value_heads") is not None:
            full["num_key_value_heads"] = int(config["num_global_key_value_heads"])
        return {index: full for index, kind in enumerate(kinds) if kind == "full_attention"}
    overrides: dict[int, dict[str, Any]] = {}
    for key, values in dict(given).items():
        if not str(key).isdigit() or not 0 <= int(key) < len(kinds):
            raise ValueError(f"per_layer_config names layer {key!r}; layers are 0..{len(kinds) - 1}")
        unread = sorted(set(values) - _LAYER_OVERRIDES)
        if unread:
            raise ValueError(
                f"per_layer_config[{key}] overrides {unread}, which this Gemma 4 model does not read "
                f"(it reads {sorted(_LAYER_OVERRIDES)})"
            )
        overrides[int(key)] = dict(values)
    return overrides


def _rope_tables(config: Mapping[str, Any], kinds: Sequence[str]) -> dict[str, RopeParameters]:
    """Each layer kind's RoPE: ``rope_parameters[kind]`` (transformers 5's nesting by layer type)."""
    tables = config.get("rope_parameters") or _DEFAULT_ROPE
    ropes = {}
    for kind in sorted(set(kinds)):
        table = tables.get(kind)
        if not isinstance(table, Mapping):
            raise ValueError(f"rope_parameters has no {kind!r} table; Gemma 4 configs give one per layer type")
        rope_type = table.get("rope_type", "default")
        if rope_type not in ("default", "proportional"):
            raise ValueError(
                f"rope_parameters[{kind!r}] has rope_type={rope_type!r}; Gemma 4 layers use 'default' or 'proportional'"
            )
        if rope_type == "default" and float(table.get("partial_rotary_factor") or 1.0) != 1.0:
            raise ValueError(
                f"rope_parameters[{kind!r}] sets partial_rotary_factor for a 'default' rope, which transformers' "
                "Gemma 4 ignores; remove it or use rope_type 'proportional'"
            )
        positions = config.get("max_position_embeddings")
        ropes[kind] = RopeParameters.from_config({"rope_parameters": table, "max_position_embeddings": positions})
    return ropes


def _kv_sources(config: Mapping[str, Any], kinds: Sequence[str]) -> list[int | None]:
    """Per layer, the layer whose keys and values it reads (``Gemma4TextConfig.kv_sharing_modes``):
    from ``num_hidden_layers - num_kv_shared_layers`` on, the last earlier layer of its kind."""
    shared = int(config.get("num_kv_shared_layers") or 0)
    first = len(kinds) - shared
    if not 0 <= shared < len(kinds):
        raise ValueError(
            f"num_kv_shared_layers={shared} must leave at least one of the {len(kinds)} layers "
            "computing its own keys and values"
        )
    sources: list[int | None] = [None] * len(kinds)
    for index in range(first, len(kinds)):
        candidates = [i for i in range(first) if kinds[i] == kinds[index]]
        if not candidates:
            raise ValueError(
                f"num_kv_shared_layers={shared}: layer {index} ({kinds[index]}) would read the keys and values of "
                f"an earlier {kinds[index]} layer, but layers 0..{first - 1} have none"
            )
        sources[index] = candidates[-1]
    return sources


class GemmaRMSNorm(nn.Module):
    """Gemma 4's RMSNorm: ``x / rms(x) * w``, all in float32, then cast back; ``scaled=False``
    has no weight (the value norm). Not ``layers.norm.RMSNorm``, which scales in the model
    dtype and hands its work to kernel packs that compute Llama's order."""

    def __init__(self, size: int, eps: float, *, scaled: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size)) if scaled else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        # torch.pow, not rsqrt: transformers' choice, and so its rounding.
        normed = x32 * torch.pow(x32.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            normed = normed * self.weight.float()
        return normed.type_as(x)


class Gemma4Attention(nn.Module):
    def __init__(self, args: Gemma4Args, index: int, backend: Any, causal: bool = True) -> None:
        """``causal`` False: a block drafter's attention (``AttentionLayerSpec.causal``)."""
        super().__init__()
        layer = args.layers[index]
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, layer.num_kv_heads, layer.head_dim
        hidden, bias, eps = args.hidden_size, args.attention_bias, args.rms_norm_eps
        self.q_proj = Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.q_norm = GemmaRMSNorm(self.head_dim, eps)
        self.o_proj = Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.computes_kv = layer.kv_source is None
        if self.computes_kv:
            kv_size = self.num_kv_heads * self.head_dim
            self.k_proj = Linear(hidden, kv_size, bias=bias)
            self.v_proj = None if layer.value_is_key else Linear(hidden, kv_size, bias=bias)
            self.k_norm = GemmaRMSNorm(self.head_dim, eps)
            self.v_norm = GemmaRMSNorm(self.head_dim, eps, scaled=False)
        # The query and key norms leave unit-RMS heads: transformers scales scores by 1.
        spec = AttentionLayerSpec(
            kind="gqa",
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_dim,
            scale=1.0,
            sliding_window=layer.sliding_window,
            causal=causal,
        )
        self.attn = Attention(spec, backend)
        #: What the engine allocates for: nothing for a layer that reads another's cache.
        self.cache_spec = spec if self.computes_kv else attrs.evolve(spec, kind="custom", sliding_window=None)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: LayerKVCache,
        metadata: AttentionMetadata,
        shared_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """The attention output and this step's (normed, unrotated) keys and values: its own, or
        ``shared_kv``, its source layer's, whose cache ``kv_cache`` then is."""
        query = self.q_norm(self.q_proj(hidden).view(-1, self.num_heads, self.head_dim))
        if shared_kv is None:
            shared_kv = self._kv(hidden)
        out = self.attn(query, *shared_kv, kv_cache, metadata, rotary=(cos, sin))
        return self.o_proj(out), shared_kv

    def store(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: LayerKVCache,
        metadata: AttentionMetadata,
    ) -> None:
        """Only the cache write of ``forward`` (``Attention.store``): a block drafter's context.
        The query is computed only where the backend must attend to write."""
        query = None
        if not self.attn.stores_only:
            query = self.q_norm(self.q_proj(hidden).view(-1, self.num_heads, self.head_dim))
        self.attn.store(query, *self._kv(hidden), kv_cache, metadata, rotary=(cos, sin))

    def _kv(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This step's normed, unrotated keys and values."""
        key = self.k_proj(hidden).view(-1, self.num_kv_heads, self.head_dim)
        value = key if self.v_proj is None else self.v_proj(hidden).view(-1, self.num_kv_heads, self.head_dim)
        return self.k_norm(key), self.v_norm(value)


class Gemma4MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, args: Gemma4Args, index: int, backend: Any, causal: bool = True) -> None:
        super().__init__()
        hidden, eps = args.hidden_size, args.rms_norm_eps
        self.self_attn = Gemma4Attention(args, index, backend, causal)
        self.mlp = Gemma4MLP(hidden, args.layers[index].intermediate_size)
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.layer_scalar = nn.Parameter(torch.ones(1))
        self.has_per_layer_input = args.per_layer_size > 0
        if self.has_per_layer_input:
            self.per_layer_input_gate = Linear(hidden, args.per_layer_size, bias=False)
            self.per_layer_projection = Linear(args.per_layer_size, hidden, bias=False)
            self.post_per_layer_input_norm = GemmaRMSNorm(hidden, eps)

    def forward(
        self,
        hidden: torch.Tensor,
        per_layer_input: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: LayerKVCache,
        metadata: AttentionMetadata,
        shared_kv: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        attended, kv = self.self_attn(self.input_layernorm(hidden), cos, sin, kv_cache, metadata, shared_kv)
        hidden = hidden + self.post_attention_layernorm(attended)
        hidden = hidden + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden)))
        if per_layer_input is not None:
            gate = F.gelu(self.per_layer_input_gate(hidden), approximate="tanh") * per_layer_input
            hidden = hidden + self.post_per_layer_input_norm(self.per_layer_projection(gate))
        return hidden * self.layer_scalar, kv


class Gemma4Model(nn.Module):
    def __init__(self, args: Gemma4Args, backend: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.args = args
        # Given its weight, an embedding skips its random init (see LlamaModel).
        self.embed_tokens = Embedding(
            args.vocab_size, args.hidden_size, _weight=torch.empty(args.vocab_size, args.hidden_size)
        )
        # transformers keeps the factors as tensors it casts to the model dtype (sqrt(3072) is 55.5 in bfloat16).
        self.embed_scale = _rounded(args.hidden_size**0.5, dtype)
        self.layers = nn.ModuleList(Gemma4DecoderLayer(args, i, backend) for i in range(args.num_layers))
        self.norm = GemmaRMSNorm(args.hidden_size, args.rms_norm_eps)
        tables = {layer.kind: (layer.rope, layer.head_dim) for layer in args.layers}
        self.rotary = nn.ModuleDict(
            {
                kind: RotaryEmbedding(head_dim, rope, args.max_position_embeddings)
                for kind, (rope, head_dim) in tables.items()
            }
        )
        if args.per_layer_size:
            width = args.num_layers * args.per_layer_size
            self.embed_tokens_per_layer = Embedding(
                args.per_layer_vocab_size, width, _weight=torch.empty(args.per_layer_vocab_size, width)
            )
            self.per_layer_embed_scale = _rounded(args.per_layer_size**0.5, dtype)
            self.per_layer_model_projection = Linear(args.hidden_size, width, bias=False)
            self.per_layer_projection_norm = GemmaRMSNorm(args.per_layer_size, args.rms_norm_eps)
        #: The layers whose keys and values a later layer reads.
        self._sources = {layer.kv_source for layer in args.layers if layer.kv_source is not None}

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[LayerKVCache],
        metadata: AttentionMetadata,
        taps: TapRecorder | None = None,
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids) * self.embed_scale
        per_layer = self._per_layer_inputs(input_ids, hidden) if self.args.per_layer_size else None
        # Every layer of a kind rotates by the same angles: look them up once per kind.
        angles = {kind: rotary(positions, metadata.max_seq_len, hidden.dtype) for kind, rotary in self.rotary.items()}
        produced: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for index, (layer, args) in enumerate(zip(self.layers, self.args.layers, strict=True)):
            source = args.kv_source
            kv_cache = kv_caches[index if source is None else source]
            hidden, kv = layer(
                hidden,
                None if per_layer is None else per_layer[:, index],
                *angles[args.kind],
                kv_cache,
                metadata,
                None if source is None else produced[source],
            )
            if index in self._sources:
                produced[index] = kv
            if taps is not None and taps.wants(index, "layer_output"):
                taps.record(index, "layer_output", hidden)
        return self.norm(hidden)

    def _per_layer_inputs(self, input_ids: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        """``[tokens, layers, per_layer_size]``: the token's row of the per-layer table plus the
        normed projection of its scaled embedding, over sqrt(2) (transformers'
        ``get_per_layer_inputs`` and ``project_per_layer_inputs``)."""
        shape = (-1, self.args.num_layers, self.args.per_layer_size)
        table = (self.embed_tokens_per_layer(input_ids) * self.per_layer_embed_scale).view(shape)
        projected = self.per_layer_model_projection(embedded) * self.args.hidden_size**-0.5
        return (self.per_layer_projection_norm(projected.view(shape)) + table) * 2.0**-0.5


class Gemma4ForCausalLM(nn.Module):
    """Implements ``interfaces.CausalLM``. Weights are uninitialised until ``load_weights``."""

    captures_decode = True
    #: A drafter may read layer outputs (``TapRecorder``, set as ``taps`` by the runner).
    tap_forms = frozenset({"layer_output"})
    taps: TapRecorder | None = None

    def __init__(self, ctx: ModelContext) -> None:
        super().__init__()
        self.args = args = Gemma4Args.from_config(ctx.config)
        self.dtype = ctx.dtype
        self.quantized_linear = ctx.quantized_linear
        # Built on the meta device, then allocated uninitialised (see LlamaFamilyForCausalLM).
        with torch.device("meta"):
            self.model = Gemma4Model(args, ctx.attention, ctx.dtype)
            self.lm_head = Linear(args.hidden_size, args.vocab_size, bias=False)
        materialize(self, ctx.dtype, ctx.device)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.requires_grad_(False)
        self.attention_layers: tuple[AttentionLayerSpec, ...] = tuple(
            layer.self_attn.cache_spec for layer in self.model.layers
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[LayerKVCache],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Final-normed hidden states ``[num_tokens, hidden]`` of the flat batch."""
        return self.model(input_ids, positions, kv_caches, metadata, self.taps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = self.args.final_logit_softcapping
        if cap is not None:
            # In the model dtype, as transformers caps them, then widened for the sampler.
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    # ----------------------------------------------------------------------- loading

    def wants_weight(self, name: str) -> bool:
        """False for a multimodal checkpoint's vision and audio tensors: they are not read."""
        return not name.startswith(_NOT_TEXT)

    def keep_quantized(self, name: str) -> bool:
        """Whether checkpoint tensor ``name`` may arrive as a ``QuantizedWeight`` (only with a
        quantised-linear kernel): projections, embeddings and the head, never a norm or scalar."""
        name = _text_name(name)
        return self.quantized_linear is not None and (
            name.endswith(("_proj.weight", "_gate.weight", "_projection.weight"))
            or name in ("model.embed_tokens.weight", "model.embed_tokens_per_layer.weight", "lm_head.weight")
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]]) -> None:
        """Copy HF-named tensors in (cast to the model's dtype and device); quantised ones go to
        their layers as stored. A multimodal checkpoint's text tensors are read under their causal
        LM names, its towers skipped. Raises ValueError naming unexpected and missing tensors."""
        targets = dict(self.named_parameters(remove_duplicate=False))
        if self.args.tie_word_embeddings:
            del targets["lm_head.weight"]
        ignored = self._unread_kv_tensors()
        loaded: set[str] = set()
        unexpected: list[str] = []
        quantized: dict[str, QuantizedWeight] = {}
        head: torch.Tensor | QuantizedWeight | None = None
        with torch.no_grad():
            for stored, tensor in weights:
                name = _text_name(stored)
                if name in ignored or not self.wants_weight(name):
                    continue
                if name == "lm_head.weight" and self.args.tie_word_embeddings:
                    head = tensor  # checked against the embedding once both are seen
                    continue
                target = targets.get(name)
                if target is None:
                    unexpected.append(name)
                    continue
                copy_or_keep(name, target, tensor, quantized)
                loaded.add(name)
        check_complete(type(self).__name__, unexpected, sorted(targets.keys() - loaded))
        if head is not None:
            self._check_tied_head(head, quantized.get("model.embed_tokens.weight"))
        if quantized:
            self._use_quantized(quantized)

    def _unread_kv_tensors(self) -> set[str]:
        """Key/value tensors of KV-sharing layers, which checkpoints may hold and transformers drops."""
        return {
            f"model.layers.{index}.self_attn.{part}.{kind}"
            for index, layer in enumerate(self.args.layers)
            if layer.kv_source is not None
            for part in _KV_TENSORS
            for kind in ("weight", "bias")
        }

    def _check_tied_head(self, head: torch.Tensor | QuantizedWeight, table: QuantizedWeight | None) -> None:
        """With tied embeddings an lm_head tensor is redundant; it must equal the embedding."""
        embedding = table.dequantize() if table is not None else self.model.embed_tokens.weight.float()
        stored = head.dequantize() if isinstance(head, QuantizedWeight) else head.float()
        if stored.shape != embedding.shape or not torch.equal(stored.to(embedding.device), embedding):
            raise ValueError(
                "the config ties lm_head to the embedding (tie_word_embeddings), "
                "but the checkpoint's lm_head.weight differs from model.embed_tokens.weight"
            )

    def _use_quantized(self, quantized: dict[str, QuantizedWeight]) -> None:
        kernel = self.quantized_linear
        assert kernel is not None  # keep_quantized accepted nothing without one
        modules = dict(self.named_modules())
        for name, weight in quantized.items():
            module = modules[name.removesuffix(".weight")]
            if isinstance(module, Embedding):
                module.use_quantized(weight, self.dtype)
                if name == "model.embed_tokens.weight" and self.args.tie_word_embeddings:
                    self.lm_head.use_quantized(weight, kernel)
            else:
                module.use_quantized(weight, kernel)


def _text_name(name: str) -> str:
    """A ``Gemma4ForConditionalGeneration`` tensor's name in ``Gemma4ForCausalLM``."""
    return "model." + name.removeprefix(_LANGUAGE_MODEL) if name.startswith(_LANGUAGE_MODEL) else name


def _rounded(value: float, dtype: torch.dtype) -> float:
    """``value`` as the model dtype holds it."""
    return float(torch.tensor(value, dtype=torch.float32, device="cpu").to(dtype))

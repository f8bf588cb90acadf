"""DeepSeek-V2 / V2-Lite / V3 / V3.1 / R1: multi-head latent attention + DeepSeekMoE.

Read it top to bottom like DeepSeek's own ``inference/model.py``:

- **MLA.** Each token's keys and values are compressed into one latent of
  ``kv_lora_rank`` numbers plus a ``qk_rope_head_dim`` rotary key shared by all
  heads; only those two are cached (``KVCacheSpec.standard`` for an ``mla`` layer).
  Attention runs in the weight-absorbed form for every token: queries are projected
  into the latent space through ``kv_b_proj``'s key rows, the backend attends over
  latents, and its latent outputs go back up through the value rows. This is the
  same arithmetic as HF's expanded form, reassociated.
- **YaRN.** Long-context configs stretch the rotary frequencies (``layers/rotary.py``)
  and multiply the softmax scale by ``mscale(factor, mscale_all_dim)**2``.
- **Rope layout.** V3 checkpoints store q/k rope dims as interleaved pairs
  (``rope_interleave``) and V2 rotates pairs as complex numbers; both are the
  rotate-half rotation after moving even dims before odd ones, which is done here.
  Scores are dot products, so the order the rotated dims are kept in does not matter.
- **MoE.** The first ``first_k_dense_replace`` layers have a dense MLP; the rest route
  each token to ``num_experts_per_tok`` of ``n_routed_experts`` experts (routing in
  ``layers/moe.py``, expert math in the MoE backend) plus always-on shared experts.
- **MTP.** ``num_nextn_predict_layers`` extra layers, stored after the decoder layers,
  predict one token further from the model's final hidden state; ``DeepseekMTP`` runs
  them as a drafter for speculative decoding.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs
import structlog
import torch
from torch import nn

from powertrain.interfaces import AttentionLayerSpec, AttentionMetadata, LayerKVCache, ModelContext
from powertrain.interfaces.moe import RoutingConfig
from powertrain.layers.activation import SiluAndMul
from powertrain.layers.attention import MLAAttention
from powertrain.layers.linear import Linear, tiled_matmul
from powertrain.layers.moe import MoE
from powertrain.layers.norm import RMSNorm
from powertrain.layers.rotary import RopeParameters, RotaryEmbedding, apply_rotary, yarn_mscale
from powertrain.models.config_reading import required_reader
from powertrain.models.weights import check_complete, copy_checked, held_here

log = structlog.get_logger(__name__)

ARCHITECTURES = frozenset({"DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"})
_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.(.*)$")
_ROUTED_EXPERT = re.compile(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")


@attrs.frozen(kw_only=True)
class DeepseekArgs:
    """The config.json fields this model reads, with HF's defaults and meaning."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_layers: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    first_k_dense_replace: int
    moe_layer_freq: int
    n_routed_experts: int | None
    n_shared_experts: int
    num_nextn_predict_layers: int
    rope: RopeParameters
    softmax_scale: float
    routing: RoutingConfig | None

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def expert_slice(self, ctx: ModelContext) -> tuple[int, int] | None:
        """``(first, count)`` of the routed experts this rank holds; None: all of them."""
        if self.routing is None or ctx.expert_parallel_size == 1:
            return None
        return ctx.local_experts(self.routing.num_experts)

    def is_moe_layer(self, index: int) -> bool:
        return (
            self.n_routed_experts is not None
            and index >= self.first_k_dense_replace
            and index % self.moe_layer_freq == 0
        )

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> DeepseekArgs:
        required = required_reader(config, "DeepSeek")

        activation = config.get("hidden_act", "silu")
        if activation not in ("silu", "swish"):
            raise ValueError(f"DeepSeek models use a silu MLP, but the config says hidden_act={activation!r}")
        qk_nope, qk_rope = int(required("qk_nope_head_dim")), int(required("qk_rope_head_dim"))
        # HF's DeepSeek configs put qk_rope_head_dim in head_dim: the rotary embedding's width.
        rope = RopeParameters.from_config({**config, "head_dim": qk_rope})
        scale = (qk_nope + qk_rope) ** -0.5
        if rope.rope_type == "yarn" and rope.mscale_all_dim:
            scale *= yarn_mscale(rope.factor, rope.mscale_all_dim) ** 2
        experts = config.get("n_routed_experts")
        return cls(
            vocab_size=int(required("vocab_size")),
            hidden_size=int(required("hidden_size")),
            intermediate_size=int(required("intermediate_size")),
            moe_intermediate_size=int(config.get("moe_intermediate_size") or 0),
            num_layers=int(required("num_hidden_layers")),
            num_heads=int(required("num_attention_heads")),
            q_lora_rank=None if config.get("q_lora_rank") is None else int(config["q_lora_rank"]),
            kv_lora_rank=int(required("kv_lora_rank")),
            qk_nope_head_dim=qk_nope,
            qk_rope_head_dim=qk_rope,
            v_head_dim=int(required("v_head_dim")),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(config.get("max_position_embeddings") or 4096),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=bool(config.get("attention_bias", False)),
            mlp_bias=bool(config.get("mlp_bias", False)),
            first_k_dense_replace=int(config.get("first_k_dense_replace") or 0),
            moe_layer_freq=int(config.get("moe_layer_freq") or 1),
            n_routed_experts=None if experts is None else int(experts),
            n_shared_experts=int(config.get("n_shared_experts") or 0),
            num_nextn_predict_layers=int(config.get("num_nextn_predict_layers") or 0),
            rope=rope,
            softmax_scale=scale,
            routing=None if experts is None else RoutingConfig.from_config(config),
        )


def mla_layer_spec(args: DeepseekArgs) -> AttentionLayerSpec:
    return AttentionLayerSpec(
        kind="mla",
        num_heads=args.num_heads,
        num_kv_heads=1,
        head_size=args.kv_lora_rank + args.qk_rope_head_dim,
        scale=args.softmax_scale,
        kv_lora_rank=args.kv_lora_rank,
        qk_rope_head_dim=args.qk_rope_head_dim,
    )


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Pairs ``(x0, x1), (x2, x3) ...`` -> ``x0 x2 ... | x1 x3 ...``: rotate-half order."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class MLA(nn.Module):
    #: Rows per tile of the absorbed projections (``linear.make_batch_invariant``); None: one einsum.
    row_tile: int | None = None

    def __init__(self, args: DeepseekArgs, backend: Any) -> None:
        super().__init__()
        self.args = args
        h, heads = args.hidden_size, args.num_heads
        if args.q_lora_rank is None:
            self.q_proj = Linear(h, heads * args.qk_head_dim, bias=False)
        else:
            self.q_a_proj = Linear(h, args.q_lora_rank, bias=args.attention_bias)
            self.q_a_layernorm = RMSNorm(args.q_lora_rank, args.rms_norm_eps)
            self.q_b_proj = Linear(args.q_lora_rank, heads * args.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = Linear(h, args.kv_lora_rank + args.qk_rope_head_dim, bias=args.attention_bias)
        self.kv_a_layernorm = RMSNorm(args.kv_lora_rank, args.rms_norm_eps)
        self.kv_b_proj = nn.Linear(args.kv_lora_rank, heads * (args.qk_nope_head_dim + args.v_head_dim), bias=False)
        self.o_proj = Linear(heads * args.v_head_dim, h, bias=args.attention_bias)
        self.attn = MLAAttention(mla_layer_spec(args), backend)

    def _absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``kv_b_proj`` split per head into its key rows ``[heads, nope, rank]`` and value
        rows ``[heads, v, rank]``: views, so they follow whatever was loaded."""
        a = self.args
        w = self.kv_b_proj.weight.view(a.num_heads, a.qk_nope_head_dim + a.v_head_dim, a.kv_lora_rank)
        return w[:, : a.qk_nope_head_dim], w[:, a.qk_nope_head_dim :]

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: LayerKVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        _, q_nope, q_rope, latent, k_rope = self._project(hidden, cos, sin)
        return self._attend(q_nope, q_rope, latent, k_rope, kv_cache, metadata)

    def _project(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q-LoRA residual or None, q_nope, rotated q_rope, normalised latent, rotated k_rope)."""
        a = self.args
        q_resid = None if a.q_lora_rank is None else self.q_a_layernorm(self.q_a_proj(hidden))
        q = self.q_proj(hidden) if q_resid is None else self.q_b_proj(q_resid)
        q = q.view(-1, a.num_heads, a.qk_head_dim)
        q_nope, q_rope = q.split([a.qk_nope_head_dim, a.qk_rope_head_dim], dim=-1)
        compressed = self.kv_a_proj_with_mqa(hidden)
        latent, k_rope = compressed.split([a.kv_lora_rank, a.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)
        q_rope = apply_rotary(_deinterleave(q_rope), cos, sin)
        k_rope = apply_rotary(_deinterleave(k_rope).unsqueeze(1), cos, sin).squeeze(1)
        return q_resid, q_nope, q_rope, latent, k_rope

    def _attend(
        self,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        latent: torch.Tensor,
        k_rope: torch.Tensor,
        kv_cache: LayerKVCache,
        metadata: AttentionMetadata,
        *extra: torch.Tensor,
    ) -> torch.Tensor:
        """Absorbed attention over the latent cache (``extra``: what ``self.attn`` takes
        beyond MLA's inputs, e.g. V3.2's sparse indices), then the output projection."""
        w_key, w_value = self._absorbed()
        q_latent = self._per_head(q_nope, w_key)  # queries in the latent space
        out_latent = self.attn(q_latent, q_rope, latent, k_rope, kv_cache, metadata, *extra)
        out = self._per_head(out_latent, w_value.transpose(1, 2))  # back up to value heads
        return self.o_proj(out.flatten(1))

    def _per_head(self, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``[T, h, a] x [h, a, b] -> [T, h, b]``, head by head in row tiles where batch invariance asks."""
        if self.row_tile is None:
            return torch.einsum("tha,hab->thb", x, weights)
        return torch.stack([tiled_matmul(x[:, i], weights[i], self.row_tile) for i in range(x.shape[1])], dim=1)


class DenseMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)
        self.act = SiluAndMul()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(hidden)))


class DeepseekMoE(nn.Module):
    """Routed experts (through the MoE backend) plus the always-on shared experts."""

    def __init__(
        self,
        args: DeepseekArgs,
        backend: Any,
        dtype: torch.dtype,
        device: torch.device,
        fp8_block: tuple[int, int] | None = None,
        expert_slice: tuple[int, int] | None = None,
        dispatcher: Any = None,
    ) -> None:
        super().__init__()
        assert args.routing is not None
        first, count = expert_slice or (0, args.routing.num_experts)
        self.experts = MoE(
            args.routing,
            args.hidden_size,
            args.moe_intermediate_size,
            backend,
            dtype,
            device,
            fp8_block=fp8_block,
            first_expert=first,
            local_experts=count,
            dispatcher=dispatcher,
        )
        self.shared_experts = (
            DenseMLP(args.hidden_size, args.moe_intermediate_size * args.n_shared_experts, args.mlp_bias)
            if args.n_shared_experts
            else None
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.experts(hidden)
        return out if self.shared_experts is None else out + self.shared_experts(hidden)


#: Builds one layer's attention module: ``MLA`` here, V3.2's indexed MLA in deepseek_v32.py.
AttentionFactory = Callable[[DeepseekArgs, ModelContext], nn.Module]


def dense_mla(args: DeepseekArgs, ctx: ModelContext) -> nn.Module:
    return MLA(args, ctx.attention)


class DeepseekDecoderLayer(nn.Module):
    def __init__(
        self,
        args: DeepseekArgs,
        index: int,
        ctx: ModelContext,
        dtype: torch.dtype,
        device: torch.device,
        attention: AttentionFactory = dense_mla,
    ) -> None:
        super().__init__()
        self.self_attn = attention(args, ctx)
        self.mlp: nn.Module = (
            DeepseekMoE(args, ctx.moe, dtype, device, ctx.fp8_block, args.expert_slice(ctx), ctx.expert_dispatcher)
            if args.is_moe_layer(index)
            else DenseMLP(args.hidden_size, args.intermediate_size, args.mlp_bias)
        )
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
        """The MLP output and the residual it has not been added to yet (as in llama.py)."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, cos, sin, kv_cache, metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DeepseekMTPLayer(nn.Module):
    """One multi-token-prediction depth: ``eh_proj([enorm(embed(next token)); hnorm(h)])``
    through a decoder block, then its own head norm (the head matrix is the model's)."""

    def __init__(
        self,
        args: DeepseekArgs,
        ctx: ModelContext,
        dtype: torch.dtype,
        device: torch.device,
        attention: AttentionFactory = dense_mla,
    ) -> None:
        super().__init__()
        self.enorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.hnorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.eh_proj = Linear(2 * args.hidden_size, args.hidden_size, bias=False)
        # Every MTP layer of the DeepSeek checkpoints is a MoE layer when the model has experts.
        self.block = DeepseekDecoderLayer(args, args.num_layers, ctx, dtype, device, attention)
        self.head_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class DeepseekMTP(nn.Module):
    """The checkpoint's MTP layers as a drafter (what speculative policies call).

    Given the target's final hidden state ``h_i`` of position ``i`` and the token
    ``t_{i+1}`` that follows it, depth ``k`` returns logits for ``t_{i+1+k}``. Depths
    chain: depth k+1 takes depth k's block output as its hidden state. Each depth's
    decoder block attends over its own latent cache (``attention_layers``), which the
    caller allocates like the target's and fills with the same block tables.
    """

    def __init__(self, model: DeepseekV3ForCausalLM, layers: Sequence[DeepseekMTPLayer]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self._model = [model]  # the shared embedding, rotary table and head; not a submodule
        self.attention_layers: tuple[AttentionLayerSpec, ...] = tuple(
            layer.block.self_attn.attn.spec for layer in self.layers
        )

    def forward(
        self,
        depth: int,
        input_ids: torch.Tensor,  # [num_tokens]: the token after each position
        positions: torch.Tensor,  # [num_tokens]
        previous_hidden: torch.Tensor,  # [num_tokens, hidden]: target (or previous depth) output
        kv_cache: LayerKVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Depth ``depth``'s hidden states (before its head norm)."""
        model = self._model[0]
        layer = self.layers[depth]
        embedded = layer.enorm(model.model.embed_tokens(input_ids))
        mixed = layer.eh_proj(torch.cat([embedded, layer.hnorm(previous_hidden)], dim=-1))
        cos, sin = model.model.rotary_emb(positions, metadata.max_seq_len, mixed.dtype)
        hidden, residual = layer.block(mixed, None, cos, sin, kv_cache, metadata)
        return hidden + residual

    def compute_logits(self, depth: int, hidden: torch.Tensor) -> torch.Tensor:
        return self._model[0].compute_logits(self.layers[depth].head_norm(hidden))

    def routed_expert_layers(self, depth: int) -> list[MoE]:
        """The MoE layers depth ``depth``'s forward runs (under expert parallelism a peer
        replays them with no tokens while this rank drafts)."""
        mlp = self.layers[depth].block.mlp
        return [mlp.experts] if isinstance(mlp, DeepseekMoE) else []


class DeepseekModel(nn.Module):
    def __init__(
        self,
        args: DeepseekArgs,
        ctx: ModelContext,
        dtype: torch.dtype,
        device: torch.device,
        attention: AttentionFactory = dense_mla,
    ) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(
            DeepseekDecoderLayer(args, i, ctx, dtype, device, attention) for i in range(args.num_layers)
        )
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(args.qk_rope_head_dim, args.rope, args.max_position_embeddings)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[LayerKVCache],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(positions, metadata.max_seq_len, hidden.dtype)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, cos, sin, kv_cache, metadata)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class DeepseekV3ForCausalLM(nn.Module):
    """Implements ``interfaces.CausalLM`` (and carries ``mtp``, the drafter, when the
    checkpoint has MTP layers)."""

    captures_decode = True

    def __init__(self, ctx: ModelContext, attention: AttentionFactory = dense_mla) -> None:
        super().__init__()
        self.args = args = self.read_args(ctx.config)
        if args.n_routed_experts is not None and ctx.moe is None:
            raise ValueError("a DeepSeek MoE model needs a MoE backend (ModelContext.moe)")
        with torch.device(ctx.device):
            previous = torch.get_default_dtype()
            torch.set_default_dtype(ctx.dtype)  # parameters are created in the model dtype
            try:
                self.model = DeepseekModel(args, ctx, ctx.dtype, ctx.device, attention)
                self.lm_head = Linear(args.hidden_size, args.vocab_size, bias=False)
                if args.tie_word_embeddings:
                    self.lm_head.weight = self.model.embed_tokens.weight
                mtp_layers = [
                    DeepseekMTPLayer(args, ctx, ctx.dtype, ctx.device, attention)
                    for _ in range(args.num_nextn_predict_layers)
                ]
            finally:
                torch.set_default_dtype(previous)
        self.mtp: DeepseekMTP | None = DeepseekMTP(self, mtp_layers) if mtp_layers else None
        self._fp8_block = ctx.fp8_block
        self._expert_slice = args.expert_slice(ctx)  # None: every routed expert is this rank's
        self.requires_grad_(False)
        self.attention_layers: tuple[AttentionLayerSpec, ...] = tuple(
            layer.self_attn.attn.spec for layer in self.model.layers
        )

    @classmethod
    def read_args(cls, config: Mapping[str, Any]) -> DeepseekArgs:
        return DeepseekArgs.from_config(config)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[LayerKVCache],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Final-normed hidden states ``[num_tokens, hidden]`` of the flat batch."""
        return self.model(input_ids, positions, kv_caches, metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def keep_fp8(self, name: str) -> bool:
        """Which FP8 checkpoint tensors to receive as stored (with their scales): routed
        experts, when the MoE backend multiplies FP8 itself (``ModelContext.fp8_block``)."""
        return self._fp8_block is not None and _ROUTED_EXPERT.search(name) is not None

    def naive_kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """What caching expanded keys and values would take: for the startup log's comparison."""
        a = self.args
        per_layer = a.num_heads * (a.qk_head_dim + a.v_head_dim)
        return per_layer * a.num_layers * torch.empty((), dtype=dtype).element_size()

    # ----------------------------------------------------------------------- loading

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in; MTP layers (stored as layers past the decoder's) load
        into ``mtp``. Raises ValueError naming unexpected and missing tensors."""
        targets = self._plain_targets()
        loaded: set[str] = set()
        unexpected: list[str] = []
        shared_copies: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for name, tensor in weights:
                if name in targets:
                    copy_checked(name, targets[name], tensor)
                    loaded.add(name)
                elif self._is_mtp_shared_copy(name):
                    shared_copies[name] = tensor
                elif not self._load_expert(name, tensor):
                    unexpected.append(name)
            for moe in self._moe_layers():
                moe.finish_loading()
            self._check_shared_copies(shared_copies)
        missing = sorted(targets.keys() - loaded)
        if self.args.tie_word_embeddings:
            missing = [m for m in missing if m != "lm_head.weight"]
        check_complete(type(self).__name__, unexpected, missing)

    def _plain_targets(self) -> dict[str, torch.Tensor]:
        """HF tensor name -> the parameter rows it fills, for everything but routed experts."""
        targets: dict[str, torch.Tensor] = {}
        a = self.args

        def add(prefix: str, module: nn.Module) -> None:
            for name, param in module.named_parameters():
                if name.startswith("mlp.experts.") or ".mlp.experts." in name:
                    continue  # routed experts load through their MoE layer
                module_name, _, kind = name.rpartition(".")
                parent, _, leaf = module_name.rpartition(".")
                if leaf == "gate_up_proj":
                    size = param.shape[0] // 2
                    for part, rows in zip(("gate_proj", "up_proj"), param.data.split(size), strict=True):
                        targets[f"{prefix}{parent}.{part}.{kind}"] = rows
                else:
                    targets[f"{prefix}{name}"] = param.data

        add("model.", self.model)
        if not a.tie_word_embeddings:
            add("lm_head.", self.lm_head)
        for depth, layer in enumerate(self.mtp.layers if self.mtp else ()):
            index = a.num_layers + depth
            prefix = f"model.layers.{index}."
            for name in ("enorm", "hnorm", "eh_proj"):
                add(f"{prefix}{name}.", getattr(layer, name))
            add(prefix, layer.block)
            add(f"{prefix}shared_head.norm.", layer.head_norm)
        return targets

    def _is_mtp_shared_copy(self, name: str) -> bool:
        """DeepSeek's checkpoints repeat the embedding and the head inside each MTP layer;
        the drafter shares the model's own, so those copies are only compared."""
        match = _LAYER_NAME.match(name)
        return (
            match is not None
            and self.args.num_layers <= int(match.group(1)) < self.args.num_layers + self.args.num_nextn_predict_layers
            and match.group(2) in ("embed_tokens.weight", "shared_head.head.weight")
        )

    def _check_shared_copies(self, copies: Mapping[str, torch.Tensor]) -> None:
        head = self.lm_head.weight
        for name, tensor in copies.items():
            own = self.model.embed_tokens.weight if name.endswith("embed_tokens.weight") else head
            if tensor.shape != own.shape or not torch.equal(tensor.to(own.device, own.dtype), own):
                log.warning("MTP layer's copy differs from the model's own; the model's is used", tensor=name)

    def routed_expert_layers(self) -> list[MoE]:
        """The MoE layers ``forward`` runs, in order (expert-parallel lockstep replays
        them with no tokens on a rank that has none)."""
        return [layer.mlp.experts for layer in self.model.layers if isinstance(layer.mlp, DeepseekMoE)]

    def wants_weight(self, name: str) -> bool:
        """False for another expert-parallel rank's routed experts: they are not read."""
        return held_here(name, self._expert_slice)

    def _moe_layers(self) -> list[MoE]:
        layers = list(self.model.layers) + [layer.block for layer in (self.mtp.layers if self.mtp else ())]
        return [layer.mlp.experts for layer in layers if isinstance(layer.mlp, DeepseekMoE)]

    def _load_expert(self, name: str, tensor: torch.Tensor) -> bool:
        match = _LAYER_NAME.match(name)
        if match is None or not match.group(2).startswith("mlp."):
            return False
        index, rest = int(match.group(1)), match.group(2)[len("mlp.") :]
        a = self.args
        if index < a.num_layers:
            mlp = self.model.layers[index].mlp
        elif self.mtp is not None and index - a.num_layers < len(self.mtp.layers):
            mlp = self.mtp.layers[index - a.num_layers].block.mlp
        else:
            return False
        return isinstance(mlp, DeepseekMoE) and mlp.experts.load_weight(rest, tensor)

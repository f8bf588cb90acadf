"""DeepSeek MoE routing, and the routed-experts layer a MoE model calls.

Routing rules stay in the core (DESIGN §3): every backend gets the same expert
choice, so a kernel pack can only change how fast the experts run, never which ones.
A backend with a fused gating op (``interfaces.MoERouter``) may compute the choice
for the configs it can express, and must reproduce ``route``'s (the MoE kit checks). The
layer computes the router logits in float32, picks ``top_k`` experts per token with
DeepSeek's rules (``route``) and hands the choice to the ``MoEBackend`` assembly
built. Shared experts are not here: they are a plain MLP the model adds.

DeepSeek's gates, as their checkpoints' config.json name them:

* ``scoring_func``: ``softmax`` over all experts (V2) or an independent ``sigmoid``
  per expert (V3);
* ``topk_method``: ``greedy`` (plain top-k), ``group_limited_greedy`` (V2: keep the
  ``topk_group`` groups whose best expert scores highest, then top-k inside them) or
  ``noaux_tc`` (V3: a learned ``e_score_correction_bias`` is added to the scores for
  the *choice* only, and a group's score is the sum of its two best biased scores);
* ``norm_topk_prob``: the chosen (unbiased) scores are divided by their sum;
* ``routed_scaling_factor``: the weights are then multiplied by it.

Normalising and then scaling, independently, is what DeepSeek-V3's reference code,
HF transformers' V3 router and vLLM do. DeepSeek-V2's original remote code applied
*either* the normalisation *or* the scaling, and transformers' V2 router ignores
``norm_topk_prob``; the published V2 checkpoints all have ``norm_topk_prob: false``,
where every one of these rules agrees.
"""

from __future__ import annotations

import re
from typing import Any

import structlog
import torch
import torch.nn.functional as F
from torch import nn

from powertrain.interfaces import ExpertWeights, ModelContext, MoEBackend, MoERouter, RoutingConfig
from powertrain.layers.activation import ClampedSwiGLU
from powertrain.layers.linear import tiled_matmul
from powertrain.loader.fp4 import FP4_GROUP, PACKED_DTYPES, SCALE_DTYPES
from powertrain.loader.fp8 import FP8_DTYPE

log = structlog.get_logger(__name__)


def route(
    router_logits: torch.Tensor,
    config: RoutingConfig,
    correction_bias: torch.Tensor | None = None,
    expert_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's expert choice: float32 ``[T, E]`` logits -> (int32 ids, float32 weights), ``[T, top_k]`` each.

    The correction bias (noaux_tc) only steers which experts are chosen; the weights
    are always the unbiased scores of the chosen experts. Hash routing chooses nothing:
    ``expert_ids`` (``[T, top_k]``, the layer's ``tid2eid`` rows of the tokens) are the
    experts, and the scores weight them.
    """
    if router_logits.dim() != 2 or router_logits.shape[1] != config.num_experts:
        raise ValueError(f"router_logits must be [num_tokens, {config.num_experts}], got {tuple(router_logits.shape)}")
    if config.uses_correction_bias != (correction_bias is not None):
        need = "needs" if config.uses_correction_bias else "takes no"
        raise ValueError(f"topk_method {config.topk_method!r} {need} e_score_correction_bias")
    if (config.topk_method == "hash") != (expert_ids is not None):
        need = "needs" if config.topk_method == "hash" else "takes no"
        raise ValueError(f"topk_method {config.topk_method!r} {need} expert_ids (the token-id -> experts table's rows)")
    scores = _scores(router_logits.float(), config)
    if expert_ids is not None:
        if tuple(expert_ids.shape) != (router_logits.shape[0], config.top_k):
            raise ValueError(f"expert_ids must be [num_tokens, {config.top_k}], got {tuple(expert_ids.shape)}")
        # The table's range is checked once, at load, not here: that would cost a device sync.
        return expert_ids.to(torch.int32), _weights(scores, expert_ids.long(), config)
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if config.limits_groups:
        grouped = choice.view(-1, config.n_group, config.experts_per_group)
        if config.topk_method == "noaux_tc":
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        else:
            group_scores = grouped.amax(dim=-1)
        kept_groups = group_scores.topk(config.topk_group, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept_groups, True)
        choice = choice.masked_fill(~keep.repeat_interleave(config.experts_per_group, dim=1), float("-inf"))
    topk_ids = choice.topk(config.top_k, dim=-1).indices
    return topk_ids.to(torch.int32), _weights(scores, topk_ids, config)


def _scores(logits: torch.Tensor, config: RoutingConfig) -> torch.Tensor:
    if config.scoring == "sigmoid":
        return logits.sigmoid()
    if config.scoring == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    return logits.softmax(dim=-1)


def _weights(scores: torch.Tensor, ids: torch.Tensor, config: RoutingConfig) -> torch.Tensor:
    """The chosen experts' scores, renormalised if the config says so, times the scaling."""
    weights = scores.gather(1, ids)
    if config.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * config.routed_scaling_factor


_PER_EXPERT = re.compile(r"^experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.(weight|weight_scale_inv|scale)$")
#: DeepSeek's native projection names (V4, V4.1 releases) -> transformers'.
_NATIVE_PROJECTIONS = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class MoE(nn.Module):
    """The routed experts of one layer: router + the chosen ``MoEBackend``.

    Weight names are relative to the layer's ``mlp.`` prefix, in either checkpoint
    layout: per-expert ``experts.{e}.{gate,up,down}_proj.weight`` (DeepSeek's own releases:
    ``experts.{e}.w{1,3,2}.weight``, ``gate.bias``) or transformers 5's fused
    ``experts.gate_up_proj`` / ``experts.down_proj``. Under expert parallelism the layer
    holds experts ``first_expert ... first_expert + local_experts - 1`` and accepts (and
    drops) the others' tensors.

    Build it with its final dtype and device: the router weight must stay float32
    (a ``Module.to(dtype)`` would round it, and ``finish_loading`` refuses that).

    With ``fp8_block`` the experts stay as the checkpoint stores them: float8_e4m3
    weights plus their ``weight_scale_inv`` block scales (per-expert names only), for
    a backend that declares ``fp8-block``. Gate and up stack into one w13 whose scale
    rows stack the same way, which needs the intermediate size to be whole blocks.

    With ``fp4`` the experts stay packed as DeepSeek-V4 stores them: two e2m1 codes per byte
    (uint8 ``[rows, cols / 2]``) plus ue8m0 ``.scale`` tensors (one per 32 columns), for a
    backend that declares ``fp4``.

    ``swiglu_limit`` (DeepSeek-V4) clamps the experts' SwiGLU (``ExpertWeights.swiglu_limit``);
    the backend must declare ``swiglu-limit``, or its ``prepare`` refuses the experts.
    """

    #: Rows per router matmul tile (``linear.make_batch_invariant``); None: one matmul.
    row_tile: int | None = None

    def __init__(
        self,
        routing: RoutingConfig,
        hidden_size: int,
        intermediate_size: int,
        backend: MoEBackend,
        dtype: torch.dtype,
        device: torch.device | str,
        *,
        first_expert: int = 0,
        local_experts: int | None = None,
        fp8_block: tuple[int, int] | None = None,
        dispatcher: Any = None,
        vocab_size: int | None = None,
        swiglu_limit: float | None = None,
        fp4: bool = False,
    ) -> None:
        super().__init__()
        if fp4 and (fp8_block is not None or hidden_size % FP4_GROUP or intermediate_size % FP4_GROUP):
            raise ValueError(
                f"packed FP4 experts need no fp8_block and hidden/intermediate sizes that are multiples of "
                f"{FP4_GROUP}, got fp8_block={fp8_block}, {hidden_size}/{intermediate_size}; load them dequantized"
            )
        self.fp4 = fp4
        if (routing.topk_method == "hash") != (vocab_size is not None):
            need = "needs" if routing.topk_method == "hash" else "takes no"
            raise ValueError(f"a {routing.topk_method!r}-routed MoE layer {need} vocab_size (its tid2eid table)")
        if fp8_block is not None and intermediate_size % fp8_block[0]:
            raise ValueError(
                f"FP8 experts with {fp8_block[0]}-row blocks need an intermediate size that is a multiple of "
                f"{fp8_block[0]}, got {intermediate_size}; load them dequantized instead"
            )
        self.fp8_block = fp8_block
        self.swiglu_limit = swiglu_limit
        local_experts = routing.num_experts - first_expert if local_experts is None else local_experts
        if first_expert < 0 or local_experts < 1 or first_expert + local_experts > routing.num_experts:
            raise ValueError(
                f"experts {first_expert}..{first_expert + local_experts - 1} are not a slice of "
                f"the {routing.num_experts} experts"
            )
        self.routing = routing
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.backend = backend
        # A backend with a fused gating op routes where it can express this config.
        self.backend_routes = False
        if isinstance(backend, MoERouter):
            support = backend.routing_support(routing)
            self.backend_routes = support.available
            if not support.available:
                log.info("moe routing stays in the core", backend=backend.name, reason=support.reason)
        self.first_expert = first_expert
        self.local_experts = local_experts
        #: Expert parallelism: the ExpertDispatcher that takes each token to its experts'
        #: ranks and back (None: every expert this layer routes to is local).
        self.dispatcher = dispatcher
        self.register_buffer(
            "gate_weight", torch.empty(routing.num_experts, hidden_size, dtype=torch.float32, device=device)
        )
        bias = (
            torch.empty(routing.num_experts, dtype=torch.float32, device=device)
            if routing.uses_correction_bias
            else None
        )
        self.register_buffer("e_score_correction_bias", bias)
        #: Hash routing: token id -> its top_k experts (checkpoint ``gate.tid2eid``).
        table = None if vocab_size is None else torch.empty(vocab_size, routing.top_k, dtype=torch.long, device=device)
        self.register_buffer("tid2eid", table)
        # Expert weights are plain tensors, not buffers: after ``finish_loading`` the
        # backend owns them (possibly re-laid out) and the layer lets go of its copy.
        packing = 2 if fp4 else 1  # e2m1 codes per stored element
        shape13 = (local_experts, 2 * intermediate_size, hidden_size // packing)
        shape2 = (local_experts, hidden_size, intermediate_size // packing)
        weight_dtype = FP8_DTYPE if fp8_block is not None else torch.uint8 if fp4 else dtype
        self._w13: torch.Tensor | None = torch.empty(shape13, dtype=weight_dtype, device=device)
        self._w2: torch.Tensor | None = torch.empty(shape2, dtype=weight_dtype, device=device)
        self._w13_scale = self._w2_scale = None
        if fp8_block is not None:
            self._w13_scale = torch.empty(_scale_shape(shape13, fp8_block), dtype=torch.float32, device=device)
            self._w2_scale = torch.empty(_scale_shape(shape2, fp8_block), dtype=torch.float32, device=device)
        if fp4:
            scale13 = (local_experts, 2 * intermediate_size, hidden_size // FP4_GROUP)
            scale2 = (local_experts, hidden_size, intermediate_size // FP4_GROUP)
            self._w13_scale = torch.empty(scale13, dtype=torch.float8_e8m0fnu, device=device)
            self._w2_scale = torch.empty(scale2, dtype=torch.float8_e8m0fnu, device=device)
        #: The checkpoint name of a kept-quantised expert's scale (relative to its projection).
        self._scale_leaf = "weight_scale_inv" if fp8_block is not None else "scale" if fp4 else None
        #: [local expert, projection] -> loaded? (projections in _PROJECTIONS order; scales
        #: in the second half when the experts stay quantised)
        self._loaded_parts = torch.zeros(
            local_experts, len(_PROJECTIONS) * (1 if self._scale_leaf is None else 2), dtype=torch.bool
        )
        self._loaded_router: set[str] = set()
        self.prepared: Any = None

    # ----------------------------------------------------------------------- loading

    def load_weight(self, name: str, tensor: torch.Tensor) -> bool:
        """Copy one checkpoint tensor in; False if ``name`` is not this layer's."""
        E, H, I = self.routing.num_experts, self.hidden_size, self.intermediate_size  # noqa: E741
        if name == "gate.weight":
            self._copy(name, tensor, (E, H), self.gate_weight)
            self._loaded_router.add(name)
            return True
        if name == "gate.tid2eid":
            if self.tid2eid is None:
                return False  # only hash routing has one; the model reports it as unexpected
            self._load_expert_table(tensor)
            self._loaded_router.add(name)
            return True
        if name in ("gate.e_score_correction_bias", "gate.bias"):  # transformers' name, DeepSeek's
            if self.e_score_correction_bias is None:
                return False  # only noaux_tc routing has one; the model reports it as unexpected
            self._copy(name, tensor, (E,), self.e_score_correction_bias)
            self._loaded_router.add("gate.e_score_correction_bias")
            return True
        if name in ("experts.gate_up_proj", "experts.down_proj") and self._scale_leaf is not None:
            raise ValueError(f"mlp.{name}: quantised experts are read from per-expert tensors only")
        if name == "experts.gate_up_proj":
            self._copy(name, tensor, (E, 2 * I, H), self._experts(name)[0], rows=self._local_slice())
            self._loaded_parts[:, :2] = True
            return True
        if name == "experts.down_proj":
            self._copy(name, tensor, (E, H, I), self._experts(name)[1], rows=self._local_slice())
            self._loaded_parts[:, 2] = True
            return True
        match = _PER_EXPERT.match(name)
        if match is None:
            return False
        expert, leaf = int(match.group(1)), match.group(3)
        projection = _NATIVE_PROJECTIONS.get(match.group(2), match.group(2))
        if expert >= E:
            raise ValueError(f"mlp.{name}: expert {expert} does not exist; the config has {E} routed experts")
        if leaf != "weight" and leaf != self._scale_leaf:
            return False  # the loader folds scales into their weights unless the experts stay quantised
        local = expert - self.first_expert
        if leaf != "weight":
            return self._load_scale(name, tensor, local, projection)
        if self.fp4:
            tensor = _packed_bytes(name, tensor)
        packed = (H, I // 2) if self.fp4 else (H, I)
        want = packed if projection == "down_proj" else ((I, H // 2) if self.fp4 else (I, H))
        if not 0 <= local < self.local_experts:
            self._check(name, tensor, want)
            return True  # another expert-parallel rank's expert
        w13, w2 = self._experts(name)
        if projection == "gate_proj":
            self._copy(name, tensor, want, w13[local, :I])
        elif projection == "up_proj":
            self._copy(name, tensor, want, w13[local, I:])
        else:
            self._copy(name, tensor, want, w2[local])
        self._loaded_parts[local, _PROJECTIONS.index(projection)] = True
        return True

    def _load_expert_table(self, tensor: torch.Tensor) -> None:
        """Check the hash table once here, so routing never reads an expert that is not there."""
        assert self.tid2eid is not None
        if tuple(tensor.shape) != tuple(self.tid2eid.shape) or tensor.is_floating_point():
            raise ValueError(
                f"mlp.gate.tid2eid is {tensor.dtype} {tuple(tensor.shape)}, but this layer needs integer "
                f"{tuple(self.tid2eid.shape)} (vocab_size x num_experts_per_tok)"
            )
        if tensor.numel() and (int(tensor.min()) < 0 or int(tensor.max()) >= self.routing.num_experts):
            raise ValueError(
                f"mlp.gate.tid2eid names experts {int(tensor.min())}..{int(tensor.max())}, but the layer has "
                f"{self.routing.num_experts}: the checkpoint is damaged"
            )
        with torch.no_grad():
            self.tid2eid.copy_(tensor)

    def _load_scale(self, name: str, tensor: torch.Tensor, local: int, projection: str) -> bool:
        assert self._w13_scale is not None and self._w2_scale is not None
        H, I = self.hidden_size, self.intermediate_size  # noqa: E741
        weight = (H, I) if projection == "down_proj" else (I, H)
        if self.fp4:
            shape = (weight[0], weight[1] // FP4_GROUP)
            tensor = _e8m0(name, tensor)
        else:
            assert self.fp8_block is not None
            shape = _scale_shape(weight, self.fp8_block)
        if tuple(tensor.shape) != shape:
            raise ValueError(f"mlp.{name} has shape {tuple(tensor.shape)}, but this layer's config needs {shape}")
        if not 0 <= local < self.local_experts:
            return True
        self._experts(name)  # refuses after finish_loading
        rows = shape[0]
        target = {
            "gate_proj": self._w13_scale[local, :rows],
            "up_proj": self._w13_scale[local, rows:],
            "down_proj": self._w2_scale[local],
        }[projection]
        with torch.no_grad():
            target.copy_(tensor)
        self._loaded_parts[local, len(_PROJECTIONS) + _PROJECTIONS.index(projection)] = True
        return True

    def _experts(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        if self._w13 is None or self._w2 is None:
            raise RuntimeError(f"mlp.{name}: this MoE layer has finished loading; its experts belong to the backend")
        return self._w13, self._w2

    def _local_slice(self) -> slice:
        return slice(self.first_expert, self.first_expert + self.local_experts)

    def _check(self, name: str, tensor: torch.Tensor, want: tuple[int, ...]) -> None:
        if tuple(tensor.shape) != want:
            raise ValueError(f"mlp.{name} has shape {tuple(tensor.shape)}, but this layer's config needs {want}")
        if self.fp4 and name.startswith("experts.") and tensor.dtype != torch.uint8:
            raise ValueError(f"mlp.{name} is {tensor.dtype}, but this layer keeps its experts as packed FP4 bytes")
        if self.fp8_block is not None and name.startswith("experts.") and tensor.dtype != FP8_DTYPE:
            raise ValueError(f"mlp.{name} is {tensor.dtype}, but this layer keeps its experts in {FP8_DTYPE}")
        if self.fp8_block is None and tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise ValueError(
                f"mlp.{name} is {tensor.dtype}: dequantize FP8 weights with their weight_scale_inv "
                "(powertrain.loader.fp8.dequantize_blocks) before handing them to the layer"
            )

    def _copy(
        self, name: str, tensor: torch.Tensor, want: tuple[int, ...], target: torch.Tensor, rows: slice | None = None
    ) -> None:
        self._check(name, tensor, want)
        with torch.no_grad():
            target.copy_(tensor if rows is None else tensor[rows])

    def missing_weights(self) -> list[str]:
        """Checkpoint names (relative to ``mlp.``) not loaded yet."""
        has = {
            "gate.weight": True,
            "gate.e_score_correction_bias": self.e_score_correction_bias is not None,
            "gate.tid2eid": self.tid2eid is not None,
        }
        missing = [name for name, needed in has.items() if needed and name not in self._loaded_router]
        for local, part in (~self._loaded_parts).nonzero().tolist():
            suffix = "weight" if part < len(_PROJECTIONS) else self._scale_leaf
            missing.append(f"experts.{self.first_expert + local}.{_PROJECTIONS[part % len(_PROJECTIONS)]}.{suffix}")
        return missing

    def finish_loading(self) -> None:
        """Check every weight arrived, then let the backend prepare the experts (once)."""
        if self.prepared is not None:
            return
        missing = self.missing_weights()
        if missing:
            shown = ", ".join(f"mlp.{n}" for n in missing[:8])
            more = f" (and {len(missing) - 8} more)" if len(missing) > 8 else ""
            raise ValueError(f"MoE layer weights never loaded: {shown}{more}")
        if self.gate_weight.dtype != torch.float32:
            raise ValueError(
                f"the router weight is {self.gate_weight.dtype}, not float32: build the MoE layer with its "
                "final dtype and device instead of casting the model afterwards, or routing loses precision"
            )
        assert self._w13 is not None and self._w2 is not None
        weights = ExpertWeights(
            w13=self._w13,
            w2=self._w2,
            num_experts=self.routing.num_experts,
            first_expert=self.first_expert,
            w13_scale=self._w13_scale,
            w2_scale=self._w2_scale,
            block_shape=self.fp8_block,
            swiglu_limit=self.swiglu_limit,
            fp4=self.fp4,
        )
        self.prepared = self.backend.prepare(weights)
        self._w13 = self._w2 = self._w13_scale = self._w2_scale = None

    # ----------------------------------------------------------------------- running

    def _route(
        self, hidden: torch.Tensor, token_ids: torch.Tensor | None, correction_bias: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's experts and weights. With ``row_tile`` the router runs on whole tiles
        of rows (zero rows pad the last): torch's elementwise kernels take a scalar path for
        a tensor's last few elements, whose rounding (of the sigmoid's exp, say) differs from
        the vector lanes', so a token's weights would otherwise follow its place in the batch."""
        if self.tid2eid is not None and (token_ids is None or token_ids.shape != hidden.shape[:1]):
            got = None if token_ids is None else tuple(token_ids.shape)
            raise ValueError(f"a hash-routed MoE layer needs one token id per row of hidden, got {got}")
        rows = hidden.shape[0]
        pad = 0 if self.row_tile is None else -rows % self.row_tile
        inputs = hidden.float() if not pad else F.pad(hidden.float(), (0, 0, 0, pad))
        router_logits = tiled_matmul(inputs, self.gate_weight.T, self.row_tile)
        if self.tid2eid is not None:
            expert_ids = self.tid2eid[token_ids] if not pad else F.pad(self.tid2eid[token_ids], (0, 0, 0, pad))
            topk_ids, topk_weights = route(router_logits, self.routing, expert_ids=expert_ids)
        elif correction_bias is not None:  # per-row biases: the core's routing (backends take one bias)
            if correction_bias.shape != (rows, self.routing.num_experts):
                raise ValueError(
                    f"a per-row correction bias must be [{rows}, {self.routing.num_experts}], "
                    f"got {list(correction_bias.shape)}"
                )
            bias = correction_bias if not pad else F.pad(correction_bias, (0, 0, 0, pad))
            topk_ids, topk_weights = route(router_logits, self.routing, bias)
        else:
            choose = self.backend.route if self.backend_routes else route
            topk_ids, topk_weights = choose(router_logits, self.routing, self.e_score_correction_bias)
        return topk_ids[:rows], topk_weights[:rows]

    def forward(
        self, hidden: torch.Tensor, token_ids: torch.Tensor | None = None, correction_bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``[T, H]`` -> the routed experts' weighted sum, ``[T, H]`` in ``hidden``'s dtype.
        Hash routing needs the tokens' ids (``[T]``); other layers ignore them. ``correction_bias``
        (float32 ``[T, E]``, noaux_tc only) replaces the layer's bias row by row (V4.1 routes
        image positions with another one)."""
        if self.prepared is None:
            raise RuntimeError("MoE.forward before finish_loading(): the backend has no weights yet")
        topk_ids, topk_weights = self._route(hidden, token_ids, correction_bias)
        if self.dispatcher is None:
            return self.backend.forward(hidden, topk_ids, topk_weights, self.prepared)
        rows, tokens_per_expert, scales, handle = self.dispatcher.dispatch(
            hidden, topk_ids, topk_weights, self.routing.num_experts
        )
        out = self.backend.forward_grouped(rows, tokens_per_expert, self.prepared, scales)
        return self.dispatcher.combine(out, handle)

    def extra_repr(self) -> str:
        r = self.routing
        text = (
            f"backend={self.backend.name}, experts={r.num_experts}, top_k={r.top_k}, "
            f"hidden={self.hidden_size}, intermediate={self.intermediate_size}, {r.scoring}/{r.topk_method}"
        )
        if self.swiglu_limit is not None:
            text += f", swiglu_limit={self.swiglu_limit}"
        if self.local_experts != r.num_experts:
            text += f", local experts {self.first_expert}..{self.first_expert + self.local_experts - 1}"
        return text


def _packed_bytes(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A packed FP4 weight as the uint8 bytes it is (int8 and ``float4_e2m1fn_x2`` hold the same)."""
    if tensor.dtype not in PACKED_DTYPES:
        raise ValueError(
            f"mlp.{name} is {tensor.dtype}, but packed FP4 experts come as int8, uint8 or float4_e2m1fn_x2"
        )
    return tensor.view(torch.uint8)


def _e8m0(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """An FP4 scale as ``float8_e8m0fnu`` (a uint8 exponent byte is the same bit pattern)."""
    if tensor.dtype not in SCALE_DTYPES:
        raise ValueError(f"mlp.{name} is {tensor.dtype}, but FP4 scales are ue8m0 (float8_e8m0fnu or uint8 bytes)")
    return tensor.view(torch.float8_e8m0fnu)


def _scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """One scale per ``block`` of the last two dimensions (the last blocks may be partial)."""
    *lead, rows, cols = shape
    return (*lead, -(-rows // block[0]), -(-cols // block[1]))


class SharedExpertMoE(nn.Module):
    """DeepSeek-V4's and V4.1's MoE block: the routed experts (through the MoE backend, this
    rank's slice under expert parallelism) plus ``n_shared`` clamped-SwiGLU shared experts."""

    def __init__(
        self,
        ctx: ModelContext,
        routing: RoutingConfig,
        hidden_size: int,
        intermediate_size: int,
        *,
        n_shared: int,
        swiglu_limit: float | None,
        vocab_size: int | None = None,
    ) -> None:
        super().__init__()
        if ctx.moe is None:
            raise ValueError("a routed MoE layer needs a MoE backend (ModelContext.moe)")
        experts = routing.num_experts
        first, count = (0, experts) if ctx.expert_parallel_size == 1 else ctx.local_experts(experts)
        self.experts = MoE(
            routing,
            hidden_size,
            intermediate_size,
            ctx.moe,
            ctx.dtype,
            ctx.device,
            first_expert=first,
            local_experts=count,
            dispatcher=ctx.expert_dispatcher,
            vocab_size=vocab_size,
            swiglu_limit=swiglu_limit,
            fp4=ctx.fp4_experts,
        )
        self.shared_experts = (
            ClampedSwiGLU(hidden_size, intermediate_size * n_shared, swiglu_limit) if n_shared else None
        )

    def forward(
        self, hidden: torch.Tensor, token_ids: torch.Tensor, correction_bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        out = (
            self.experts(hidden, token_ids)
            if correction_bias is None
            else self.experts(hidden, token_ids, correction_bias)
        )
        return out if self.shared_experts is None else out + self.shared_experts(hidden)

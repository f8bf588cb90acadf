"""The attention contract: the KV cache a backend declares, the metadata of one step's
batch, and the Protocols attention backends (and their fused small kernels) implement.

It carries what both a Triton kernel and Ascend's
``npu_fused_infer_attention_score`` consume, without a translation layer:

* tokens of all sequences are packed into one flat ``[num_tokens, heads, dim]``
  batch; decode sequences (one new token) come first, so a backend may split the
  batch at ``num_decodes`` (e.g. decode through the op's BSH/BSND paged path, one
  query token per sequence, and prefill through its TND path);
* host copies of the lengths, as the op wants them (``actual_seq_lengths`` and
  ``actual_seq_lengths_kv`` are host int lists): ``query_start_loc_host[1:]`` is
  the cumulative query length list of TND, ``seq_lens_host`` the per-sequence kv
  lengths (cumulate them where a layout asks for cumulative kv lengths); the
  device tensors hold the same numbers for kernels;
* ``block_tables`` is an int32 ``[batch, max_blocks]`` table into the paged cache,
  the op's ``block_table``;
* the paged cache is laid out as the backend declares in its ``KVCacheSpec``
  (block-token-major = BSH/BSND, block-head-major = BNBD) and allocated that way
  by the engine, so no backend re-lays it out per step.

MLA: ``forward_mla`` is the weight-absorbed form. Ascend's rope-split path and
FlashMLA serve it for decode only; a backend declares ``decode``/``prefill``
alongside ``mla`` to say which phases it serves. Sparse MLA (DeepSeek-V3.2's DSA,
capability ``sparse-mla``): ``forward_mla_sparse`` attends each query token only to
the top-k cached tokens an indexer picked for it. DeepSeek-V4 attention (capability
``v4-attention``): ``forward_v4`` attends over a sliding window of raw keys plus
compressed entries, with per-head sinks. The Lightning Indexer (capability
``lightning-indexer``): ``index_topk`` scores each query token against a sequence's
cached indexer keys and returns the best positions (V3.2) or entries (V4's CSA).

CUDA graphs (capability ``cuda-graphs``): the engine may capture a decode step for a
fixed batch size and replay it (``engine.cuda_graphs``). A captured step's metadata
has every row a decode (padding rows are one-token sequences over a block the engine
reserved), its tensors are buffers the engine refills before each replay, and its
host values are fixed at capture: ``seq_lens_host`` and ``max_seq_len`` are then upper
bounds (the model's length), not the step's lengths. A backend that declares the tag
must, on decode rows: take lengths from ``seq_lens`` on the device and use the host
values only to size launches (so its split counts are fixed per captured size), never
read a value back to the host (sparse indices are refused on the device:
``AttentionMetadata.refuse_sparse_indices``), and create no tensor from host data;
allocating through torch's allocator is fine (a graph keeps its own pool).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Protocol, runtime_checkable

import attrs
import torch

from powertrain.interfaces.platform import PlatformInfo

# --------------------------------------------------------------------------- KV cache


@attrs.frozen(kw_only=True)
class KVTensorSpec:
    """One tensor of a layer's cache: its name and its shape per token."""

    name: str
    shape: tuple[int, ...] = attrs.field(converter=tuple)

    @shape.validator
    def _positive(self, attribute: attrs.Attribute, value: tuple[int, ...]) -> None:
        if not value or any((not isinstance(d, int)) or d <= 0 for d in value):
            raise ValueError(f"KV tensor {self.name!r}: shape must be positive ints, got {value!r}")


KVLayout = Literal["block-token-major", "block-head-major"]


@attrs.frozen(kw_only=True)
class KVCacheSpec:
    """A backend's declaration of one layer's paged cache.

    ``block-token-major``: each tensor is ``[num_blocks, block_size, *shape]``
    (``shape`` = ``(kv_heads, head_dim)`` for GQA, or ``(kv_heads * head_dim,)`` for
    Ascend's BSH paged layout). ``block-head-major``: ``[num_blocks, shape[0],
    block_size, *shape[1:]]`` (Ascend's BNBD layout).

    GQA caches hold ``key`` and ``value``; MLA caches hold only the compressed
    ``latent`` (kv_lora_rank) and the ``rope`` key (qk_rope_head_dim), which is
    what makes MLA's cache small: the engine's memory accounting reads
    ``bytes_per_token``.
    """

    block_size: int = attrs.field()
    dtype: torch.dtype
    tensors: tuple[KVTensorSpec, ...] = attrs.field(converter=tuple)
    layout: KVLayout = attrs.field(default="block-token-major")

    @block_size.validator
    def _block_size(self, attribute: attrs.Attribute, value: int) -> None:
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"KVCacheSpec.block_size must be a positive int, got {value!r}")

    @layout.validator
    def _layout(self, attribute: attrs.Attribute, value: str) -> None:
        if value not in ("block-token-major", "block-head-major"):
            raise ValueError(f"KVCacheSpec.layout: unknown layout {value!r}")
        if value == "block-head-major" and any(len(t.shape) < 2 for t in self.tensors):
            raise ValueError("KVCacheSpec: block-head-major needs per-token shapes of (heads, dim, ...)")

    @property
    def bytes_per_token(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return sum(math.prod(t.shape) for t in self.tensors) * itemsize

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def tensor_shape(self, tensor: KVTensorSpec, num_blocks: int) -> tuple[int, ...]:
        if self.layout == "block-head-major":
            return (num_blocks, tensor.shape[0], self.block_size, *tensor.shape[1:])
        return (num_blocks, self.block_size, *tensor.shape)

    @classmethod
    def standard(
        cls, layer: AttentionLayerSpec, block_size: int, dtype: torch.dtype, layout: KVLayout = "block-token-major"
    ) -> KVCacheSpec:
        """The usual cache of ``layer``: ``key`` and ``value`` of (kv_heads, head_size)
        per token for GQA/MHA; only ``latent`` and ``rope`` for MLA."""
        if layer.kind == "mla":
            tensors = (
                KVTensorSpec(name="latent", shape=(layer.kv_lora_rank,)),
                KVTensorSpec(name="rope", shape=(layer.qk_rope_head_dim,)),
            )
        else:
            per_token = (layer.num_kv_heads, layer.head_size)
            tensors = (KVTensorSpec(name="key", shape=per_token), KVTensorSpec(name="value", shape=per_token))
        return cls(block_size=block_size, dtype=dtype, tensors=tensors, layout=layout)

    def allocate(self, num_blocks: int, device: torch.device | str) -> dict[str, torch.Tensor]:
        """One layer's cache tensors, uninitialised (blocks are written before read)."""
        return {
            t.name: torch.empty(self.tensor_shape(t, num_blocks), dtype=self.dtype, device=device) for t in self.tensors
        }


@attrs.frozen(kw_only=True)
class CacheGroupSpec:
    """Tensors a layer caches with one granularity and one retention: a *cache group*.

    ``tokens_per_entry``: 1 for per-token tensors (raw KV, indexer keys); ``m`` for a
    compressed cache holding one entry per ``m`` tokens (DeepSeek-V4's CSA/HCA).
    ``sliding_window``: None keeps the whole history; ``W`` keeps what a token at
    position ``p`` still reads, positions ``> p - W`` (the Mistral/HF rule), and lets the
    engine free the blocks before that.

    Blocks are the unit across groups: block ``i`` of a sequence covers its tokens
    ``[i*block_size, (i+1)*block_size)`` in every group, so a group holds
    ``block_size // tokens_per_entry`` entries per block, block-token-major
    (``[num_blocks, entries_per_block, *shape]``). Groups of the same retention share
    one block table; each retention class has its own pool of blocks.

    State that is not per token but per sequence (a compressor's open window, say) is
    declared as a sliding group of per-token rows wide enough for the window: it then
    rolls back with rejected drafts, survives preemption and is prefix-cached by the
    same lengths and block ids as everything else, which a separate per-sequence state
    buffer could not.

    A layer may also *read* a group another layer owns (DeepSeek-V4.1's layers reading
    their KV source's compressed cache): it declares the source's group as
    ``group.read_from(source)``. ``allocate_caches`` then hands it the source's tensors
    under the same names (no copy, no second cache); the group is counted, moved between
    tiers and sized once, at its source, and the reader gets the source's block tables
    through the group's retention class as every group does.
    """

    name: str
    tensors: tuple[KVTensorSpec, ...] = attrs.field(converter=tuple)
    tokens_per_entry: int = attrs.field(default=1)
    sliding_window: int | None = attrs.field(default=None)
    #: None: the engine's cache dtype.
    dtype: torch.dtype | None = None
    #: None: this layer owns the group. An index: the group is that (earlier) layer's,
    #: which this layer reads (``read_from``).
    source_layer: int | None = attrs.field(default=None)

    @source_layer.validator
    def _source(self, attribute: attrs.Attribute, value: int | None) -> None:
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise ValueError(f"cache group {self.name!r}: source_layer must be None or a layer index, got {value!r}")

    def read_from(self, layer: int) -> CacheGroupSpec:
        """This group (declared by layer ``layer``) as a later layer that reads it declares it."""
        return attrs.evolve(self, source_layer=layer)

    @property
    def owned(self) -> CacheGroupSpec:
        """The group as its owner declares it."""
        return attrs.evolve(self, source_layer=None)

    @tokens_per_entry.validator
    def _granularity(self, attribute: attrs.Attribute, value: int) -> None:
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"cache group {self.name!r}: tokens_per_entry must be a positive int, got {value!r}")

    @sliding_window.validator
    def _window(self, attribute: attrs.Attribute, value: int | None) -> None:
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"cache group {self.name!r}: sliding_window must be None or a positive int, got {value!r}")

    def entries_per_block(self, block_size: int) -> int:
        if block_size % self.tokens_per_entry:
            raise ValueError(
                f"cache group {self.name!r} holds one entry per {self.tokens_per_entry} tokens, which a block of "
                f"{block_size} tokens does not divide; set [cache] block_size to a multiple of {self.tokens_per_entry}"
            )
        return block_size // self.tokens_per_entry

    def paged(self, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        """The group's block layout (``KVCacheSpec.block_size`` counts entries here)."""
        return KVCacheSpec(
            block_size=self.entries_per_block(block_size), dtype=self.dtype or dtype, tensors=self.tensors
        )

    def bytes_per_token(self, block_size: int, dtype: torch.dtype) -> float:
        return self.paged(block_size, dtype).bytes_per_block / block_size

    def allocate(
        self, block_size: int, dtype: torch.dtype, num_blocks: int, device: torch.device | str
    ) -> dict[str, torch.Tensor]:
        """The group's tensors for ``num_blocks`` usable blocks (plus a zeroed null block
        when sliding, see ``AttentionLayerSpec.allocate_cache``)."""
        tensors = self.paged(block_size, dtype).allocate(pool_blocks(self.sliding_window, num_blocks), device)
        return _with_null_block(tensors, self.sliding_window)


#: One layer's cache, as allocated from its KVCacheSpec: tensor name -> tensor.
LayerKVCache = Mapping[str, torch.Tensor]


# --------------------------------------------------------------------------- attention


@attrs.frozen(kw_only=True)
class AttentionLayerSpec:
    """Static shape of one attention layer, fixed at model construction."""

    #: "custom": the model computes this layer's attention itself, over its own
    #: ``cache_groups`` (DeepSeek-V4's window + compressed attention, until a backend
    #: serves it); the attention backend holds no cache for the layer and is not called.
    kind: Literal["gqa", "mla", "custom"]
    num_heads: int
    #: GQA: key/value heads. MLA: 1 (the latent is shared by all heads).
    num_kv_heads: int
    #: GQA: head dim of q/k/v. MLA: kv_lora_rank + qk_rope_head_dim (the absorbed q·k dim).
    head_size: int
    scale: float
    #: MLA only: latent width and rope width of the cached key.
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    #: Each token sees itself and the ``sliding_window - 1`` tokens before it (HF/Mistral
    #: rule). Only backends declaring the "sliding-window" capability serve such layers.
    sliding_window: int | None = None
    #: False: each new token of a sequence sees every key of it, this step's later ones
    #: too (a block drafter's block over its cache: DSpark's block attends both ways).
    #: With a sliding window W, every new token sees the same keys: the W cached before the
    #: step's first new token, and all new ones (DeepSeek-V4.1's DSpark block over its
    #: window). Only backends declaring the "non-causal" capability serve such layers.
    causal: bool = attrs.field(default=True)
    #: Cache groups the model itself writes and reads beside the backend's KV (DeepSeek-V3.2:
    #: its indexer's ``index_keys``), each with its own granularity and retention (see
    #: ``CacheGroupSpec``). The engine allocates them in the blocks of their retention
    #: class and merges their tensors into the layer's ``LayerKVCache`` under their names,
    #: so prefix caching, chunked prefill, preemption and speculative rollback, which only
    #: move block ids and lengths, treat them exactly like the KV. Names must not collide
    #: with the backend's tensors or each other.
    cache_groups: tuple[CacheGroupSpec, ...] = attrs.field(default=(), converter=tuple)

    @causal.validator
    def _causal(self, attribute: attrs.Attribute, value: bool) -> None:
        if not value and self.kind != "gqa":
            raise ValueError(f"causal=False is served for GQA/MHA layers only, not {self.kind!r}")

    @property
    def windows(self) -> frozenset[int | None]:
        """The retention classes this layer's cache lives in (None: full history)."""
        own = {g.sliding_window for g in self.cache_groups}
        return frozenset(own if self.kind == "custom" else {self.sliding_window, *own})

    def window_of(self, tensor_name: str) -> int | None:
        """The retention class of this layer's cache tensor ``tensor_name``: its cache
        group's, or the layer's own for the backend's tensors."""
        for group in self.cache_groups:
            if any(tensor.name == tensor_name for tensor in group.tensors):
                return group.sliding_window
        return self.sliding_window

    def backend_cache_spec(self, backend: Any, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        """What ``backend`` caches for this layer: its ``kv_cache_spec``, or nothing for a
        ``custom`` layer (the model's own groups are all of its cache)."""
        if self.kind == "custom":
            return KVCacheSpec(block_size=block_size, dtype=dtype, tensors=())
        return backend.kv_cache_spec(self, block_size, dtype)

    def groups(self, backend_spec: KVCacheSpec) -> tuple[CacheGroupSpec, ...]:
        """Every cache group of this layer: the backend's KV (named ``attention``, one entry
        per token, retained as the layer's ``sliding_window`` says) and the model's own."""
        if not backend_spec.tensors:
            return self.cache_groups
        attention = CacheGroupSpec(
            name="attention", tensors=backend_spec.tensors, sliding_window=self.sliding_window, dtype=backend_spec.dtype
        )
        return (attention, *self.cache_groups)

    def reads_shared(self, tensor_name: str) -> bool:
        """Whether ``tensor_name`` is another layer's, which this layer only reads."""
        return any(
            group.source_layer is not None and any(tensor.name == tensor_name for tensor in group.tensors)
            for group in self.cache_groups
        )

    def bytes_per_block(self, backend_spec: KVCacheSpec) -> dict[int | None, int]:
        """Bytes one block of each retention class takes for this layer (the groups it
        reads from another layer are that layer's)."""
        out: dict[int | None, int] = {}
        for group in self.groups(backend_spec):
            if group.source_layer is not None:
                continue
            paged = group.paged(backend_spec.block_size, backend_spec.dtype)
            out[group.sliding_window] = out.get(group.sliding_window, 0) + paged.bytes_per_block
        return out

    def allocate_cache(
        self, backend_spec: KVCacheSpec, num_blocks: int | Mapping[int | None, int], device: torch.device | str
    ) -> dict[str, torch.Tensor]:
        """This layer's own cache: the backend's tensors plus the model's groups, one dict
        (without the groups it reads from other layers: ``allocate_caches`` adds those).

        ``num_blocks[w]`` is the number of usable blocks of retention class ``w`` (an int:
        the same for every class). A sliding class gets one block more, its last, zeroed:
        its *null block*, where block tables point blocks that fell out of the window, so
        a backend that reads (and masks) them reads zeros, never stale or NaN memory.
        Raises ValueError when two tensors share a name.
        """
        counts = num_blocks if isinstance(num_blocks, Mapping) else dict.fromkeys(self.windows, num_blocks)
        block_size = backend_spec.block_size
        cache: dict[str, torch.Tensor] = {}
        if backend_spec.tensors:
            cache = backend_spec.allocate(pool_blocks(self.sliding_window, counts[self.sliding_window]), device)
            _with_null_block(cache, self.sliding_window)
        for group in self.cache_groups:
            if group.source_layer is not None:
                continue
            tensors = group.allocate(block_size, backend_spec.dtype, counts[group.sliding_window], device)
            clash = sorted(cache.keys() & tensors.keys())
            if clash:
                raise ValueError(
                    f"cache group {group.name!r} tensors {clash} clash with other cache tensors of the layer "
                    f"{sorted(cache)}; rename the model's CacheGroupSpec tensors"
                )
            cache.update(tensors)
        return cache


def check_cache_sharing(layers: Sequence[AttentionLayerSpec]) -> None:
    """Every group a layer reads from another layer is declared, exactly so, by an earlier
    layer that owns it, and its tensors' names are free in the reader. Raises ValueError
    naming the layer, the group and what to change."""
    for index, layer in enumerate(layers):
        for group in layer.cache_groups:
            source = group.source_layer
            if source is None:
                continue
            where = f"layer {index} reads cache group {group.name!r} of layer {source}"
            if source >= index:
                raise ValueError(f"{where}: a layer can only read the group of an earlier layer (index < {index})")
            owned = [g for g in layers[source].cache_groups if g.name == group.name and g.source_layer is None]
            if not owned:
                raise ValueError(
                    f"{where}, which owns no such group (its own: "
                    f"{sorted(g.name for g in layers[source].cache_groups if g.source_layer is None)})"
                )
            if owned[0] != group.owned:
                raise ValueError(
                    f"{where}, declared differently there ({owned[0]}) than read here ({group.owned}); "
                    "declare it as the source's group.read_from(source)"
                )
            names = {t.name for g in layer.cache_groups if g is not group for t in g.tensors}
            clash = sorted(names & {t.name for t in group.tensors})
            if clash:
                raise ValueError(f"{where}: its tensors {clash} clash with the layer's other cache tensors")


def allocate_caches(
    layers: Sequence[AttentionLayerSpec],
    backend_specs: Sequence[KVCacheSpec],
    num_blocks: int | Mapping[int | None, int],
    device: torch.device | str,
) -> list[dict[str, torch.Tensor]]:
    """Every layer's cache (``AttentionLayerSpec.allocate_cache``), each reading layer given
    its sources' tensors of the groups it reads (``CacheGroupSpec.read_from``)."""
    check_cache_sharing(layers)
    caches: list[dict[str, torch.Tensor]] = []
    for layer, spec in zip(layers, backend_specs, strict=True):
        cache = layer.allocate_cache(spec, num_blocks, device)
        for group in layer.cache_groups:
            if group.source_layer is not None:
                cache.update({t.name: caches[group.source_layer][t.name] for t in group.tensors})
        caches.append(cache)
    return caches


def _with_null_block(tensors: dict[str, torch.Tensor], window: int | None) -> dict[str, torch.Tensor]:
    """Zero a sliding class's null block (its last) in each of ``tensors``."""
    if window is not None:
        for tensor in tensors.values():
            tensor[-1].zero_()
    return tensors


def pool_blocks(window: int | None, usable: int) -> int:
    """Blocks a retention class's tensors hold: its usable blocks, plus the null block of a
    sliding class (block id ``usable``)."""
    return usable + (window is not None)


@attrs.define(eq=False)
class RefusedIndices:
    """The first sparse index a backend refused on the device this step
    (``AttentionMetadata.refuse_sparse_indices``), shared by a step's window views:
    int64 ``[refused, row, column, index, seq_len, tokens_per_entry]``, all 0 while none
    was; None until a backend refuses on the device."""

    record: torch.Tensor | None = None


@attrs.frozen(kw_only=True)
class AttentionMetadata:
    """One step's batch as every attention backend sees it (see the module docstring).

    Sequence ``i`` owns flat tokens ``query_start_loc[i]:query_start_loc[i+1]``; its
    keys are the ``seq_lens[i]`` tokens in blocks ``block_tables[i]``, of which the last
    ``query_len`` are this step's new tokens (so prefix-cache hits and earlier chunks are
    simply cached tokens before them). ``slot_mapping[t]`` = block * block_size + offset
    is where new token ``t``'s key/value go. A runner may pad the flat batch past
    ``num_tokens`` (e.g. to a captured graph size): padded rows have slot -1 and
    position 0, are not written to the cache, and their outputs are unspecified. Any
    sequence with one new token counts as a decode, whether it decodes or ends a
    prompt with a one-token chunk: the runner places all of them first. Entries of
    ``block_tables`` past a sequence's last block are 0 and never read. Query/key/value
    may be strided views (e.g. of a fused qkv projection); a kernel that needs
    contiguous inputs makes them so itself.

    Retention classes (see ``CacheGroupSpec``): each class (a sliding window ``W``, or
    None for the full history) has its own block pool, so its own ``block_tables`` and
    ``slot_mapping``; everything else is shared. ``window`` names the class this view's
    tables belong to and ``for_window(w)`` gives class ``w``'s view; a layer hands its
    backend the view of its ``sliding_window``. In a sliding class, entries for blocks
    wholly before a sequence's window point at the class's null block (zeros): a
    backend may read them under its mask, but they hold no keys.
    """

    query_start_loc: torch.Tensor  # int32 [batch + 1], on the device
    seq_lens: torch.Tensor  # int32 [batch], on the device
    block_tables: torch.Tensor  # int32 [batch, max_blocks], on the device
    slot_mapping: torch.Tensor  # int64 [num_tokens], on the device
    query_start_loc_host: tuple[int, ...]
    seq_lens_host: tuple[int, ...]
    #: The first ``num_decodes`` sequences have exactly one new token.
    num_decodes: int
    max_query_len: int
    max_seq_len: int
    block_size: int
    #: The retention class of ``block_tables``/``slot_mapping`` (None: full history).
    window: int | None = None
    #: Every retention class's ``(block_tables, slot_mapping)``; empty or one entry when
    #: all layers share one class.
    window_tables: Mapping[int | None, tuple[torch.Tensor, torch.Tensor]] = attrs.field(factory=dict)
    #: Sparse indices refused on the device, raised once the step has run (``raise_refused``).
    refused: RefusedIndices = attrs.field(factory=RefusedIndices, eq=False, repr=False)
    _views: dict[int | None, AttentionMetadata] = attrs.field(factory=dict, init=False, eq=False, repr=False)

    def for_window(self, window: int | None) -> AttentionMetadata:
        """This step seen through retention class ``window``'s block tables."""
        if window == self.window or len(self.window_tables) <= 1:
            return self
        view = self._views.get(window)
        if view is None:
            if window not in self.window_tables:
                raise ValueError(
                    f"no block tables for retention class window={window!r}; this step has "
                    f"{sorted(self.window_tables, key=str)}: the engine allocates a class per distinct "
                    "sliding_window its layers and cache groups declare"
                )
            tables, slots = self.window_tables[window]
            view = attrs.evolve(self, block_tables=tables, slot_mapping=slots, window=window)
            self._views[window] = view
        return view

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_host)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_host[-1]

    @functools.cached_property  # read by every layer of a step
    def query_lens_host(self) -> tuple[int, ...]:
        q = self.query_start_loc_host
        return tuple(q[i + 1] - q[i] for i in range(len(q) - 1))

    @functools.cached_property  # read by every sparse-attention layer of a step
    def token_sequences(self) -> torch.Tensor:
        """int32 ``[num_tokens]``: the sequence each of the step's new tokens belongs to, on
        ``seq_lens``' device (built from the host lengths, so no device sync)."""
        device = self.seq_lens.device
        return torch.repeat_interleave(
            torch.arange(self.batch_size, dtype=torch.int32, device=device),
            torch.tensor(self.query_lens_host, device=device),
            output_size=self.num_tokens,
        )

    @property
    def context_lens_host(self) -> tuple[int, ...]:
        """Tokens already cached before this step, per sequence."""
        return tuple(s - q for s, q in zip(self.seq_lens_host, self.query_lens_host, strict=True))

    def store(self, cache: torch.Tensor, new: torch.Tensor) -> None:
        """Write this step's per-token ``new`` values into a block-token-major cache tensor
        at ``slot_mapping`` (padding rows, slot -1, are skipped): the cache write every
        plain-torch backend does; fused kernels do it themselves."""
        if cache.shape[1] != self.block_size:
            raise ValueError(
                f"cache blocks hold {cache.shape[1]} tokens but the metadata says block_size={self.block_size}; "
                "allocate the cache from the backend's kv_cache_spec with the engine's block size"
            )
        rows = cache.view(-1, *cache.shape[2:])  # [num_blocks * block_size, *per_token]: a slot is a row
        # Padding (slot -1) only ever follows the batch's num_tokens real rows: copying
        # those by index needs no boolean mask, which would cost a device sync.
        real = self.num_tokens
        rows.index_copy_(0, self.slot_mapping[:real], new[:real].to(cache.dtype))

    def check_sparse_indices(self, indices: torch.Tensor, tokens_per_entry: int = 1) -> None:
        """Refuse sparse-attention ``indices`` that do not fit this batch (see
        ``SparseMLAAttentionBackend``): the wrong shape or dtype, or a position
        ``>= seq_len`` of its query's sequence or ``< -1``, with a ValueError naming
        the query row, the index and the length. With ``tokens_per_entry`` ``m`` the
        indices are compressed entries (``V4AttentionBackend``), and a sequence of
        ``seq_len`` tokens holds ``seq_len // m`` of them.

        The range check reads one flag back to the host, a device sync per call; a
        backend that must not sync (a captured decode step) refuses on the device instead
        (``refuse_sparse_indices``).
        """
        real, lengths, bad = self._sparse_range(indices, tokens_per_entry)
        if bool(bad.any()):  # the one device sync
            row, column = (int(x) for x in bad.nonzero()[0].tolist())
            raise ValueError(_refusal(int(real[row, column]), row, column, int(lengths[row, 0]), tokens_per_entry))

    def refuse_sparse_indices(self, indices: torch.Tensor, tokens_per_entry: int = 1) -> torch.Tensor:
        """``check_sparse_indices`` without a device sync: ``indices`` with every refused
        index read as -1 (padding), so a kernel never reads outside its sequence, and the
        first refusal recorded on the device; the runner raises the same ValueError once
        the step has run (``raise_refused``), so the step fails and its outputs are
        never used. Shapes and dtype are still checked on the host."""
        real, lengths, bad = self._sparse_range(indices, tokens_per_entry)
        if real.numel() == 0:
            return indices
        flat = bad.flatten()
        first = torch.argmax(flat.to(torch.int32))  # 0 where none is refused: the flag says so
        row, column = first // real.shape[1], first % real.shape[1]
        found = torch.stack(
            [
                flat.any().to(torch.int64),
                row,
                column,
                real.flatten()[first].to(torch.int64),
                lengths.flatten()[row].to(torch.int64),
                torch.full_like(row, tokens_per_entry),
            ]
        )
        record = self.refused.record
        if record is None or record.device != found.device:
            self.refused.record = record = torch.zeros(6, dtype=torch.int64, device=found.device)
        record.copy_(torch.where(record[0].bool(), record, found))  # the step's first refusal stays
        cleaned = indices.clone()
        cleaned[: self.num_tokens] = real.masked_fill(bad, -1)
        return cleaned

    def raise_refused(self) -> None:
        """Raise the ValueError ``check_sparse_indices`` would have for the first index a
        backend refused on the device this step (a device sync; nothing if none did)."""
        record = self.refused.record
        if record is None:
            return
        refused, row, column, index, seq_len, tokens_per_entry = record.tolist()
        if refused:
            raise ValueError(_refusal(index, row, column, seq_len, tokens_per_entry))

    def _sparse_range(
        self, indices: torch.Tensor, tokens_per_entry: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The real rows of ``indices``, their sequences' lengths ``[n, 1]`` and the mask of
        out-of-range indices, after the host-side checks of shape and dtype."""
        if indices.dim() != 2 or indices.shape[0] < self.num_tokens:
            raise ValueError(
                f"sparse indices must be [num_tokens, topk] with num_tokens >= {self.num_tokens}, "
                f"got shape {tuple(indices.shape)}"
            )
        if indices.dtype != torch.int32:
            raise ValueError(f"sparse indices must be int32 token positions, got {indices.dtype}")
        real = indices[: self.num_tokens]
        lengths = self.seq_lens[self.token_sequences].to(device=real.device, dtype=torch.int32)[:, None]
        return real, lengths, (real >= lengths // tokens_per_entry) | (real < -1)

    @classmethod
    def build(
        cls,
        *,
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]] | Mapping[int | None, Sequence[Sequence[int]]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Derive the whole contract from per-sequence lengths and block lists.

        ``block_tables``: one block list per sequence, or per retention class (window ->
        lists; the first class is the view returned). The model runner builds it this
        way, and so do tests and the conformance kit, so every producer agrees on
        offsets, slots and padding.
        """
        by_window = dict(block_tables) if isinstance(block_tables, Mapping) else {None: block_tables}
        if not by_window:
            raise ValueError("block_tables: no retention class given")
        for tables in by_window.values():
            if not (len(query_lens) == len(seq_lens) == len(tables)):
                raise ValueError("query_lens, seq_lens and block_tables must have one entry per sequence")
        starts = [0]
        for q, s in zip(query_lens, seq_lens, strict=True):
            if q < 1 or s < q:
                raise ValueError(f"sequence with query_len={q}, seq_len={s}: need 1 <= query_len <= seq_len")
            starts.append(starts[-1] + q)
        num_decodes = 0
        for q in query_lens:
            if q != 1:
                break
            num_decodes += 1
        if any(q == 1 for q in query_lens[num_decodes:]) and any(q > 1 for q in query_lens[:num_decodes]):
            raise ValueError("decode sequences must come before prefill sequences")
        window_tables = {
            window: _paging(query_lens, seq_lens, tables, block_size, device) for window, tables in by_window.items()
        }
        window = next(iter(window_tables))
        tables, slots = window_tables[window]
        return cls(
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(list(seq_lens), dtype=torch.int32, device=device),
            block_tables=tables,
            slot_mapping=slots,
            query_start_loc_host=tuple(starts),
            seq_lens_host=tuple(int(s) for s in seq_lens),
            num_decodes=num_decodes,
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
            block_size=block_size,
            window=window,
            window_tables=window_tables if len(window_tables) > 1 else {},
        )


def _refusal(index: int, row: int, column: int, seq_len: int, tokens_per_entry: int) -> str:
    """What a refused sparse index is told (``check_sparse_indices``)."""
    if tokens_per_entry == 1:
        bound, what = "positions must be 0 <= p < seq_len", "cached tokens"
    else:
        bound = f"entries must be 0 <= e < seq_len // {tokens_per_entry} = {seq_len // tokens_per_entry}"
        what = "closed compressed entries"
    return (
        f"sparse index {index} at query row {row} (column {column}) is out of range for its sequence of "
        f"seq_len={seq_len}: {bound}, or -1 for padding; the indexer must pick only this sequence's {what}"
    )


def _paging(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    device: torch.device | str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One retention class's padded block table and the slots of the step's new tokens."""
    slots: list[int] = []
    for q, s, blocks in zip(query_lens, seq_lens, block_tables, strict=True):
        if len(blocks) * block_size < s:
            raise ValueError(f"sequence of {s} tokens needs {math.ceil(s / block_size)} blocks, got {len(blocks)}")
        for pos in range(s - q, s):
            slots.append(blocks[pos // block_size] * block_size + pos % block_size)
    width = max(1, max((len(b) for b in block_tables), default=0))
    # One tensor from padded rows: a tensor per row and a slice write cost microseconds each.
    rows = [[*blocks, *(0,) * (width - len(blocks))] for blocks in block_tables] or [[]]
    table = torch.tensor(rows, dtype=torch.int32).reshape(len(block_tables), width)
    return table.to(device), torch.tensor(slots, dtype=torch.int64, device=device)


@attrs.frozen(kw_only=True)
class AttentionBackendContext:
    """What an attention backend factory is given."""

    platform: PlatformInfo
    device: torch.device
    dtype: torch.dtype
    block_size: int


@runtime_checkable
class AttentionBackend(Protocol):
    """GQA/MHA attention over the paged cache (and MLA if it declares ``mla``)."""

    name: str

    def kv_cache_spec(self, layer: AttentionLayerSpec, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        """The cache this backend needs for ``layer``; the engine allocates exactly that."""
        ...

    def forward(
        self,
        layer: AttentionLayerSpec,
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size] (this step's new tokens)
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        kv_cache: LayerKVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Write new keys/values at ``slot_mapping``, then attend causally (or, for a layer
        with ``causal`` False, over every key of the sequence).

        Returns ``[num_tokens, num_heads, head_size]``.
        """
        ...


@runtime_checkable
class RotaryAttentionBackend(Protocol):
    """A GQA/MHA backend that rotates query and key itself, fused with its cache write
    (capability ``fused-rotary``): one pass reads the new keys, rotates them and writes
    them to their slots, instead of a rotation pass and then a store.

    ``cos``/``sin`` are ``[num_tokens, rotary_dim // 2]`` in the query dtype; the rotation
    is ``layers.rotary.apply_rotary`` (per half, dims past ``2 * (rotary_dim // 2)``
    pass through). The result equals ``forward`` on the rotated query and key.
    """

    def forward_rotary(
        self,
        layer: AttentionLayerSpec,
        query: torch.Tensor,  # [num_tokens, num_heads, head_size], not yet rotated
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size], not yet rotated
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: LayerKVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_size]
        ...


@runtime_checkable
class KVStoreAttentionBackend(Protocol):
    """A GQA/MHA backend that writes a step's keys and values without attending (capability
    ``kv-store``): afterwards the cache holds exactly what ``forward`` would have written
    (``key`` already rotated), and no query is computed. For rows whose attention output
    nobody reads: a block drafter's context entries (``BlockDraftModel.write_context``),
    where attending would be most of the write's cost."""

    def store_kv(
        self,
        layer: AttentionLayerSpec,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        kv_cache: LayerKVCache,
        metadata: AttentionMetadata,
    ) -> None: ...


@runtime_checkable
class RMSNormKernel(Protocol):
    """RMSNorm as a kernel pack computes it (capability ``fused-rmsnorm``); the engine
    hands it to every ``layers.norm.RMSNorm`` of the model while the pack's attention
    backend is the one in use.

    ``rms_norm(x, weight, eps)`` equals ``layers.norm.RMSNorm`` (statistics in float32,
    cast back, then scaled by the weight); with ``residual`` it first adds it, in the
    activation dtype, and returns ``(normed, x + residual)``.
    """

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...


@attrs.frozen(kw_only=True)
class DecoderLayerParts:
    """One pre-norm decoder layer of the Llama shape, for a kernel pack that runs a whole
    stack of them at once (``DecoderStackKernel``)::

        h = x + o(attention(rotary(qkv(norm_in(x)))))
        out = h + down(silu(gate) * up), with (gate, up) = gate_up(norm_post(h))

    The projections are the model's own modules (``layers.linear.Linear``: a pack reads
    how each multiplies, dense, packed or kept quantised, and takes only what it knows);
    ``qkv`` stacks q, k and v rows, ``gate_up`` gate then up rows.
    """

    input_norm: torch.Tensor  # [hidden]
    post_attention_norm: torch.Tensor  # [hidden]
    eps: float
    qkv: Any
    o: Any
    gate_up: Any
    down: Any
    attention: AttentionLayerSpec


@runtime_checkable
class FusedDecoder(Protocol):
    """A decoder stack a pack fused. ``hidden`` ``[tokens, hidden]`` is the first layer's
    input, ``cos``/``sin`` the step's rotary angles, ``kv_caches`` one per layer. Returns
    ``(out, residual)``, the last layer's MLP output and the residual stream not yet added
    to it, as the layers one by one would; or None for a step it does not run (the model
    then runs its layers itself). Outputs equal the layers' to float32 rounding.

    ``layers`` (consecutive, ascending): run only those, ``hidden`` then being the first one's
    input (the layer before it's output and residual added); None: all. A model whose drafter
    reads layer outputs runs the stack in segments ending at those layers."""

    def __call__(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_caches: Sequence[LayerKVCache],
        metadata: AttentionMetadata,
        layers: range | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor] | None: ...


@runtime_checkable
class DecoderStackKernel(Protocol):
    """An attention pack that runs whole decoder stacks (capability ``fused-decoder``):
    where a step's Python glue costs as much as its kernels (batch-1 decode on a CPU), one
    call per step instead of about forty per layer. ``fuse_decoder`` returns the fused stack
    or, where it cannot take these layers, a one-line reason (logged); the model keeps its
    layers either way."""

    def fuse_decoder(self, layers: Sequence[DecoderLayerParts]) -> FusedDecoder | str: ...


@runtime_checkable
class MLAAttentionBackend(Protocol):
    """Multi-head latent attention in the weight-absorbed form over a latent cache.

    The model projects queries into the latent space (``q_latent``) and keeps the rope
    part apart (``q_rope``), as ``npu_fused_infer_attention_score``'s query/query_rope
    and key/key_rope split expects; the backend returns latent outputs, which the model
    up-projects. Scores are ``scale * (q_latent·latent + q_rope·k_rope)``.
    """

    name: str

    def kv_cache_spec(self, layer: AttentionLayerSpec, block_size: int, dtype: torch.dtype) -> KVCacheSpec: ...

    def forward_mla(
        self,
        layer: AttentionLayerSpec,
        q_latent: torch.Tensor,  # [num_tokens, num_heads, kv_lora_rank]
        q_rope: torch.Tensor,  # [num_tokens, num_heads, qk_rope_head_dim]
        latent: torch.Tensor,  # [num_tokens, kv_lora_rank] (new tokens, normalised)
        k_rope: torch.Tensor,  # [num_tokens, qk_rope_head_dim] (new tokens, rotated)
        kv_cache: LayerKVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads, kv_lora_rank]
        ...


@runtime_checkable
class SparseMLAAttentionBackend(Protocol):
    """Sparse MLA (capability ``sparse-mla``): DeepSeek-V3.2's DSA, where a lightning
    indexer picks per query token the top-k cached tokens it attends to.

    ``forward_mla_sparse`` takes what ``forward_mla`` takes and writes the new tokens'
    latent/rope at ``slot_mapping`` first, as it does; then query token ``t`` attends
    only to the tokens of its own sequence at the positions ``indices[t]`` lists:
    scores ``scale * (q_latent·latent + q_rope·k_rope)``, softmax over the listed
    positions, output ``probs·latent``.

    * ``indices`` is int32 ``[num_tokens, topk]`` (rows past ``num_tokens`` are padding
      like the batch's own). Entries are logical token positions within the sequence,
      ``0 <= p < seq_len``, mapped through ``block_tables`` by the backend, so the
      indexer need not know the paging. ``-1`` is padding and is ignored, wherever it
      sits in the row; positions in a row are distinct (not checked: a repeated one would
      weigh twice).
    * The listed positions are exactly what is attended: the backend applies no causal
      mask of its own (the indexer already chose visible tokens).
    * A row that is all ``-1`` attends to nothing and outputs zeros.
    * A position ``>= seq_len`` or ``< -1`` is refused with a ValueError naming the
      query row, the index and the length: before any output, on the host
      (``AttentionMetadata.check_sparse_indices``, one device sync per call; the
      reference raises it before writing the cache, so a refused step leaves the cache
      as it was), or, in a backend that must not sync (a captured decode step), on the
      device (``AttentionMetadata.refuse_sparse_indices``: refused indices are read as
      padding, and the runner raises the same error once the step has run, its outputs
      unused; only the step's own slots may have been written).
    """

    name: str

    def kv_cache_spec(self, layer: AttentionLayerSpec, block_size: int, dtype: torch.dtype) -> KVCacheSpec: ...

    def forward_mla_sparse(
        self,
        layer: AttentionLayerSpec,
        q_latent: torch.Tensor,  # [num_tokens, num_heads, kv_lora_rank]
        q_rope: torch.Tensor,  # [num_tokens, num_heads, qk_rope_head_dim]
        latent: torch.Tensor,  # [num_tokens, kv_lora_rank] (new tokens, normalised)
        k_rope: torch.Tensor,  # [num_tokens, qk_rope_head_dim] (new tokens, rotated)
        kv_cache: LayerKVCache,
        metadata: AttentionMetadata,
        indices: torch.Tensor,  # int32 [num_tokens, topk]: positions in the sequence, -1 = padding
    ) -> torch.Tensor:  # [num_tokens, num_heads, kv_lora_rank]
        ...


@runtime_checkable
class V4AttentionBackend(Protocol):
    """DeepSeek-V4 attention (capability ``v4-attention``): shared-KV multi-query attention
    over a sliding window of raw keys plus compressed entries, with one sink logit per head.

    The layer has already stored this step's keys and entries (its cache groups are its
    own: ``kv`` in the sliding class ``window``, ``compressed`` in the full-history class,
    ``block_size // compress_rate`` entries per block), so ``forward_v4`` only reads.
    Query token ``t`` of a sequence sits at position ``p`` (its context length plus its
    offset among the step's new tokens) and attends to:

    * the raw keys at positions ``max(0, p - window + 1) .. p`` (``kv``, through
      ``metadata.for_window(window)``);
    * with ``compress_rate`` ``m`` and no ``entry_indices`` (HCA): every entry whose
      window closed by ``p``, ``e < (p + 1) // m`` (``compressed``, through
      ``metadata.for_window(None)``);
    * with ``entry_indices`` (CSA): the entries its row lists, int32
      ``[num_tokens, k]``, ``-1`` padding anywhere in the row, attended as listed (the
      indexer chose visible ones). An entry ``>= seq_len // m`` or below -1 is refused
      with a ValueError naming the row, the entry and the length, on the host before
      any output (``AttentionMetadata.check_sparse_indices(indices, m)``) or on the
      device as for sparse MLA (``refuse_sparse_indices(indices, m)``).

    Each key is also its value (one shared head of ``head_size``). Scores are
    ``scale * q·k``; the softmax runs over the attended keys and ``sinks[h]``, whose
    share is dropped, so a row's weights may sum to less than one. The output
    ``[num_tokens, heads, head_size]`` is in the query's dtype (rows past ``num_tokens``
    unspecified).

    With ``derotate=(cos, sin)`` (each ``[num_tokens, pairs]`` in the query's dtype: the
    rotary table at each query token's position) the output comes back de-rotated, as V4's
    layer needs it: its trailing ``2 * pairs`` dims, as adjacent pairs, rotated by ``-sin``
    (``rotate_trailing(out, cos, -sin)``). The rotation is linear, so a kernel applies it
    to its unnormalised accumulator before the store (FlashMLA's fused "o-RoPE") instead
    of another pass over the output.
    """

    name: str

    def forward_v4(
        self,
        layer: AttentionLayerSpec,  # kind "custom": num_heads, head_size, scale
        query: torch.Tensor,  # [num_tokens, num_heads, head_size], rotated
        kv_cache: LayerKVCache,
        metadata: AttentionMetadata,
        sinks: torch.Tensor,  # float32 [num_heads]
        *,
        window: int,
        compress_rate: int | None = None,
        entry_indices: torch.Tensor | None = None,  # int32 [num_tokens, k]: entries, -1 = padding
        derotate: tuple[torch.Tensor, torch.Tensor] | None = None,  # cos, sin [num_tokens, pairs]
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_size]
        ...


#: Most bytes of float32 scores an ``index_topk`` pass should hold: a long prefill chunk at
#: long context (8k queries x 128k keys is 4 GiB) is scored and cut to its top-k a slice of
#: rows at a time, ``score_rows(columns)`` rows a slice.
SCORE_BYTES = 256 * 2**20


def score_rows(columns: int) -> int:
    """How many query rows of ``columns`` float32 scores fit in ``SCORE_BYTES`` (at least one)."""
    return max(1, SCORE_BYTES // (4 * max(columns, 1)))


@runtime_checkable
class LightningIndexerBackend(Protocol):
    """The Lightning Indexer's scoring and top-k (capability ``lightning-indexer``):
    which cached tokens (V3.2's DSA) or compressed entries (V4's CSA) each query attends.

    The layer has projected and rotated the index queries, computed the head weights
    (every scale folded in) and stored this step's keys in its own cache group,
    ``keys`` ``[num_blocks, block_size // tokens_per_entry, head_dim]`` read through
    ``metadata``'s tables (the full-history view). Query token ``t`` at position ``p``
    of its sequence scores key ``s`` of that sequence

        I[t, s] = sum_h weights[t, h] * ReLU(query[t, h] . keys[s])

    in float32, over the keys visible to it, ``s < (p + 1) // tokens_per_entry`` (for
    V3.2's per-token keys, ``s <= p``), and returns int32 ``[num_tokens, width]``: its
    ``min(topk, visible)`` best keys, best first, ``-1`` in the columns left. ``width``
    is ``min(topk, max_seq_len // tokens_per_entry)``, at least 1. Ties between equal
    scores may come in any order. Score a long batch in slices of ``score_rows`` rows.
    """

    name: str

    def index_topk(
        self,
        query: torch.Tensor,  # [num_tokens, n_heads, head_dim], rotated
        weights: torch.Tensor,  # float32 [num_tokens, n_heads]
        keys: torch.Tensor,  # [num_blocks, block_size // tokens_per_entry, head_dim]
        metadata: AttentionMetadata,
        *,
        topk: int,
        tokens_per_entry: int = 1,
    ) -> torch.Tensor:  # int32 [num_tokens, width]
        ...

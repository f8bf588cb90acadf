"""Copies between the device cache and the tiers' payloads, on the device thread.

A block's payload is one retention class's slice of the cache: block ``b`` of every
tensor of that class, layer by layer (an MTP drafter's layers after the target's, since
they are filled through the same block tables), as raw bytes one after the other. Every
cache tensor is block-major (``[num_blocks, ...]``, contiguous), so block ``b`` of each
is one contiguous run of bytes.

On an accelerator the copies out go to pinned host memory without waiting; the tiers'
writer waits for them (``ready``) before it reads the payloads, and a load's copy in is
queued on the same stream as the step that reads the block.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future

import torch

from powertrain.engine.block_manager import BlockTransfers, Publication, Window
from powertrain.engine.kv_tiers import KVTiers
from powertrain.interfaces import AttentionLayerSpec, LayerKVCache


class BlockMover:
    def __init__(
        self,
        layers: Iterable[tuple[AttentionLayerSpec, LayerKVCache]],
        tiers: KVTiers,
        device: torch.device,
        pinned: bool = False,
    ) -> None:
        """``pinned``: copy through pinned host memory without waiting (``PlatformInfo.
        pinned_host_copies``)."""
        self.tiers = tiers
        self.device = device
        self.tensors: dict[Window, list[torch.Tensor]] = {}
        for layer, cache in layers:
            for name in sorted(cache):
                if layer.reads_shared(name):
                    continue  # another layer's group: moved with that layer's cache
                tensor = cache[name]
                if not tensor.is_contiguous():
                    raise ValueError(f"cache tensor {name!r} is not contiguous: its blocks cannot be copied as bytes")
                self.tensors.setdefault(layer.window_of(name), []).append(tensor)
        #: Payload bytes of a block of each retention class.
        self.block_bytes: Mapping[Window, int] = {
            w: sum(t[0].numel() * t.element_size() for t in tensors) for w, tensors in self.tensors.items()
        }
        self._pin = pinned

    def run(self, transfers: BlockTransfers) -> None:
        """Copy the evicted blocks out (handing them to the tiers), then load the hits in."""
        if transfers.offloads:
            blocks = [(key, self._copy_out(w, block_id)) for w, block_id, key in transfers.offloads]
            self.tiers.offer(blocks, self._ready())
        for w, block_id, payload in transfers.loads:
            self._copy_in(w, block_id, payload)

    def publish(self, publication: Publication, published: Future[int]) -> None:
        """Copy a prompt's cached blocks out to the shared tiers; ``published`` says when
        they (and those it lists as elsewhere) are there."""
        blocks = [(key, self._copy_out(w, block_id)) for w, block_id, key in publication.offloads]
        self.tiers.publish(blocks, self._ready(), published, elsewhere=publication.elsewhere)

    def _copy_out(self, window: Window, block_id: int) -> torch.Tensor:
        payload = torch.empty(self.block_bytes[window], dtype=torch.uint8, pin_memory=self._pin)
        offset = 0
        for tensor in self.tensors[window]:
            part = tensor[block_id].reshape(-1).view(torch.uint8)
            payload[offset : offset + part.numel()].copy_(part, non_blocking=self._pin)
            offset += part.numel()
        return payload

    def _copy_in(self, window: Window, block_id: int, payload: torch.Tensor) -> None:
        offset = 0
        for tensor in self.tensors[window]:
            part = tensor[block_id].reshape(-1).view(torch.uint8)
            part.copy_(payload[offset : offset + part.numel()], non_blocking=self._pin)
            offset += part.numel()

    def _ready(self) -> Callable[[], None] | None:
        """What the tiers' writer calls before reading payloads copied out just now."""
        if not self._pin:
            return None  # a synchronous copy is done when it returns
        event = torch.Event(device=self.device)
        event.record()
        return event.synchronize

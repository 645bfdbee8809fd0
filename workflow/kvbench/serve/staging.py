"""Blocks between vLLM's paged cache and host memory: the only device-specific part of the
connector. On CPU a copy; on CUDA a gather on the device, then one asynchronous copy into pinned
host memory (loads: the reverse), ordered on the current stream, so the forward pass of the same
stream never sees a half-written block and encoding happens on the host."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch


@dataclass
class HostCopy:
    """Chunks [layers, kv_heads, block_size, 2 * head_size] on the host, one per block; `event`
    (CUDA) marks the end of the device-to-host copy: `wait()` before reading them."""

    chunks: list[torch.Tensor]
    event: Any = None

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()

    def nbytes(self) -> int:
        return sum(c.numel() * c.element_size() for c in self.chunks)


def block_index(block_ids: Sequence[int], device: torch.device) -> torch.Tensor:
    """The block ids as an index on `device`. On CUDA through pinned memory, without blocking: a
    copy from pageable memory would wait for every kernel already queued on the stream (the
    forward pass), which is what the asynchronous copies around it avoid."""
    index = torch.as_tensor(list(block_ids), dtype=torch.long)
    if device.type != "cuda":
        return index
    return index.pin_memory().to(device, non_blocking=True)


def copy_out(layers: Sequence[torch.Tensor], block_ids: Sequence[int]) -> HostCopy:
    """The blocks' chunks copied out of every layer. Returns before a CUDA copy completes; the
    source blocks may be reused right away (later kernels on the stream run after the copy)."""
    if not block_ids:
        return HostCopy([])
    device = layers[0].device
    index = block_index(block_ids, device)
    stacked = torch.stack([cache.index_select(0, index) for cache in layers], dim=1)  # [n, layers, ...]
    if device.type != "cuda":
        return HostCopy(list(stacked.unbind(0)))
    host = torch.empty(stacked.shape, dtype=stacked.dtype, pin_memory=True)
    host.copy_(stacked, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return HostCopy(list(host.unbind(0)), event)


def copy_in(chunks: Sequence[torch.Tensor], layers: Sequence[torch.Tensor], block_ids: Sequence[int]) -> None:
    """Host chunks into the first len(chunks) of `block_ids` in every layer (CUDA: one pinned
    host-to-device copy, queued on the current stream before the forward pass that reads it)."""
    if not chunks:
        return
    check_fits(chunks, layers, block_ids)
    device = layers[0].device
    if device.type != "cuda":  # straight from each chunk into its block: no staging copy
        for chunk, block in zip(chunks, block_ids):
            for layer, cache in enumerate(layers):
                cache[block].copy_(chunk[layer])
        return
    staged = torch.stack(list(chunks)).pin_memory().to(device, non_blocking=True)  # [n, layers, ...]
    index = block_index(list(block_ids)[: len(chunks)], device)
    for layer, cache in enumerate(layers):
        cache.index_copy_(0, index, staged[:, layer])


def check_fits(chunks: Sequence[torch.Tensor], layers: Sequence[torch.Tensor], block_ids: Sequence[int]) -> None:
    """ValueError unless every chunk is one block of every layer, of the cache's shape and dtype,
    and has a block of the cache to go to: a plain copy would cast, broadcast, wrap a negative id
    or leave a chunk out without a word."""
    blocks = list(block_ids)
    if len(chunks) > len(blocks):
        raise ValueError(f"{len(chunks)} chunks for {len(blocks)} block ids")
    shape, dtype, count = (len(layers), *layers[0].shape[1:]), layers[0].dtype, layers[0].shape[0]
    for chunk in chunks:
        if tuple(chunk.shape) != shape or chunk.dtype != dtype:
            raise ValueError(f"a chunk of {tuple(chunk.shape)} {chunk.dtype} for a cache of {shape} {dtype}")
    if bad := [int(b) for b in blocks[: len(chunks)] if not 0 <= int(b) < count]:
        raise ValueError(f"block ids {bad} outside the cache's {count} blocks")

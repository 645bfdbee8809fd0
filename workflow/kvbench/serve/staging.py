"""Blocks between vLLM's paged cache and host memory: the only device-specific part of the
connector. On CPU a copy; on CUDA a gather on the device, then one asynchronous copy into pinned
host memory (loads: the reverse), ordered on the current stream, so the forward pass of the same
stream never sees a half-written block and encoding happens on the host.

The pinned buffers come from a PinnedPool, allocated once and reused: a pinned allocation that
misses torch's caching host allocator (every new size: requests differ in chunk count) calls
cudaHostAlloc, which waits for the device, so a fresh buffer per copy made the copies wait for the
forward pass they were meant to overlap (the likely cause of the H200 finding in docs/cluster.md)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

MIB = 2**20
POOL_KEEP_BYTES = 4 * 2**30  # pinned bytes a pool keeps for reuse; beyond, buffers are freed on release


class PinnedPool:
    """Reusable host buffers (pinned with `pin`), sized in powers of two from 1 MiB. `take` hands
    out the smallest free buffer that fits and whose last device copy has finished (its event;
    never waited for: a busy buffer is skipped), else allocates one; `give` takes it back with the
    event of the copy still reading or writing it. Thread-safe: the store threads give back what
    the worker took. Counts: allocations (new buffers) and reuses."""

    def __init__(self, pin: bool = True, keep_bytes: int = POOL_KEEP_BYTES) -> None:
        self.pin, self.keep_bytes = pin, keep_bytes
        self._free: list[tuple[torch.Tensor, Any]] = []
        self._owned = 0  # bytes of every buffer the pool keeps (free or out)
        self._lock = threading.Lock()
        self.allocations = self.reuses = 0

    def take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            ready = [
                i
                for i, (buf, event) in enumerate(self._free)
                if buf.numel() >= nbytes and (event is None or event.query())
            ]
            if ready:
                best = min(ready, key=lambda i: self._free[i][0].numel())
                self.reuses += 1
                return self._free.pop(best)[0]
            size = max(MIB, 1 << max(0, nbytes - 1).bit_length())
            self.allocations += 1
            self._owned += size
        return torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)

    def give(self, buffer: torch.Tensor, event: Any = None) -> None:
        with self._lock:
            if self._owned > self.keep_bytes:  # over its budget: this one goes back to the allocator
                self._owned -= buffer.numel()
                return
            self._free.append((buffer, event))

    def view(self, buffer: torch.Tensor, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """The buffer's first bytes as a contiguous tensor of `shape` and `dtype`."""
        count = 1
        for dim in shape:
            count *= int(dim)
        return buffer[: count * torch.empty((), dtype=dtype).element_size()].view(dtype).view(*shape)


@dataclass
class HostCopy:
    """Chunks [layers, kv_heads, block_size, 2 * head_size] on the host, one per block; `event`
    (CUDA) marks the end of the device-to-host copy: `wait()` before reading them. A pooled copy
    is held by its creator and by each `acquire()`; the last `release()` hands its buffer back
    (the chunks must not be read after)."""

    chunks: list[torch.Tensor]
    event: Any = None
    release_to: Callable[[], None] | None = None  # hands the pinned buffer back to its pool
    _holds: int = 1
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()

    def acquire(self) -> None:
        with self._lock:
            self._holds += 1

    def release(self) -> None:
        with self._lock:
            self._holds -= 1
            if self._holds or self.release_to is None:
                return
            release, self.release_to, self.chunks = self.release_to, None, []
        release()

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


def copy_out(layers: Sequence[torch.Tensor], block_ids: Sequence[int], pool: PinnedPool | None = None) -> HostCopy:
    """The blocks' chunks copied out of every layer. Returns before a CUDA copy completes; the
    source blocks may be reused right away (later kernels on the stream run after the copy). With
    a pool, the host buffer is the pool's until the copy's `release()`."""
    if not block_ids:
        return HostCopy([])
    device = layers[0].device
    index = block_index(block_ids, device)
    stacked = torch.stack([cache.index_select(0, index) for cache in layers], dim=1)  # [n, layers, ...]
    if device.type != "cuda":
        return HostCopy(list(stacked.unbind(0)))
    release = None
    if pool is None:
        host = torch.empty(stacked.shape, dtype=stacked.dtype, pin_memory=True)
    else:
        buffer = pool.take(stacked.numel() * stacked.element_size())
        host = pool.view(buffer, stacked.shape, stacked.dtype)
        release = lambda: pool.give(buffer)  # noqa: E731 -- the copy has run: its chunks were read
    host.copy_(stacked, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return HostCopy(list(host.unbind(0)), event, release)


def copy_in(
    chunks: Sequence[torch.Tensor],
    layers: Sequence[torch.Tensor],
    block_ids: Sequence[int],
    pool: PinnedPool | None = None,
) -> None:
    """Host chunks into the first len(chunks) of `block_ids` in every layer (CUDA: one pinned
    host-to-device copy, queued on the current stream before the forward pass that reads it; with
    a pool, through a reused buffer the pool hands out again once that copy has run)."""
    if not chunks:
        return
    check_fits(chunks, layers, block_ids)
    device = layers[0].device
    if device.type != "cuda":  # straight from each chunk into its block: no staging copy
        for chunk, block in zip(chunks, block_ids):
            for layer, cache in enumerate(layers):
                cache[block].copy_(chunk[layer])
        return
    shape = (len(chunks), *chunks[0].shape)  # [n, layers, ...]
    if pool is None:
        host = torch.stack(list(chunks)).pin_memory()
    else:
        buffer = pool.take(len(chunks) * chunks[0].numel() * chunks[0].element_size())
        host = pool.view(buffer, shape, chunks[0].dtype)
        torch.stack(list(chunks), out=host)
    staged = host.to(device, non_blocking=True)
    if pool is not None:
        event = torch.cuda.Event()
        event.record()
        pool.give(buffer, event)
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

"""Moving chunks between vLLM's paged cache and the store: the worker half of the connector,
without vLLM (so the tests can run it against a real Valkey and a real cache tensor)."""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import torch
import valkey

from kvbench.serve.integrity import IntegrityError, seal, unseal
from kvbench.serve.staging import PinnedPool, copy_in, copy_out
from kvbench.serve.wire import ChunkSpec, WireFormat

STORE_ERRORS = (valkey.exceptions.ValkeyError, OSError)


def exists_run(store: valkey.Valkey, keys: Sequence[str]) -> int:
    """How many leading keys exist (one pipelined round trip). A key exists only once its SET is
    complete, so a chunk still queued for its store is a miss here, never a partial load."""
    pipe = store.pipeline(transaction=False)
    for key in keys:
        pipe.exists(key)
    found = pipe.execute()
    return next((i for i, hit in enumerate(found) if not hit), len(found))


def lookup(store: valkey.Valkey, keys: Sequence[str], pending_key: str) -> tuple[int, int]:
    """The leading run of stored keys, and the chunks the store's tally says are still queued for
    storing (async_store.py), in one round trip."""
    pipe = store.pipeline(transaction=False)
    for key in keys:
        pipe.exists(key)
    pipe.get(pending_key)
    *found, queued = pipe.execute()
    return next((i for i, hit in enumerate(found) if not hit), len(found)), max(0, int(queued or 0))


def load_chunks(
    store: valkey.Valkey,
    wire: WireFormat,
    spec: ChunkSpec,
    keys: Sequence[str],
    block_ids: Sequence[int],
    layers: Sequence[torch.Tensor],
    secret: bytes = b"",
    pool: PinnedPool | None = None,
) -> dict[str, Any]:
    """GET the chunks, check each (integrity.py), decode it and copy the good ones into their
    blocks of every layer, in order (on CUDA through `pool`'s pinned buffers). The first chunk that is gone, fails its check or does not
    decode ends the load: it and every later block are returned as `failed_blocks` (vLLM
    recomputes them under kv_load_failure_policy=recompute)."""
    stats: dict[str, Any] = {
        "chunks": len(keys),
        "loaded_chunks": 0,
        "wire_bytes": 0,
        "get_s": 0.0,
        "check_s": 0.0,
        "decode_s": 0.0,
        "copy_s": 0.0,
        "error": None,
        "integrity": None,
    }
    start = time.perf_counter()
    try:
        values = store.mget(list(keys))
    except STORE_ERRORS as err:
        values, stats["error"] = [], f"load: {type(err).__name__}: {err}"
    stats["get_s"] = time.perf_counter() - start
    decoded = []
    for key, data in zip(keys, values):
        if data is None:
            stats["error"] = f"load: chunk {len(decoded)} of {len(keys)} is gone"
            break
        t0 = time.perf_counter()
        try:
            payload = unseal(key, data, secret)
        except IntegrityError as err:  # a damaged or foreign chunk is a miss, never loaded
            stats["error"], stats["integrity"] = f"integrity: chunk {len(decoded)}: {err}", err.kind
            _drop(store, key)
            break
        t1 = time.perf_counter()
        try:
            chunk = wire.decode(payload)
        except Exception as err:  # a chunk that does not decode costs a recompute, not the server
            stats["error"] = f"decode: {type(err).__name__}: {err}"
            _drop(store, key)
            break
        stats["check_s"] += t1 - t0
        stats["decode_s"] += time.perf_counter() - t1
        stats["wire_bytes"] += len(data)  # what the store holds: header included
        decoded.append(chunk)
    t0 = time.perf_counter()
    try:
        copy_in(decoded, layers, block_ids, pool)
    except ValueError as err:  # chunks that do not fit the cache: nothing copied, vLLM recomputes
        stats["error"], decoded = f"copy: {err}", []
    stats["copy_s"] = time.perf_counter() - t0
    stats["loaded_chunks"] = len(decoded)
    stats["failed_blocks"] = list(block_ids[len(decoded) :])
    stats["raw_bytes"] = len(decoded) * spec.nbytes()
    return stats


def _drop(store: valkey.Valkey, key: str) -> None:
    """A chunk that failed its check or its decoding is deleted, so the request that recomputes
    its prefix stores it again; left in place it would cut every later lookup of that prefix."""
    try:
        store.delete(key)
    except STORE_ERRORS:
        pass  # the store is gone: nothing to clean


def gather(layers: Sequence[torch.Tensor], block_ids: Sequence[int]) -> list[torch.Tensor]:
    """Chunks [layers, kv_heads, block_size, 2 * head_size] copied out of the paged cache."""
    copy = copy_out(layers, block_ids)
    copy.wait()
    return copy.chunks


def store_chunks(
    store: valkey.Valkey,
    wire: WireFormat,
    spec: ChunkSpec,
    keys: Sequence[str],
    chunks: Sequence[torch.Tensor],
    secret: bytes = b"",
    pending_key: str | None = None,
    before_encode: Callable[[], float] | None = None,
) -> dict[str, Any]:
    """Encode, seal and SET the chunks in one pipelined round trip (and count them off
    `pending_key`, the store's tally of chunks queued for storing, in the same round trip).
    `before_encode` runs before each chunk's encoding and returns the seconds it waited (the
    background stores' yield to the forward pass, async_store.py), counted apart from encode_s."""
    t0 = time.perf_counter()
    encoded, yielded = [], 0.0
    for chunk in chunks:
        yielded += before_encode() if before_encode else 0.0
        encoded.append(wire.encode(chunk))
    t1 = time.perf_counter()
    sealed = [seal(key, data, secret) for key, data in zip(keys, encoded)]
    t2 = time.perf_counter()
    error = None
    try:
        pipe = store.pipeline(transaction=False)
        for key, data in zip(keys, sealed):
            pipe.set(key, data)
        if pending_key is not None:
            pipe.decrby(pending_key, len(keys))
        pipe.execute()
    except STORE_ERRORS as err:
        error = f"store: {type(err).__name__}: {err}"
    return {
        "chunks": len(chunks),
        "raw_bytes": len(chunks) * spec.nbytes(),
        "wire_bytes": sum(map(len, sealed)),
        "encode_s": t1 - t0 - yielded,
        "yield_s": yielded,
        "seal_s": t2 - t1,
        "set_s": time.perf_counter() - t2,
        "error": error,
    }

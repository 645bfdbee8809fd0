"""Moving chunks between vLLM's paged cache and the store: the worker half of the connector,
without vLLM (so the tests can run it against a real Valkey and a real cache tensor)."""

from __future__ import annotations

import time
from typing import Any, Sequence

import torch
import valkey

from kvbench.serve.wire import ChunkSpec, WireFormat

STORE_ERRORS = (valkey.exceptions.ValkeyError, OSError)


def exists_run(store: valkey.Valkey, keys: Sequence[str]) -> int:
    """How many leading keys exist (one pipelined round trip)."""
    pipe = store.pipeline(transaction=False)
    for key in keys:
        pipe.exists(key)
    found = pipe.execute()
    return next((i for i, hit in enumerate(found) if not hit), len(found))


def load_chunks(
    store: valkey.Valkey,
    wire: WireFormat,
    spec: ChunkSpec,
    keys: Sequence[str],
    block_ids: Sequence[int],
    layers: Sequence[torch.Tensor],
) -> dict[str, Any]:
    """GET the chunks, decode each and copy it into its block of every layer, in order. The first
    chunk that is gone, or does not decode, ends the load: it and every later block are returned as
    `failed_blocks` (vLLM recomputes them under kv_load_failure_policy=recompute)."""
    stats: dict[str, Any] = {
        "chunks": len(keys),
        "loaded_chunks": 0,
        "wire_bytes": 0,
        "get_s": 0.0,
        "decode_s": 0.0,
        "copy_s": 0.0,
        "error": None,
    }
    start = time.perf_counter()
    try:
        values = store.mget(list(keys))
    except STORE_ERRORS as err:
        values, stats["error"] = [], f"load: {type(err).__name__}: {err}"
    stats["get_s"] = time.perf_counter() - start
    for data, block in zip(values, block_ids):
        if data is None:
            stats["error"] = f"load: chunk {stats['loaded_chunks']} of {len(keys)} is gone"
            break
        t0 = time.perf_counter()
        try:
            chunk = wire.decode(data)
        except Exception as err:  # a corrupt chunk costs a recompute, not the server
            stats["error"] = f"decode: {type(err).__name__}: {err}"
            break
        t1 = time.perf_counter()
        for layer, cache in enumerate(layers):
            cache[block].copy_(chunk[layer])
        stats["copy_s"] += time.perf_counter() - t1
        stats["decode_s"] += t1 - t0
        stats["loaded_chunks"] += 1
        stats["wire_bytes"] += len(data)
    stats["failed_blocks"] = list(block_ids[stats["loaded_chunks"] :])
    stats["raw_bytes"] = stats["loaded_chunks"] * spec.nbytes()
    return stats


def gather(layers: Sequence[torch.Tensor], block_ids: Sequence[int]) -> list[torch.Tensor]:
    """Chunks [layers, kv_heads, block_size, 2 * head_size] copied out of the paged cache."""
    return [torch.stack([cache[block] for cache in layers]) for block in block_ids]


def store_chunks(
    store: valkey.Valkey, wire: WireFormat, spec: ChunkSpec, keys: Sequence[str], chunks: Sequence[torch.Tensor]
) -> dict[str, Any]:
    """Encode and SET the chunks in one pipelined round trip."""
    t0 = time.perf_counter()
    encoded = [wire.encode(chunk) for chunk in chunks]
    t1 = time.perf_counter()
    error = None
    try:
        pipe = store.pipeline(transaction=False)
        for key, data in zip(keys, encoded):
            pipe.set(key, data)
        pipe.execute()
    except STORE_ERRORS as err:
        error = f"store: {type(err).__name__}: {err}"
    return {
        "chunks": len(chunks),
        "raw_bytes": len(chunks) * spec.nbytes(),
        "wire_bytes": sum(map(len, encoded)),
        "encode_s": t1 - t0,
        "set_s": time.perf_counter() - t1,
        "error": error,
    }

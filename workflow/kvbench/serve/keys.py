"""Keys of offloaded chunks: each chained from the hash of every token before it.

vLLM's own block hashes are seeded per process, so two servers (or a restart) would never find
each other's chunks; these keys depend only on the namespace and the token ids.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np


def namespace(run: str, model: str, dtype: str, block_size: int, codec: str, layout: str = "cpu-packed") -> str:
    """Chunks of different runs, models, cache dtypes, layouts, block sizes or codecs never share a key."""
    return f"kvbench:{run}:{model}:{dtype}:{layout}:{block_size}:{codec}"


def pending_key(run: str) -> str:
    """The store's tally of chunks submitted for storing and not stored yet (async_store.py)."""
    return f"kvbench:{run}:pending"


def chunk_keys(space: str, token_ids: Sequence[int], block_size: int, n_chunks: int) -> list[str]:
    """Keys of the first `n_chunks` whole chunks: key i hashes key i-1 and the tokens of chunk i,
    so equal keys mean equal namespaces and equal token prefixes."""
    if n_chunks * block_size > len(token_ids):
        raise ValueError(f"{n_chunks} chunks of {block_size} need more than {len(token_ids)} tokens")
    tokens = np.asarray(token_ids[: n_chunks * block_size], dtype="<i8")
    digest = hashlib.sha256(space.encode()).digest()
    keys = []
    for i in range(n_chunks):
        digest = hashlib.sha256(digest + tokens[i * block_size : (i + 1) * block_size].tobytes()).digest()
        keys.append(f"{space}:{digest.hex()[:32]}")
    return keys

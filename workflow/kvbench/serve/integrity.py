"""Per-chunk integrity: every stored value is a header plus the wire payload, so a load can tell a
chunk it may copy into the paged cache from one it must not (vLLM then recomputes that block).

Header (36 bytes, little-endian): magic `KVB1`, payload length (u64), xxh3-64 of the key the
chunk was stored under, xxh3-128 of the key and the payload. A truncated value fails the length,
a value stored under another key (another run, model, dtype, codec or prefix: "foreign") fails
the key digest, flipped bytes fail the payload digest. The digests detect accidents, not an
adversary: anyone who can write to the store can compute them. A keyed digest (a per-job secret,
`secret`) is the hook for stores shared with strangers.
"""

from __future__ import annotations

import struct

import numpy as np
import xxhash

MAGIC = b"KVB1"
_HEADER = struct.Struct("<4sQQ16s")
HEADER_BYTES = _HEADER.size


class IntegrityError(ValueError):
    """A stored chunk that must not be loaded; `kind` is truncated, foreign or corrupt."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind


def _key_digest(key: bytes, secret: bytes) -> int:
    return xxhash.xxh3_64_intdigest(secret + key)


def _payload_digest(key: bytes, payload: bytes | memoryview, secret: bytes) -> bytes:
    digest = xxhash.xxh3_128(secret + key)
    digest.update(payload)
    return digest.digest()


def seal(key: str, payload: bytes | memoryview, secret: bytes = b"") -> memoryview:
    """The value to store under `key`: header + payload, in one new buffer. Numpy copies the
    payload without holding Python's GIL; b"".join keeps it for a memoryview payload (`none`,
    `fp8`), and a background store thread preempted mid-copy would keep the forward pass's
    thread waiting. The header's length field is the payload's byte count."""
    k = key.encode()
    data = np.frombuffer(payload, dtype=np.uint8)
    header = _HEADER.pack(MAGIC, len(data), _key_digest(k, secret), _payload_digest(k, payload, secret))
    value = np.empty(HEADER_BYTES + len(data), dtype=np.uint8)
    value[:HEADER_BYTES] = np.frombuffer(header, dtype=np.uint8)
    value[HEADER_BYTES:] = data
    return value.data


def unseal(key: str, value: bytes | memoryview, secret: bytes = b"") -> memoryview:
    """The payload of a value stored under `key`, without a copy; IntegrityError if it is not
    exactly what `seal(key, payload)` wrote."""
    view = memoryview(value)
    if len(view) < HEADER_BYTES:
        raise IntegrityError("truncated", f"{len(view)} bytes, shorter than the {HEADER_BYTES}-byte header")
    magic, length, key_digest, payload_digest = _HEADER.unpack(view[:HEADER_BYTES])
    if magic != MAGIC:
        raise IntegrityError("foreign", f"no kvbench chunk header (starts with {bytes(magic)!r})")
    payload = view[HEADER_BYTES:]
    if len(payload) != length:
        raise IntegrityError("truncated", f"payload of {len(payload)} bytes, the header says {length}")
    k = key.encode()
    if key_digest != _key_digest(k, secret):
        raise IntegrityError("foreign", "stored under another key")
    if payload_digest != _payload_digest(k, payload, secret):
        raise IntegrityError("corrupt", "payload checksum mismatch")
    return payload

"""Measure one codec on one byte buffer: sizes, ratio, throughput, exact round trip."""

from __future__ import annotations

import time
from typing import Any

from kvbench.kv.codecs import Codec


def measure(data: bytes, codec: Codec, repeats: int = 1) -> dict[str, Any]:
    """Best-of-`repeats` encode/decode throughput (MB/s, 1 MB = 1e6 bytes).

    A round trip that is not byte-exact is recorded as the row's error, never as a ratio.
    """
    encode_s = decode_s = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        encoded = codec.encode(data)
        t1 = time.perf_counter()
        decoded = codec.decode(encoded)
        t2 = time.perf_counter()
        encode_s, decode_s = min(encode_s, t1 - t0), min(decode_s, t2 - t1)
    exact = decoded == data
    mb = len(data) / 1e6
    return {
        "raw_bytes": len(data),
        "compressed_bytes": len(encoded) if exact else None,
        "ratio": len(data) / len(encoded) if exact else None,
        "encode_mb_s": mb / encode_s if encode_s > 0 else None,
        "decode_mb_s": mb / decode_s if decode_s > 0 else None,
        "error": None if exact else f"{codec.name}: round trip is not byte-exact",
    }

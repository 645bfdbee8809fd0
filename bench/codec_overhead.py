"""Codec throughput through kvbench's registry vs the same library called directly, side by side,
on the same bytes: real fp16 KV of one realistic document (run after `make run`).

    .venv/bin/python bench/codec_overhead.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import lz4.frame
import pandas as pd
import zstandard

from kvbench.kv.capture import capture_kv
from kvbench.kv.codecs import get_codec
from kvbench.kv.storage import store
from kvbench.models import load_model, load_tokenizer

MODEL = "resources/models/smollm2-135m"
DOCS = "results/corpus/realistic/docs.parquet"


def best_mb_s(fn: Callable[[bytes], bytes], data: bytes, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn(data)
        best = min(best, time.perf_counter() - start)
    return len(data) / 1e6 / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    tokenizer = load_tokenizer(MODEL)
    text = pd.read_parquet(DOCS).text.iloc[0]
    keys, values = capture_kv(load_model(MODEL), tokenizer(text).input_ids[:1024])
    data = store(keys, "fp16").data + store(values, "fp16").data
    direct = {
        "zstd-1": (zstandard.ZstdCompressor(level=1).compress, zstandard.ZstdDecompressor().decompress),
        "lz4": (lz4.frame.compress, lz4.frame.decompress),
    }
    rows = []
    for name, (enc, dec) in direct.items():
        codec = get_codec(name)
        blob = enc(data)
        rows.append(
            {
                "codec": name,
                "bytes": len(data),
                "kvbench_encode_mb_s": best_mb_s(codec.encode, data, args.repeats),
                "direct_encode_mb_s": best_mb_s(enc, data, args.repeats),
                "kvbench_decode_mb_s": best_mb_s(codec.decode, blob, args.repeats),
                "direct_decode_mb_s": best_mb_s(dec, blob, args.repeats),
            }
        )
    table = pd.DataFrame(rows)
    table["encode_slowdown"] = table.direct_encode_mb_s / table.kvbench_encode_mb_s
    table["decode_slowdown"] = table.direct_decode_mb_s / table.kvbench_decode_mb_s
    print(table.to_string(index=False, float_format="%.2f"))


if __name__ == "__main__":
    main()

"""Small stage tables BUILT BY HAND for the report's unit tests (not measurements): each helper
returns a frame in the report's column names (kvbench.report.contracts) with made-up values
chosen to give one verdict or answer."""

from __future__ import annotations

import itertools
import math
from typing import Iterable, Mapping, Sequence

import numpy as np
import pandas as pd

from kvbench.report.build import build
from kvbench.report.contracts import Tables
from kvbench.vllm_native import NATIVE_KV

METHODS = {
    "full": {"kind": "full", "storage": "fp16"},
    "kivi2": {"kind": "kivi", "bits": 2},
    "kivi4": {"kind": "kivi", "bits": 4},
    "turboquant3": {"kind": "turboquant", "bits": 3},
    "snapkv": {"kind": "snapkv", "keep_ratio": 0.25},
    "cam": {"kind": "cam", "capacity": 1024},
}
REPORT_CFG = {
    "baseline": "full",
    "kv_dtype": "bf16",
    "kv_codec": "zstd-3",
    "bootstrap": 200,
    "level": 0.95,
    "scenarios": {},
}


def tables(**frames: pd.DataFrame) -> Tables:
    return Tables(dict(frames), {name: f"(built in test) {name}" for name in frames})


def report(frames: Mapping[str, pd.DataFrame], scenarios: Mapping | None = None, methods=METHODS):
    cfg = dict(REPORT_CFG, scenarios=dict(scenarios or {}))
    return build(tables(**frames), cfg, methods, seed=7)


def corpus_stats(
    synthetic_unique: int = 2,
    synthetic_tokens: int = 10_000,
    realistic_tokens: int = 10_000,
    realistic_diversity: Mapping[str, float] = {"medical": 14.2, "legal": 9.4},
    docs: int = 5,
) -> pd.DataFrame:
    rows = [
        {
            "corpus": "synthetic",
            "domain": "synthetic",
            "doc_id": f"s{i}",
            "tokens": synthetic_tokens,
            "unique_tokens": synthetic_unique,
            "diversity_pct": 100 * synthetic_unique / synthetic_tokens,
        }
        for i in range(3)
    ]
    for domain, div in realistic_diversity.items():
        rows += [
            {
                "corpus": "realistic",
                "domain": domain,
                "doc_id": f"{domain}{i}",
                "tokens": realistic_tokens,
                "unique_tokens": int(realistic_tokens * div / 100),
                "diversity_pct": div,
            }
            for i in range(docs)
        ]
    return pd.DataFrame(rows)


def kv_summary(dummy: float, synthetic: float, dtype: str = "bf16", codec: str = "zstd-3") -> pd.DataFrame:
    return pd.DataFrame(
        [
            {
                "dtype": dtype,
                "codec": codec,
                "comparison": "dummy_vs_real",
                "held_fixed": "corpus=realistic",
                "benchmark_ratio": 1.3 * dummy,
                "realistic_ratio": 1.3,
                "inflation": dummy,
            },
            {
                "dtype": dtype,
                "codec": codec,
                "comparison": "synthetic_vs_realistic",
                "held_fixed": "weights=real",
                "benchmark_ratio": 1.3 * synthetic,
                "realistic_ratio": 1.3,
                "inflation": synthetic,
            },
        ]
    )


def kv_compressibility(
    ratios: Mapping[str, Mapping[str, float]],
    dtype: str = "bf16",
    docs: int = 5,
    weights: str = "real",
    jitter: float = 0.0,
) -> pd.DataFrame:
    """ratios[corpus][codec] -> one K row of 1000 raw bytes per document x codec (`docs` per corpus),
    the ratio of document i scaled by 1 + jitter * (i - mid)."""
    return pd.DataFrame(
        [
            {
                "corpus": corpus,
                "weights": weights,
                "doc_id": f"{corpus}-{i}",
                "dtype": dtype,
                "codec": codec,
                "part": "K",
                "raw_bytes": 1000,
                "compressed_bytes": 1000 / (r * (1 + jitter * (i - (docs - 1) / 2))),
                "error": None,
            }
            for corpus, codecs in ratios.items()
            for codec, r in codecs.items()
            for i in range(docs)
        ]
    )


def serve_offload(rows: Iterable[tuple[str, str, str, float, float]], status: str = "ok") -> pd.DataFrame:
    """(backend, codec, corpus, ratio, hit TTFT)."""
    return pd.DataFrame(
        [
            {
                "backend": b,
                "codec": c,
                "corpus": corpus,
                "raw_bytes": 1e6,
                "wire_bytes": 1e6 / r,
                "ratio": r,
                "ttft_warmup_s": 2.0,
                "ttft_query_s": t,
                "ttft_hit_s": t,
                "hits": 4,
                "status": status,
                "store_mb_s": 100.0,
                "load_mb_s": 200.0,
                "outputs_identical": 1.0,
            }
            for b, c, corpus, r, t in rows
        ]
    )


def system(
    values: Mapping[str, Mapping[str, float]],
    prompts: int = 3,
    target: int = 1024,
    model: str = "m",
    errors: Mapping[str, int] | None = None,
    noise: float = 0.0,
) -> pd.DataFrame:
    """values[method] = {column: value}; every prompt gets the same values (ttft_s scaled slightly
    per prompt), so medians equal them; `noise`: each row's ttft_s and decode_tok_s also times a
    seeded lognormal factor of that sd."""
    rng = np.random.default_rng(0)
    rows = []
    for method, cols in values.items():
        for p in range(prompts):
            failed = p < (errors or {}).get(method, 0)
            row = {
                "model": model,
                "method": method,
                "prompt_id": f"doc{p}@{target}",
                "corpus": "realistic",
                "target_context": target,
                "context_tokens": target,
                "bucket": "0-4k" if target < 4096 else "4-8k",
                "ttft_s": 1.0,
                "tpot_s": 0.1,
                "decode_tok_s": 10.0,
                "kv_bytes_end": 1e6,
                "ratio_end": 1.0,
                "peak_memory_mb": 1000.0,
                "error": "RuntimeError: out of memory" if failed else None,
                "ttft_s_std": 0.0,
                "repeats": 1,
            }
            row.update(cols)
            row["ttft_s"] = row["ttft_s"] * (1 + 0.1 * p) * rng.lognormal(0, noise)
            row["decode_tok_s"] = row["decode_tok_s"] * rng.lognormal(0, noise)
            if failed:
                for col in ("ttft_s", "tpot_s", "decode_tok_s", "kv_bytes_end", "ratio_end"):
                    row[col] = None
            rows.append(row)
    return pd.DataFrame(rows)


def quality(
    means: Mapping[str, Mapping[str, float]],
    samples: int = 4,
    model: str = "m",
    bucket: str = "0-4k",
    spread: float = 0.02,
) -> pd.DataFrame:
    """means[method][category] -> scores around that mean (+-spread), one task per category."""
    rows = []
    for method, cats in means.items():
        for category, mean in cats.items():
            for s, sign in zip(range(samples), itertools.cycle((1, -1))):
                rows.append(
                    {
                        "model": model,
                        "method": method,
                        "task": f"{category}_task",
                        "category": category,
                        "metric": "qa_f1",
                        "bucket": bucket,
                        "context_tokens": 1000,
                        "sample": s,
                        "score": mean + sign * spread,
                        "error": None,
                        "ttft_s": math.nan,
                        "tpot_s": math.nan,
                        "kv_bytes": math.nan,
                        "ratio": math.nan,
                    }
                )
    return pd.DataFrame(rows)


def fidelity(top1: Mapping[str, Mapping[str, float]], samples: int = 3, model: str = "m") -> pd.DataFrame:
    return pd.DataFrame(
        [
            {
                "model": model,
                "method": method,
                "category": category,
                "sample": s,
                "kl_mean": 1 - agree,
                "top1_agreement": agree,
                "first_divergence": None if agree == 1 else 5,
                "error": None,
                "bucket": None,
                "positions": 16,
            }
            for method, cats in top1.items()
            for category, agree in cats.items()
            for s in range(samples)
        ]
    )


def served(
    scores: Mapping[str, Sequence[float]],
    kl: Mapping[str, Sequence[float]] | None = None,
    model: str = "m",
    category: str = "qa",
    reference: str = "vllm-bfloat16",
) -> pd.DataFrame:
    """quality_served's rows under the report's names: scores[server] -> one score per sample (the
    reference server's label among them); kl[server] -> KL per sample (the reference's: 0; top-1
    agreement 1 - KL, first-token KL half of it, decode-time KL twice it)."""
    dtypes = {kv.label: kv.dtype for kv in NATIVE_KV}
    rows = []
    for server, values in scores.items():
        kls = (kl or {}).get(server, [0.0] * len(values))
        for s, (score, k) in enumerate(zip(values, kls)):
            rows.append(
                {
                    "model": model,
                    "server": server,
                    "kv_cache_dtype": dtypes.get(server, "auto"),
                    "served_dtype": "bfloat16",
                    "reference_server": reference,
                    "task": f"{category}_task",
                    "category": category,
                    "sample": s,
                    "score": score,
                    "error": None if score == score else "failed",
                    "kl_mean": k,
                    "kl_first": k / 2,
                    "top1_agreement": 1 - k,
                    "positions": 16,
                    "decode_kl_mean": 2 * k,
                    "decode_positions": 8,
                    "fidelity_note": None,
                }
            )
    return pd.DataFrame(rows)

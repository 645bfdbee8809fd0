"""Diversity statistics of a corpus, measured with the model's own tokenizer."""

from __future__ import annotations

import math
from collections import Counter
from typing import Callable, Sequence

import pandas as pd
import zstandard

# Reference figures (the seed blog, ../shared/seeds/): ~10K-token documents, Qwen3-8B-FP8 tokenizer.
# Diversity shrinks as documents grow, so compare at similar lengths.
REFERENCE_DIVERSITY_PCT = {
    ("synthetic", "synthetic"): 0.02,
    ("realistic", "medical"): 14.2,
    ("realistic", "legal"): 9.4,
}
REFERENCE_NOTE = "~10K-token docs, Qwen3-8B-FP8 tokenizer (kvbench seed blog)"
ZSTD_LEVEL = 3


def token_stats(ids: Sequence[int]) -> dict[str, float]:
    counts = Counter(ids)
    total = len(ids)
    entropy = -sum(c / total * math.log2(c / total) for c in counts.values()) if total else 0.0
    return {
        "tokens": total,
        "unique_tokens": len(counts),
        "diversity_pct": 100.0 * len(counts) / total if total else 0.0,
        "entropy_bits": entropy,
    }


def text_zstd_ratio(text: str) -> float:
    raw = text.encode("utf-8")
    return len(raw) / len(zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(raw))


def corpus_stats(docs: pd.DataFrame, encode: Callable[[str], list[int]]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Per-document statistics, and per corpus x domain summaries.

    Diversity falls as text grows, so the summary also pools each group's documents into one
    token stream (`pooled_*`): closer to the reference's 10K-token documents than 1K-token docs.
    """
    rows, pooled = [], {}
    for doc in docs.itertuples(index=False):
        ids = encode(doc.text)
        pooled.setdefault((doc.corpus, doc.domain), []).extend(ids)
        rows.append(
            {
                "corpus": doc.corpus,
                "domain": doc.domain,
                "doc_type": doc.doc_type,
                "doc_id": doc.doc_id,
                "chars": len(doc.text),
                **token_stats(ids),
                "text_zstd_ratio": text_zstd_ratio(doc.text),
            }
        )
    per_doc = pd.DataFrame(rows)
    summary = summarize(per_doc)
    pooled_stats = [token_stats(pooled[(c, d)]) for c, d in zip(summary.corpus, summary.domain)]
    summary["pooled_diversity_pct"] = [s["diversity_pct"] for s in pooled_stats]
    summary["pooled_entropy_bits"] = [s["entropy_bits"] for s in pooled_stats]
    return per_doc, summary


def summarize(stats: pd.DataFrame) -> pd.DataFrame:
    """Per corpus x domain means, with the reference diversity where one exists."""
    summary = stats.groupby(["corpus", "domain"], as_index=False).agg(
        docs=("doc_id", "size"),
        tokens_total=("tokens", "sum"),
        tokens_mean=("tokens", "mean"),
        diversity_pct_mean=("diversity_pct", "mean"),
        diversity_pct_min=("diversity_pct", "min"),
        diversity_pct_max=("diversity_pct", "max"),
        entropy_bits_mean=("entropy_bits", "mean"),
        text_zstd_ratio_mean=("text_zstd_ratio", "mean"),
    )
    summary["reference_diversity_pct"] = [
        REFERENCE_DIVERSITY_PCT.get((c, d), math.nan) for c, d in zip(summary.corpus, summary.domain)
    ]
    summary["reference_note"] = [
        REFERENCE_NOTE if (c, d) in REFERENCE_DIVERSITY_PCT else "" for c, d in zip(summary.corpus, summary.domain)
    ]
    return summary

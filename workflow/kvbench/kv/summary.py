"""Put the seeds' claim next to the measurement: how much better KV compresses on benchmark-style
inputs (dummy weights, "hi hi hi" documents) than on real weights and realistic documents."""

from __future__ import annotations

import pandas as pd

GROUP = ["corpus", "weights", "dtype", "codec"]


def pooled_ratios(table: pd.DataFrame, by: list[str] = GROUP) -> pd.DataFrame:
    """Total raw / total compressed bytes per group (by default corpus x weights x dtype x codec,
    K and V together), over the rows without an error."""
    ok = table[table["error"].isna()]
    agg = ok.groupby(by, as_index=False).agg(
        docs=("doc_id", "nunique"), raw_bytes=("raw_bytes", "sum"), compressed_bytes=("compressed_bytes", "sum"),
    )
    agg["ratio"] = agg.raw_bytes / agg.compressed_bytes
    return agg


def _pairs(corpora: list[str], weights: list[str]) -> list[tuple[str, str, tuple[str, str], tuple[str, str]]]:
    """(comparison, held fixed, benchmark-style setting, realistic setting) as (corpus, weights)."""
    pairs = []
    for corpus in corpora:
        for w in ("dummy", "random"):
            if w in weights and "real" in weights:
                pairs.append((f"{w}_vs_real", f"corpus={corpus}", (corpus, w), (corpus, "real")))
    if "synthetic" in corpora and "realistic" in corpora:
        for w in weights:
            pairs.append(("synthetic_vs_realistic", f"weights={w}", ("synthetic", w), ("realistic", w)))
        if {"dummy", "real"} <= set(weights):
            pairs.append(("synthetic+dummy_vs_realistic+real", "-", ("synthetic", "dummy"), ("realistic", "real")))
    return pairs


def inflation_factors(table: pd.DataFrame) -> pd.DataFrame:
    """One row per dtype x codec x comparison: benchmark-style ratio / realistic ratio."""
    ratios = pooled_ratios(table).set_index(GROUP)["ratio"]
    corpora = sorted(set(table.corpus))
    weights = sorted(set(table.weights))
    rows = []
    for (dtype, codec), _ in table.groupby(["dtype", "codec"]):
        for name, held, bench, real in _pairs(corpora, weights):
            b, r = ratios.get((*bench, dtype, codec)), ratios.get((*real, dtype, codec))
            if b is None or r is None:
                continue
            rows.append({
                "dtype": dtype, "codec": codec, "comparison": name, "held_fixed": held,
                "benchmark_setting": "+".join(bench), "realistic_setting": "+".join(real),
                "benchmark_ratio": b, "realistic_ratio": r, "inflation": b / r,
            })
    return pd.DataFrame(rows)


def claim_text(factors: pd.DataFrame, dtype: str = "fp16", codec: str = "zstd-3") -> str:
    """Plain-text summary for the log and the README."""
    sel = factors[(factors.dtype == dtype) & (factors.codec == codec)]
    lines = [f"KV compressibility, {dtype} storage, {codec} (ratio = raw / compressed bytes):"]
    for row in sel.itertuples():
        lines.append(
            f"  {row.comparison:<36} {row.held_fixed:<18} {row.benchmark_setting:>18} {row.benchmark_ratio:7.2f}x"
            f"  vs {row.realistic_setting:<18} {row.realistic_ratio:6.2f}x  -> inflation {row.inflation:6.2f}x"
        )
    return "\n".join(lines)

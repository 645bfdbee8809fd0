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
        docs=("doc_id", "nunique"),
        raw_bytes=("raw_bytes", "sum"),
        compressed_bytes=("compressed_bytes", "sum"),
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


def underflow_shares(table: pd.DataFrame) -> pd.DataFrame:
    """Per corpus x weights x dtype: % of stored values below the dtype's smallest normal, and %
    of nonzero values stored as zero (each document and part counted once, not once per codec)."""
    ok = table[table["error"].isna()].drop_duplicates(["corpus", "weights", "dtype", "doc_id", "part"])
    agg = ok.groupby(["corpus", "weights", "dtype"], as_index=False)[
        ["values", "below_normal", "flushed_to_zero"]
    ].sum()
    agg["below_normal_pct"] = 100 * agg.below_normal / agg["values"]
    agg["flushed_to_zero_pct"] = 100 * agg.flushed_to_zero / agg["values"]
    return agg[["corpus", "weights", "dtype", "below_normal_pct", "flushed_to_zero_pct"]]


def inflation_factors(table: pd.DataFrame, layers: pd.DataFrame | None = None) -> pd.DataFrame:
    """One row per dtype x codec x comparison: benchmark-style ratio / realistic ratio, for the
    whole cache compressed at once and, where `layers` has the dtype and codec, for each layer
    compressed alone (pooled over layers): the whole-cache ratio also gains from redundancy
    across layers (a small model with dummy weights computes near-identical layers). Underflow
    shares of both settings say how much of a ratio is the dtype's range rather than the data."""
    ratios = pooled_ratios(table).set_index(GROUP)["ratio"]
    layer_ratios = (
        pooled_ratios(layers).set_index(GROUP)["ratio"] if layers is not None and len(layers) else pd.Series()
    )
    shares = underflow_shares(table).set_index(["corpus", "weights", "dtype"]) if "values" in table else None
    corpora = sorted(set(table.corpus))
    weights = sorted(set(table.weights))
    rows = []
    for (dtype, codec), _ in table.groupby(["dtype", "codec"]):
        for name, held, bench, real in _pairs(corpora, weights):
            b, r = ratios.get((*bench, dtype, codec)), ratios.get((*real, dtype, codec))
            if b is None or r is None:
                continue
            bl, rl = layer_ratios.get((*bench, dtype, codec)), layer_ratios.get((*real, dtype, codec))
            row = {
                "dtype": dtype,
                "codec": codec,
                "comparison": name,
                "held_fixed": held,
                "benchmark_setting": "+".join(bench),
                "realistic_setting": "+".join(real),
                "benchmark_ratio": b,
                "realistic_ratio": r,
                "inflation": b / r,
                "benchmark_layer_ratio": bl,
                "realistic_layer_ratio": rl,
                "layer_inflation": bl / rl if bl is not None and rl is not None else None,
            }
            if shares is not None:
                for side, setting in (("benchmark", bench), ("realistic", real)):
                    share = shares.loc[(*setting, dtype)]
                    row[f"{side}_below_normal_pct"] = share.below_normal_pct
                    row[f"{side}_flushed_to_zero_pct"] = share.flushed_to_zero_pct
            rows.append(row)
    return pd.DataFrame(rows)


def claim_text(factors: pd.DataFrame, dtype: str = "fp16", codec: str = "zstd-3") -> str:
    """Plain-text summary for the log and the README."""
    sel = factors[(factors.dtype == dtype) & (factors.codec == codec)]
    lines = [f"KV compressibility, {dtype} storage, {codec} (ratio = raw / compressed bytes):"]
    for row in sel.itertuples():
        line = (
            f"  {row.comparison:<36} {row.held_fixed:<18} {row.benchmark_setting:>18} {row.benchmark_ratio:7.2f}x"
            f"  vs {row.realistic_setting:<18} {row.realistic_ratio:6.2f}x  -> inflation {row.inflation:6.2f}x"
        )
        if getattr(row, "layer_inflation", None) is not None and pd.notna(row.layer_inflation):
            line += f"  (per layer {row.benchmark_layer_ratio:.2f}x vs {row.realistic_layer_ratio:.2f}x: {row.layer_inflation:.2f}x)"
        if hasattr(row, "benchmark_below_normal_pct"):
            line += (
                f"  [below normal {row.benchmark_below_normal_pct:.1f}% vs {row.realistic_below_normal_pct:.1f}%,"
                f" zeroed {row.benchmark_flushed_to_zero_pct:.1f}% vs {row.realistic_flushed_to_zero_pct:.1f}%]"
            )
        lines.append(line)
    return "\n".join(lines)

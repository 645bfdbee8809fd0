"""Joined tables of the report: per model x method x task category x context bucket (quality,
fidelity, TTFT, TPOT, measured bytes and ratio, each also relative to the baseline method), and
per corpus (diversity, KV compressibility, bytes on the wire)."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd

from kvbench.kv.summary import pooled_ratios
from kvbench.report.contracts import CONTRACTS, Tables

# Without a quality stage the system prompts are the only workload: their rows get this category.
SYSTEM_CATEGORY = "system prompts"
CONTROL_CORPUS = "synthetic"  # the "hi hi hi" control: not a workload a recommendation is for
KEYS = ["model", "method", "category", "bucket"]
# Measured columns a scenario may limit or rank by; each also exists as <name>_rel (/ baseline).
MEASURED = ["quality", "kl_mean", "top1_agreement", "first_divergence", "ttft_s", "tpot_s", "decode_tok_s",
            "kv_bytes", "ratio", "peak_memory_mb"]


def _sources(tables: Tables, *names: str) -> str:
    """Provenance of the stage tables a row was built from (JSON)."""
    out = {}
    for name in names:
        frame = tables.get(name)
        if frame is None:
            continue
        out[CONTRACTS[name].path] = {
            col: sorted(map(str, frame[col].dropna().unique()))
            for col in ("config_hash", "git_commit", "kvbench_version") if col in frame
        }
    return json.dumps(out, sort_keys=True)


def workload_prompts(system: pd.DataFrame) -> pd.DataFrame:
    return system[system.corpus != CONTROL_CORPUS]


# Per-sample timings and bytes the quality pass records: per category, they replace the system
# stage's numbers (measured on other prompts at another length) wherever they exist.
PER_SAMPLE = ["ttft_s", "tpot_s", "kv_bytes", "ratio"]
SYSTEM_ONLY = ["decode_tok_s", "peak_memory_mb"]
QUALITY_COLUMNS = ["quality", "kl_mean", "top1_agreement", "first_divergence"]


def system_cells(system: pd.DataFrame) -> pd.DataFrame:
    """Medians over the workload prompts per model x method x bucket; errors counted, not hidden."""
    rows = workload_prompts(system)
    ok = rows[rows.error.isna()]
    med = ok.groupby(["model", "method", "bucket"], as_index=False).agg(
        ttft_s=("ttft_s", "median"), tpot_s=("tpot_s", "median"), decode_tok_s=("decode_tok_s", "median"),
        kv_bytes=("kv_bytes_end", "median"), ratio=("ratio_end", "median"),
        peak_memory_mb=("peak_memory_mb", "max"),
    )
    counts = rows.groupby(["model", "method", "bucket"], as_index=False).agg(
        prompts=("prompt_id", "size"), system_errors=("error", lambda e: int(e.notna().sum())))
    return counts.merge(med, on=["model", "method", "bucket"], how="left")


def quality_cells(scores: pd.DataFrame) -> pd.DataFrame:
    """Mean score per cell over every scored sample. An "empty output" keeps its score (an empty
    answer is a wrong one): it is counted in `empty_outputs`, not dropped; only a sample without a
    score is a failure (`quality_errors`). Timings and bytes: medians of the pass's own samples."""
    scored = scores[scores.score.notna()]
    mean = scored.groupby(KEYS, as_index=False).agg(quality=("score", "mean"))
    counts = scores.groupby(KEYS, as_index=False).agg(
        samples=("sample", "size"), quality_errors=("score", lambda s: int(s.isna().sum())),
        empty_outputs=("error", lambda e: int((e == "empty output").sum())))
    timed = scores.astype({c: float for c in PER_SAMPLE}).groupby(KEYS, as_index=False)[PER_SAMPLE].median()
    return counts.merge(mean, on=KEYS, how="left").merge(timed, on=KEYS, how="left")


def fidelity_cells(fidelity: pd.DataFrame) -> pd.DataFrame:
    """Per cell: KL and top-1 agreement pooled over positions (weighted by each sample's positions,
    as the quality stage's summary pools them), median first divergence."""
    keys = [k for k in KEYS if k != "bucket" or fidelity["bucket"].notna().any()]
    ok = fidelity[fidelity.kl_mean.notna()]
    # Identical outputs never diverge (null): they count as diverging after the whole continuation.
    weight = ok.positions.fillna(1.0).clip(lower=1.0) if "positions" in ok else pd.Series(1.0, index=ok.index)
    ok = ok.assign(first_divergence=ok.first_divergence.astype(float).fillna(ok.positions), _w=weight,
                   _kl=ok.kl_mean * weight, _top1=ok.top1_agreement * weight)
    out = ok.groupby(keys, as_index=False).agg(
        _kl=("_kl", "sum"), _top1=("_top1", "sum"), _w=("_w", "sum"), first_divergence=("first_divergence", "median"),
        positions=("positions", "median"))
    return out.assign(kl_mean=out._kl / out._w, top1_agreement=out._top1 / out._w).drop(columns=["_kl", "_top1", "_w"])


def add_relative(table: pd.DataFrame, baseline: str, columns: list[str] = MEASURED) -> pd.DataFrame:
    """<col>_rel = the row's value / the baseline method's value in the same model x category x bucket."""
    group = ["model", "category", "bucket"]
    base = table[table.method == baseline].set_index(group)[columns]
    base = base[~base.index.duplicated()]
    aligned = base.reindex(pd.MultiIndex.from_frame(table[group])).to_numpy(float)
    values = table[columns].to_numpy(float)
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.where(aligned != 0, values / aligned, np.nan)
    return table.assign(**{f"{col}_rel": rel[:, i] for i, col in enumerate(columns)})


def _skeleton(quality: pd.DataFrame | None, system: pd.DataFrame | None) -> pd.DataFrame:
    """Every model x method x category x bucket either stage measured (an outer join): a method only
    the system stage ran gets a row in each quality category of its model x bucket (its quality
    unknown), and "system prompts" where the quality stage has no category in that bucket."""
    parts = []
    if quality is not None:
        parts.append(quality[KEYS])
    if system is not None:
        cats = (quality[["model", "bucket", "category"]].drop_duplicates() if quality is not None
                else pd.DataFrame(columns=["model", "bucket", "category"]))
        sys_keys = system[["model", "method", "bucket"]].merge(cats, on=["model", "bucket"], how="left")
        parts.append(sys_keys.fillna({"category": SYSTEM_CATEGORY})[KEYS])
    return pd.concat(parts, ignore_index=True).drop_duplicates(ignore_index=True)


def _pick_source(table: pd.DataFrame, baseline: str, quality_path: str, system_path: str) -> pd.DataFrame:
    """TTFT, TPOT, bytes and ratio from the quality pass where it measured both the row and the
    baseline in the cell (so the _rel columns divide like by like), else from the system stage."""
    q = add_relative(table.rename(columns={f"q_{c}": c for c in PER_SAMPLE})[[*KEYS, *PER_SAMPLE]], baseline,
                     PER_SAMPLE)
    s = add_relative(table.rename(columns={f"s_{c}": c for c in PER_SAMPLE})[[*KEYS, *PER_SAMPLE]], baseline,
                     PER_SAMPLE)
    own = q[[f"{c}_rel" for c in PER_SAMPLE]].notna().all(axis=1)
    has_system = s[PER_SAMPLE].notna().any(axis=1)
    chosen = {}
    for col in [*PER_SAMPLE, *(f"{c}_rel" for c in PER_SAMPLE)]:
        chosen[col] = q[col].where(own, s[col])
    source = np.where(own, quality_path, np.where(has_system, system_path, None))
    out = table.drop(columns=[f"{p}_{c}" for p in "qs" for c in PER_SAMPLE])
    return out.assign(**chosen, timing_source=source)


def _baseline_fidelity(table: pd.DataFrame, baseline: str) -> pd.DataFrame:
    """The baseline agrees with itself: top-1 1, KL 0, no divergence within the continuation (the
    quality stage writes no fidelity rows for it)."""
    measured = table.groupby(["model", "category"]).positions.transform("median")
    base = (table.method == baseline) & measured.notna()
    return table.assign(
        top1_agreement=table.top1_agreement.mask(base & table.top1_agreement.isna(), 1.0),
        kl_mean=table.kl_mean.mask(base & table.kl_mean.isna(), 0.0),
        first_divergence=table.first_divergence.mask(base & table.first_divergence.isna(), measured),
    ).drop(columns="positions")


def method_table(tables: Tables, baseline: str) -> pd.DataFrame:
    """One row per model x method x category x bucket that any method stage measured."""
    system = tables.get("system")
    scores = tables.get("quality_scores")
    quality = quality_cells(scores) if scores is not None and len(scores) else None
    sys_cells = system_cells(system) if system is not None and len(system) else None
    if quality is None and sys_cells is None:
        return pd.DataFrame(columns=[*KEYS, *MEASURED, *(f"{c}_rel" for c in MEASURED), "timing_source", "sources"])
    table = _skeleton(quality, sys_cells)
    if quality is not None:
        table = table.merge(quality.rename(columns={c: f"q_{c}" for c in PER_SAMPLE}), on=KEYS, how="left")
    if sys_cells is not None:
        table = table.merge(sys_cells.rename(columns={c: f"s_{c}" for c in PER_SAMPLE}),
                            on=["model", "method", "bucket"], how="left")
    for col in [*(f"{p}_{c}" for p in "qs" for c in PER_SAMPLE), *SYSTEM_ONLY, "quality", "samples",
                "quality_errors", "empty_outputs", "prompts", "system_errors"]:
        if col not in table:
            table[col] = np.nan
    table = _pick_source(table, baseline, CONTRACTS["quality_scores"].path, CONTRACTS["system"].path)
    fidelity = tables.get("quality_fidelity")
    if fidelity is not None and len(fidelity):
        cells = fidelity_cells(fidelity)
        table = table.merge(cells, on=[k for k in KEYS if k in cells], how="left")
    for col in [*QUALITY_COLUMNS, "positions"]:
        if col not in table:
            table[col] = np.nan
    table = _baseline_fidelity(table, baseline)
    table = add_relative(table, baseline, [c for c in MEASURED if c not in PER_SAMPLE])
    table = table.reindex(columns=[*dict.fromkeys([*KEYS, "samples", "quality_errors", "empty_outputs", "prompts",
                                                     "system_errors", *MEASURED, *(f"{c}_rel" for c in MEASURED),
                                                     *table.columns])])
    table["sources"] = _sources(tables, "system", "quality_scores", "quality_fidelity")
    return table.sort_values(KEYS, ignore_index=True)


def corpus_table(tables: Tables, dtype: str, codec: str) -> pd.DataFrame:
    """One row per corpus: token diversity, pooled KV compression ratio (real and dummy weights,
    `dtype` + `codec`), and bytes on the wire through the serve stage with the same codec."""
    stats = tables.get("corpus_stats")
    frames = []
    if stats is not None:
        frames.append(stats.groupby("corpus").agg(
            docs=("doc_id", "nunique"), tokens_mean=("tokens", "mean"), unique_tokens_mean=("unique_tokens", "mean"),
            diversity_pct_mean=("diversity_pct", "mean")))
    kv = tables.get("kv_compressibility")
    if kv is not None:
        ratios = pooled_ratios(kv[(kv.dtype == dtype) & (kv.codec == codec)], by=["corpus", "weights"])
        frames.append(ratios.pivot(index="corpus", columns="weights", values="ratio")
                      .add_prefix("kv_ratio_").rename_axis(columns=None))
    offload = tables.get("serve_offload")
    if offload is not None:
        # min_count: a corpus with no stored bytes (no valkey backend) has none, not 0
        sel = offload[offload.codec == codec].groupby("corpus")[["raw_bytes", "wire_bytes"]].sum(min_count=1)
        frames.append(sel.assign(wire_ratio=sel.raw_bytes / sel.wire_bytes)[["wire_bytes", "wire_ratio"]])
    if not frames:
        return pd.DataFrame(columns=["corpus", "sources"])
    table = pd.concat(frames, axis=1).rename_axis("corpus").reset_index()
    table.insert(1, "kv_dtype", dtype)
    table.insert(2, "codec", codec)
    table["sources"] = _sources(tables, "corpus_stats", "kv_compressibility", "serve_offload")
    return table

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
    ok = scores[scores.error.isna()]
    mean = ok.groupby(KEYS, as_index=False).agg(quality=("score", "mean"))
    counts = scores.groupby(KEYS, as_index=False).agg(
        samples=("sample", "size"), quality_errors=("error", lambda e: int(e.notna().sum())))
    return counts.merge(mean, on=KEYS, how="left")


def fidelity_cells(fidelity: pd.DataFrame) -> pd.DataFrame:
    keys = [k for k in KEYS if k != "bucket" or fidelity["bucket"].notna().any()]
    ok = fidelity[fidelity.error.isna()]
    # Identical outputs never diverge (null): they count as diverging after the whole continuation.
    ok = ok.assign(first_divergence=ok.first_divergence.fillna(ok.positions))
    return ok.groupby(keys, as_index=False).agg(
        kl_mean=("kl_mean", "mean"), top1_agreement=("top1_agreement", "mean"),
        first_divergence=("first_divergence", "median"))


def add_relative(table: pd.DataFrame, baseline: str) -> pd.DataFrame:
    """<col>_rel = the row's value / the baseline method's value in the same model x category x bucket."""
    group = ["model", "category", "bucket"]
    base = table[table.method == baseline].set_index(group)[MEASURED]
    base = base[~base.index.duplicated()]
    aligned = base.reindex(pd.MultiIndex.from_frame(table[group])).to_numpy(float)
    values = table[MEASURED].to_numpy(float)
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.where(aligned != 0, values / aligned, np.nan)
    return table.assign(**{f"{col}_rel": rel[:, i] for i, col in enumerate(MEASURED)})


def method_table(tables: Tables, baseline: str) -> pd.DataFrame:
    """One row per model x method x category x bucket, from whichever method stages ran."""
    system = tables.get("system")
    scores = tables.get("quality_scores")
    if scores is not None and len(scores):
        table = quality_cells(scores)
        if system is not None:
            table = table.merge(system_cells(system), on=["model", "method", "bucket"], how="left")
    elif system is not None:
        table = system_cells(system).assign(category=SYSTEM_CATEGORY)
    else:
        return pd.DataFrame(columns=[*KEYS, *MEASURED, *(f"{c}_rel" for c in MEASURED), "sources"])
    fidelity = tables.get("quality_fidelity")
    if fidelity is not None:
        cells = fidelity_cells(fidelity)
        table = table.merge(cells, on=[k for k in KEYS if k in cells], how="left")
    table = table.reindex(columns=[*dict.fromkeys([*KEYS, "samples", "quality_errors", "prompts", "system_errors",
                                                     *MEASURED, *table.columns])])
    table = add_relative(table, baseline)
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
        sel = offload[offload.codec == codec].groupby("corpus").agg(
            raw_bytes=("raw_bytes", "sum"), wire_bytes=("wire_bytes", "sum"))
        frames.append(sel.assign(wire_ratio=sel.raw_bytes / sel.wire_bytes)[["wire_bytes", "wire_ratio"]])
    if not frames:
        return pd.DataFrame(columns=["corpus", "sources"])
    table = pd.concat(frames, axis=1).rename_axis("corpus").reset_index()
    table.insert(1, "kv_dtype", dtype)
    table.insert(2, "codec", codec)
    table["sources"] = _sources(tables, "corpus_stats", "kv_compressibility", "serve_offload")
    return table

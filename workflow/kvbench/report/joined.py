"""Joined tables of the report: per model x method x protocol x task category x context bucket
(quality, fidelity, TTFT, TPOT, measured bytes and ratio, each also relative to the baseline
method, each with its bootstrap interval), and per corpus (diversity, KV compressibility, bytes on
the wire)."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from typing import Any, Mapping

import numpy as np
import pandas as pd

from kvbench.kv.summary import pooled_ratios
from kvbench.report.bootstrap import Estimate, Resample, sparse_ratio_bound
from kvbench.report.cells import ALL, quality_panel, system_panel
from kvbench.report.contracts import CONTRACTS, DEFAULT_PROTOCOL, Tables
from kvbench.report.samples import CONTROL_CORPUS, paired_quality, system_units

# Without a quality stage the system prompts are the only workload: their rows get this category.
SYSTEM_CATEGORY = "system prompts"
KEYS = ["model", "method", "protocol", "category", "bucket"]
# Measured columns a scenario may limit or rank by; each also exists as <name>_rel (/ baseline),
# and both with their interval (<name>_low, <name>_high, <name>_rel_low, <name>_rel_high) and the
# units behind them (<name>_n: samples, or prompts for the system stage's columns).
MEASURED = [
    "quality",
    "kl_mean",
    "top1_agreement",
    "first_divergence",
    "ttft_s",
    "tpot_s",
    "decode_tok_s",
    "kv_bytes",
    "ratio",
    "peak_memory_mb",
]
BOUNDS = ["low", "high", "rel_low", "rel_high", "n"]
SCORE_RANGE = 1.0  # every task metric scores a sample in [0, 1] (kvbench.quality.metrics)


def _sources(tables: Tables, *names: str) -> str:
    """Provenance of the stage tables a row was built from (JSON)."""
    out = {}
    for name in names:
        frame = tables.get(name)
        if frame is None:
            continue
        out[CONTRACTS[name].path] = {
            col: sorted(map(str, frame[col].dropna().unique()))
            for col in ("config_hash", "git_commit", "kvbench_version")
            if col in frame
        }
    return json.dumps(out, sort_keys=True)


def workload_prompts(system: pd.DataFrame) -> pd.DataFrame:
    return system[system.corpus != CONTROL_CORPUS]


# Per-sample timings and bytes the quality pass records: per category, they replace the system
# stage's numbers (measured on other prompts at another length) wherever they exist.
PER_SAMPLE = ["ttft_s", "tpot_s", "kv_bytes", "ratio"]
TIMINGS = ["ttft_s", "tpot_s"]
SYSTEM_ONLY = ["decode_tok_s", "peak_memory_mb"]
QUALITY_COLUMNS = ["quality", "kl_mean", "top1_agreement", "first_divergence"]


def from_quality_pass(row: Mapping[str, Any], column: str) -> bool:
    """Whether a joined row's column rests on quality samples (else on system-stage prompts)."""
    if column in QUALITY_COLUMNS:
        return True
    if column in SYSTEM_ONLY:
        return False
    source = row.get("timing_source" if column in TIMINGS else "bytes_source")
    return source == CONTRACTS["quality_scores"].path


def _put(out: dict, column: str, value: Estimate | None, rel: Estimate | None, level: float) -> None:
    """column, column_rel and their intervals and n from an estimate of the value and one of its
    ratio to the baseline (None: not defined)."""
    for suffix, est in (("", value), ("_rel", rel)):
        if est is None:
            out |= {f"{column}{suffix}{end}": math.nan for end in ("", "_low", "_high")}
            continue
        iv = est.interval(level, null=1.0 if suffix else 0.0)
        out |= {f"{column}{suffix}": est.estimate, f"{column}{suffix}_low": iv.low, f"{column}{suffix}_high": iv.high}
    est = value or rel
    # samples (prompts): what the recommendation labels n; the interval counts documents where they are resampled
    out[f"{column}_n"] = 0 if est is None else est.n if est.n_units is None else est.n_units


def _relative(r: Resample, score: np.ndarray, base: np.ndarray, is_baseline: bool) -> Estimate:
    """The ratio of mean scores to the baseline's on the same samples, with the samples where the
    two differ (`changed`). Where fewer than MIN_CHANGED differ (a sparse 0/1 difference, or none)
    the bootstrap's interval would be far too narrow: the interval is then the exact bound of
    kvbench.report.bootstrap.sparse_ratio_bound over the units (documents where they are
    resampled: a document counts as changed if any of its samples is), scores lying in
    [0, SCORE_RANGE]. The baseline's own ratio is 1 by definition."""
    rel = r.ratio(score, base)
    if is_baseline:
        return rel
    both = np.isfinite(score) & np.isfinite(base)
    (units, _), (changed_units, _) = r.count(both), r.count(both & (score != base))
    base_mean = float(base[both].mean()) if both.any() else math.nan

    def exact(level: float) -> tuple[float, float]:
        return sparse_ratio_bound(changed_units, units, base_mean, SCORE_RANGE, level)

    return replace(rel, changed=changed_units, exact=exact)


def log_ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where((num > 0) & (den > 0), np.log(num / den), np.nan)


def fidelity_units(
    col: dict[str, np.ndarray], positions: np.ndarray, is_baseline: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(KL, top-1 agreement, first divergence) per sample of one method; the baseline agrees with
    itself (KL 0, top-1 1, no divergence within the reference continuation's `positions`)."""
    if is_baseline:
        known = np.isfinite(positions)
        return np.where(known, 0.0, np.nan), np.where(known, 1.0, np.nan), positions
    return col["kl_mean"], col["top1_agreement"], col["first_divergence"]


def position_weights(positions: np.ndarray) -> np.ndarray:
    """Fidelity is pooled over positions: a sample weighs its continuation's length (at least 1)."""
    return np.nan_to_num(positions, nan=1.0).clip(min=1.0)


def quality_side(paired: pd.DataFrame, baseline: str, n_boot: int, seed: int, level: float) -> pd.DataFrame:
    """Per model x method x protocol x category x bucket of the quality stage: counts, mean score
    (over scored samples; an empty output scores 0 and is counted, not dropped), fidelity (KL and
    top-1 agreement pooled over positions, first divergence a mean with identical outputs at the
    continuation's length; the baseline agrees with itself: KL 0, top-1 1), and the pass's own
    timings and bytes (medians), each with its interval and its ratio to the baseline (paired by
    sample: a ratio of means for score and divergence, a geometric mean of per-sample ratios for
    timings and bytes)."""
    rows = []
    for cell in quality_panel(paired, n_boot, seed).cells(("leaf",)):
        m = {
            c: cell.matrix(c)
            for c in (
                "score",
                "failed",
                "empty",
                "kl_mean",
                "top1_agreement",
                "first_divergence",
                "positions",
                *PER_SAMPLE,
            )
        }
        positions = m["positions"].max(axis=1).to_numpy(float)  # the reference continuation's, for any method
        r = cell.resample
        base = {
            c: m[c][baseline].to_numpy(float) if baseline in m[c] else np.full(cell.n_units, np.nan)
            for c in ("score", *PER_SAMPLE)
        }
        for method in m["score"].columns:
            present = m["failed"][method].notna()
            if not present.any():
                continue
            col = {c: m[c][method].to_numpy(float) for c in m}
            out = {
                **cell.key,
                "method": method,
                "samples": int(present.sum()),
                "quality_errors": int(np.nansum(col["failed"])),
                "empty_outputs": int(np.nansum(col["empty"])),
            }
            _put(
                out,
                "quality",
                r.mean(col["score"]),
                _relative(r, col["score"], base["score"], method == baseline),
                level,
            )
            kl, top1, fd = fidelity_units(col, positions, method == baseline)
            weights = position_weights(positions)
            kl_est = r.mean(kl, weights) if np.isfinite(kl).any() else None
            top1_est = r.mean(top1, weights) if np.isfinite(top1).any() else None
            _put(out, "kl_mean", kl_est, None, level)
            _put(out, "top1_agreement", top1_est, top1_est, level)  # the baseline's is 1
            fd_known = np.isfinite(fd).any()
            _put(
                out,
                "first_divergence",
                r.mean(fd) if fd_known else None,
                r.ratio(fd, positions) if fd_known else None,
                level,
            )
            for c in PER_SAMPLE:
                measured = np.isfinite(col[c]).any()
                rel = r.geometric_mean(log_ratio(col[c], base[c])) if measured and np.isfinite(base[c]).any() else None
                _put(out, c, r.median(col[c]) if measured else None, rel, level)
            rows.append(out)
    return pd.DataFrame(rows)


def system_side(units: pd.DataFrame, baseline: str, n_boot: int, seed: int, level: float) -> pd.DataFrame:
    """Per model x method x bucket of the system stage's workload prompts, and over all its buckets
    (bucket `all`): prompts, failed runs, medians over prompts (each prompt's repeats averaged), the
    peak memory's maximum (no interval: a maximum is not resampled), and each column's geometric
    mean over prompts of the paired ratio to the baseline."""
    rows = []
    for cell in system_panel(units, n_boot, seed).cells(("leaf", "all")):
        runs, failed = cell.matrix("runs"), cell.matrix("failed")
        peak = cell.matrix("peak_memory_mb")
        for method in runs.columns:
            if not runs[method].notna().any():
                continue
            out = {
                **cell.key,
                "method": method,
                "prompts": int(runs[method].notna().sum()),
                "system_errors": int(failed[method].fillna(0).sum()),
            }
            for c in ("ttft_s", "tpot_s", "decode_tok_s", "kv_bytes", "ratio"):
                values, logs = cell.matrix(c)[method].to_numpy(float), cell.matrix(f"lr_{c}")[method].to_numpy(float)
                measured = np.isfinite(values).any()
                _put(
                    out,
                    c,
                    cell.resample.median(values) if measured else None,
                    cell.resample.geometric_mean(logs) if np.isfinite(logs).any() else None,
                    level,
                )
            value = float(peak[method].max()) if peak[method].notna().any() else math.nan
            base = float(peak[baseline].max()) if baseline in peak and peak[baseline].notna().any() else math.nan
            rel = value / base if base and base == base else math.nan
            out |= {
                "peak_memory_mb": value,
                "peak_memory_mb_low": value,
                "peak_memory_mb_high": value,
                "peak_memory_mb_rel": rel,
                "peak_memory_mb_rel_low": rel,
                "peak_memory_mb_rel_high": rel,
                "peak_memory_mb_n": out["prompts"],
            }
            rows.append(out)
    return pd.DataFrame(rows)


def _block(column: str) -> list[str]:
    return [
        column,
        f"{column}_low",
        f"{column}_high",
        f"{column}_rel",
        f"{column}_rel_low",
        f"{column}_rel_high",
        f"{column}_n",
    ]


def _skeleton(quality: pd.DataFrame | None, system: pd.DataFrame | None) -> pd.DataFrame:
    """Every model x method x protocol x category x bucket either stage measured (an outer join): a
    method only the system stage ran gets a row in each quality protocol x category of its model x
    bucket (its quality unknown), and "system prompts" where the quality stage has no category in
    that bucket."""
    parts = []
    if quality is not None:
        parts.append(quality[KEYS])
    if system is not None:
        leaf = system[system.bucket != ALL] if (system.bucket != ALL).any() else system
        cats = (
            quality[["model", "bucket", "protocol", "category"]].drop_duplicates()
            if quality is not None
            else pd.DataFrame(columns=["model", "bucket", "protocol", "category"])
        )
        sys_keys = leaf[["model", "method", "bucket"]].merge(cats, on=["model", "bucket"], how="left")
        parts.append(sys_keys.fillna({"category": SYSTEM_CATEGORY, "protocol": DEFAULT_PROTOCOL})[KEYS])
        if quality is not None:  # quality buckets the system stage did not run: its methods still get a row
            covered = set(leaf.bucket)
            other = cats[~cats.bucket.isin(covered)].merge(leaf[["model", "method"]].drop_duplicates(), on="model")
            parts.append(other[KEYS])
    return pd.concat(parts, ignore_index=True).drop_duplicates(ignore_index=True)


def _with_system(table: pd.DataFrame, system: pd.DataFrame) -> pd.DataFrame:
    """The system stage's numbers of the row's bucket, or of all its buckets where it ran none of that
    label (`system_bucket` says which)."""
    columns = [c for c in system.columns if c not in ("model", "method", "bucket")]
    own = system.rename(columns={c: f"s_{c}" for c in columns})
    merged = table.merge(own.assign(system_bucket=own.bucket), on=["model", "method", "bucket"], how="left")
    pooled = own[own.bucket == ALL].drop(columns="bucket").assign(system_bucket=ALL)
    missing = merged.system_bucket.isna()
    if missing.any() and len(pooled):
        fill = merged.loc[missing, ["model", "method"]].merge(pooled, on=["model", "method"], how="left")
        fill.index = merged.index[missing]
        merged.loc[missing, fill.columns] = fill
    return merged


def _pick_source(table: pd.DataFrame, quality_path: str, system_path: str, paired_runs: bool) -> pd.DataFrame:
    """TTFT and TPOT from the paired system runs where they exist (methods interleaved in one
    process); else, like bytes and ratio, from the quality pass where it measured both the row and
    the baseline in the cell (so the _rel columns divide like by like), else from the system stage."""
    own = table[[f"q_{c}_rel" for c in PER_SAMPLE]].notna().all(axis=1)
    chosen = {}
    for group, columns in (("timing", TIMINGS), ("bytes", ["kv_bytes", "ratio"])):
        has_system = table[[f"s_{c}" for c in columns]].notna().any(axis=1)
        use_quality = own & ~(has_system & paired_runs) if group == "timing" else own
        for c in columns:
            for part in _block(c):
                chosen[part] = table[f"q_{part}"].where(use_quality, table[f"s_{part}"])
        chosen[f"{group}_source"] = np.where(use_quality, quality_path, np.where(has_system, system_path, None))
    for c in SYSTEM_ONLY:
        for part in _block(c):
            chosen[part] = table[f"s_{part}"]
    out = table.drop(columns=[c for c in table.columns if c.startswith(("q_", "s_"))])
    return out.assign(**chosen)


def method_table(
    tables: Tables,
    baseline: str,
    n_boot: int = 1000,
    seed: int = 0,
    level: float = 0.95,
    paired: pd.DataFrame | None = None,
    prompts: tuple | None = None,
) -> pd.DataFrame:
    """One row per model x method x protocol x category x bucket that any method stage measured
    (`paired`, `prompts`: the units of kvbench.report.samples, built here when not given)."""
    paired = paired if paired is not None else paired_quality(tables, baseline)
    units, system_source, paired_runs = prompts if prompts is not None else system_units(tables, baseline)
    quality = quality_side(paired, baseline, n_boot, seed, level) if paired is not None else None
    quality = quality if quality is not None and len(quality) else None
    system = system_side(units, baseline, n_boot, seed, level) if units is not None and len(units) else None
    system = system if system is not None and len(system) else None
    columns = [
        *KEYS,
        "samples",
        "quality_errors",
        "empty_outputs",
        "prompts",
        "system_errors",
        *MEASURED,
        *(f"{c}_rel" for c in MEASURED),
        *(f"{c}_{b}" for c in MEASURED for b in BOUNDS),
        "timing_source",
        "bytes_source",
        "system_bucket",
        "sources",
    ]
    if quality is None and system is None:
        return pd.DataFrame(columns=columns)
    table = _skeleton(quality, system)
    if quality is not None:
        table = table.merge(
            quality.rename(columns={p: f"q_{p}" for c in PER_SAMPLE for p in _block(c)}), on=KEYS, how="left"
        )
    if system is not None:
        table = _with_system(table, system)
    for col in [
        *(f"q_{p}" for c in PER_SAMPLE for p in _block(c)),
        "samples",
        "quality_errors",
        "empty_outputs",
        *(p for c in QUALITY_COLUMNS for p in _block(c)),
        "s_prompts",
        "s_system_errors",
        "system_bucket",
        *(f"s_{p}" for c in [*PER_SAMPLE, *SYSTEM_ONLY] for p in _block(c)),
    ]:
        if col not in table:
            table[col] = np.nan
    table = table.rename(columns={"s_prompts": "prompts", "s_system_errors": "system_errors"})
    quality_path = CONTRACTS["quality_scores"].path
    table = _pick_source(table, quality_path, system_source or CONTRACTS["system"].path, paired_runs)
    table["sources"] = _sources(tables, "system", "system_runs", "quality_scores", "quality_fidelity")
    return table.reindex(columns=columns).sort_values(KEYS, ignore_index=True)


def corpus_table(tables: Tables, dtype: str, codec: str) -> pd.DataFrame:
    """One row per corpus: token diversity, pooled KV compression ratio (real and dummy weights,
    `dtype` + `codec`), and bytes on the wire through the serve stage with the same codec."""
    stats = tables.get("corpus_stats")
    frames = []
    if stats is not None:
        frames.append(
            stats.groupby("corpus").agg(
                docs=("doc_id", "nunique"),
                tokens_mean=("tokens", "mean"),
                unique_tokens_mean=("unique_tokens", "mean"),
                diversity_pct_mean=("diversity_pct", "mean"),
            )
        )
    kv = tables.get("kv_compressibility")
    if kv is not None:
        ratios = pooled_ratios(kv[(kv.dtype == dtype) & (kv.codec == codec)], by=["corpus", "weights"])
        frames.append(
            ratios.pivot(index="corpus", columns="weights", values="ratio")
            .add_prefix("kv_ratio_")
            .rename_axis(columns=None)
        )
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

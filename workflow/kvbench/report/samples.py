"""The units the report's statistics resample, paired with the baseline method's:

- quality: one row per model x protocol x method x task x sample, with the score and fidelity
  and, per compared quantity q, the unit difference `d_<q>` from the reference (and its weight
  `w_<q>`): score - the reference's score on the same sample; KL (the reference's is 0); top-1
  agreement - 1; first divergence - the continuation's length (identical outputs diverge after it);
  measured ratio - the reference's;
- system: one row per model x method x bucket x prompt, from the runs of the paired system stage
  (`system_runs`: the same prompt and repeat of every method ran interleaved in one process) with
  each repeat's log ratio to the baseline's run of the same round averaged over the repeats, or,
  before it existed, from the per-prompt medians of `system` (methods ran as separate jobs).

Each unit carries its source `document` (quality: the first of the sample's `doc_ids`, the answer's source; system: the
prompt's `doc_id`), which pooled cells resample (kvbench.report.cells); a unit without one is its
own document. A column absent from a stage's table (the protocol, before issue 18) is one group:
DEFAULT_PROTOCOL.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd

from kvbench.report.contracts import CONTRACTS, DEFAULT_PROTOCOL, Tables

# quantity -> (column of the paired frame, weight column or None, the reference's value)
QUANTITIES = {
    "score": ("score", None, "ref_score"),
    "kl_mean": ("kl_mean", "positions", 0.0),
    "kl_first": ("kl_first", None, 0.0),
    "top1_agreement": ("top1_agreement", "positions", 1.0),
    "first_divergence": ("first_divergence", None, "positions"),
    "ratio": ("ratio", None, "ref_ratio"),  # the measured compression ratio (bytes), the x of the frontier
}
UNIT = ["task", "sample"]
TIMED = ["ttft_s", "tpot_s", "kv_bytes", "ratio"]  # per-sample columns of the quality pass
FIDELITY = ["kl_mean", "kl_first", "top1_agreement", "first_divergence", "positions"]
SYSTEM_COLUMNS = {
    "ttft_s": "ttft_s",
    "tpot_s": "tpot_s",
    "decode_tok_s": "decode_tok_s",
    "e2e_s": "e2e_s",
    "kv_bytes": "kv_bytes_end",
    "ratio": "ratio_end",
}
CONTROL_CORPUS = "synthetic"  # the "hi hi hi" control: not a workload


def with_protocol(frame: pd.DataFrame) -> pd.DataFrame:
    protocol = frame["protocol"] if "protocol" in frame else pd.Series(np.nan, index=frame.index)
    return frame.assign(protocol=protocol.fillna(DEFAULT_PROTOCOL).astype(str))


def first_document(doc_ids: object) -> str | None:
    """The first entry of a sample's `doc_ids` (a JSON list), or None."""
    if not isinstance(doc_ids, str):
        return None
    found = json.loads(doc_ids)
    return str(found[0]) if isinstance(found, list) and found else None


def _fidelity(fidelity: pd.DataFrame | None) -> tuple[pd.DataFrame | None, list[str]]:
    if fidelity is None or not len(fidelity):
        return None, []
    fid = with_protocol(fidelity)
    for col in FIDELITY:
        if col not in fid:
            fid[col] = np.nan
    by_task = "task" in fid and fid["task"].notna().all()
    keys = ["model", "method", "protocol", *(UNIT if by_task else ["category", "sample"])]
    fid = fid[fid.kl_mean.notna() | fid.first_divergence.notna() | fid.kl_first.notna()]
    return fid[[*keys, *FIDELITY]].drop_duplicates(keys), keys


def paired_quality(tables: Tables, baseline: str) -> pd.DataFrame | None:
    """Every quality sample of every method (the baseline's too) with its reference's values."""
    scores = tables.get("quality_scores")
    if scores is None or not len(scores):
        return None
    rows = with_protocol(scores)
    rows = rows.assign(sample=rows["sample"].astype(str), failed=rows.score.isna(), empty=rows.error == "empty output")
    own = "unit:" + rows.task.astype(str) + "/" + rows["sample"]
    docs = rows.doc_ids.map(first_document) if "doc_ids" in rows else pd.Series(None, index=rows.index, dtype=object)
    docs = docs.groupby([rows.model, rows.protocol, rows.task, rows["sample"]]).transform("first")  # any row's
    rows["document"] = docs.fillna(own).astype(str)
    for col in ("kind", "params", *TIMED):
        if col not in rows:
            rows[col] = np.nan
    pair = ["model", "protocol", *UNIT]
    ref = rows[rows.method == baseline].drop_duplicates(pair).set_index(pair)
    # A sample that failed before its bucket was known takes the reference's bucket.
    where = pd.MultiIndex.from_frame(rows[pair])
    rows["bucket"] = rows.bucket.fillna(pd.Series(ref.bucket.reindex(where).to_numpy(), index=rows.index))
    rows["bucket"] = rows.bucket.fillna("-").astype(str)
    for col in ("score", *TIMED):
        rows[f"ref_{col}"] = ref[col].reindex(where).to_numpy(float)
    fid, keys = _fidelity(tables.get("quality_fidelity"))
    if fid is not None:
        fid = fid.assign(sample=fid["sample"].astype(str))
        rows = rows.merge(fid, on=keys, how="left")
    else:
        rows = rows.assign(**{col: np.nan for col in FIDELITY})
    fd = rows.first_divergence.astype(float)
    rows["first_divergence"] = fd.where(fd.notna() | rows.positions.isna(), rows.positions)
    for quantity, (column, weight, reference) in QUANTITIES.items():
        ref_value = rows[reference].astype(float) if isinstance(reference, str) else reference
        rows[f"d_{quantity}"] = rows[column].astype(float) - ref_value
        if weight:
            rows[f"w_{quantity}"] = rows[weight].astype(float).fillna(1.0).clip(lower=1.0)
    rows.loc[rows.failed, [f"d_{q}" for q in QUANTITIES]] = np.nan  # a failed sample has no paired value
    return rows.reset_index(drop=True)


def _system_rows(tables: Tables) -> tuple[pd.DataFrame | None, str, bool]:
    """(rows, source, paired in one process)."""
    runs, metrics = tables.get("system_runs"), tables.get("system")
    if runs is not None and len(runs):
        rows = runs.copy()
        if metrics is not None and len(metrics):  # bucket and length from the per-prompt table where absent
            info = metrics.drop_duplicates(["model", "prompt_id"]).set_index(["model", "prompt_id"])
            where = pd.MultiIndex.from_frame(rows[["model", "prompt_id"]])
            for col in ("bucket", "target_context"):
                known = pd.Series(info[col].reindex(where).to_numpy(), index=rows.index)
                rows[col] = rows[col].fillna(known) if col in rows else known
        return rows, CONTRACTS["system_runs"].path, True
    if metrics is not None and len(metrics):
        return metrics.assign(repeat=0, e2e_s=np.nan), CONTRACTS["system"].path, False
    return None, "", False


def system_units(tables: Tables, baseline: str) -> tuple[pd.DataFrame | None, str, bool]:
    """One row per model x method x bucket x workload prompt: the mean over its repeats of each
    column, of its log (`lg_<column>`) and of its log ratio to the baseline's run of the same
    prompt and repeat (`lr_<column>`), the repeats that paired, and the runs that failed."""
    rows, source, in_process = _system_rows(tables)
    if rows is None:
        return None, source, in_process
    rows = rows[rows.corpus != CONTROL_CORPUS].copy()
    for col in ("bucket", "target_context", "e2e_s", "peak_memory_mb"):
        if col not in rows:
            rows[col] = np.nan
    rows["bucket"] = rows.bucket.fillna("-").astype(str)
    rows = rows.rename(columns={v: k for k, v in SYSTEM_COLUMNS.items() if k != v})
    ok = rows.error.isna()
    for col in SYSTEM_COLUMNS:
        rows[col] = rows[col].astype(float).where(ok)
    # Each job runs its own baseline: a run pairs with the baseline of its own process and round.
    rows["job"] = rows["job"].astype(str) if "job" in rows else "-"
    pair = ["model", "job", "prompt_id", "repeat"]
    ref = rows[rows.method == baseline].drop_duplicates(pair).set_index(pair)
    where = pd.MultiIndex.from_frame(rows[pair])
    for col in SYSTEM_COLUMNS:
        base = ref[col].reindex(where).to_numpy(float)
        with np.errstate(invalid="ignore", divide="ignore"):
            rows[f"lr_{col}"] = np.where((rows[col] > 0) & (base > 0), np.log(rows[col].to_numpy(float) / base), np.nan)
    for col in SYSTEM_COLUMNS:
        values = rows[col].to_numpy(float)
        with np.errstate(invalid="ignore", divide="ignore"):
            rows[f"lg_{col}"] = np.where(values > 0, np.log(values), np.nan)
    docs = rows["doc_id"] if "doc_id" in rows else pd.Series(np.nan, index=rows.index)
    rows["document"] = docs.fillna("unit:" + rows.prompt_id.astype(str)).astype(str)
    rows["failed"] = (~ok).astype(int)
    rows["paired"] = rows["lr_ttft_s"].notna().astype(int)
    keys = ["model", "method", "bucket", "prompt_id"]
    agg = {
        **{c: (c, "mean") for c in SYSTEM_COLUMNS},
        **{f"{p}_{c}": (f"{p}_{c}", "mean") for p in ("lr", "lg") for c in SYSTEM_COLUMNS},
        "runs": ("repeat", "size"),
        "failed": ("failed", "sum"),
        "paired": ("paired", "sum"),
        "peak_memory_mb": ("peak_memory_mb", "max"),
        "target_context": ("target_context", "max"),
        "corpus": ("corpus", "first"),
        "document": ("document", "first"),
    }
    units = rows.groupby(keys, as_index=False, sort=True).agg(**agg)
    return units, source, in_process

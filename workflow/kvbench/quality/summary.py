"""The quality stage's tables from the per-method ones: scores, fidelity, a summary by method x
category (with an `all` row: the mean over categories), and each job's time outside forward passes."""

from __future__ import annotations

import sys

import numpy as np
import pandas as pd

FIDELITY_COLUMNS = ("kl_mean", "kl_max", "top1_agreement", "first_divergence", "fidelity_positions")
JOB_COLUMNS = ("job_wall_s", "job_forward_s", "job_cpu_s")


def _weighted(values: pd.Series, weights: pd.Series) -> float:
    ok = values.notna() & weights.notna() & (weights > 0)
    return float(np.average(values[ok], weights=weights[ok])) if ok.any() else float("nan")


def _by_category(rows: pd.DataFrame) -> dict[str, object]:
    failed = rows["score"].isna()  # an exception: no prediction to score
    ok = rows[~failed]
    compared = ok["kl_mean"].notna()
    diverged = ok.loc[compared, "first_divergence"].dropna()
    return {
        "samples": len(rows), "errors": int(failed.sum()), "empty_outputs": int((rows["error"] == "empty output").sum()),
        "score_mean": ok["score"].mean(),
        # KL and agreement pooled over every teacher-forced position, not averaged per sample
        "kl_mean": _weighted(ok["kl_mean"], ok["fidelity_positions"]),
        "top1_agreement": _weighted(ok["top1_agreement"], ok["fidelity_positions"]),
        "identical_outputs": int((compared & ok["first_divergence"].isna()).sum()),
        "first_divergence_median": float(diverged.median()) if len(diverged) else float("nan"),
        "ratio_end_mean": ok["ratio_end"].mean(), "kv_bytes_end_mean": ok["kv_bytes_end"].mean(),
        "ttft_s_median": ok["ttft_s"].median(), "tpot_s_median": ok["tpot_s"].median(),
    }


def summarize(table: pd.DataFrame, reference: str) -> dict[str, pd.DataFrame]:
    table = table.assign(**{c: np.nan for c in FIDELITY_COLUMNS if c not in table})  # only the reference ran
    job_columns = [c for c in JOB_COLUMNS if c in table]
    scores = table.drop(columns=[*FIDELITY_COLUMNS, *job_columns])
    fidelity = table.loc[table.method != reference, [
        "method", "kind", "task", "category", "sample_id", "bucket", "context_tokens", "new_tokens", *FIDELITY_COLUMNS,
        "ratio_end", "error"]].reset_index(drop=True)
    rows = []
    for (method, kind, category), group in table.groupby(["method", "kind", "category"], sort=False):
        rows.append({"method": method, "kind": kind, "category": category, **_by_category(group)})
    summary = pd.DataFrame(rows)
    overall = summary.groupby(["method", "kind"], sort=False).mean(numeric_only=True).reset_index()
    overall["category"] = "all"
    for column in ("samples", "errors", "empty_outputs"):
        overall[column] = summary.groupby(["method", "kind"], sort=False)[column].sum().to_numpy()
    summary = pd.concat([summary, overall], ignore_index=True)
    ref = summary[summary.method == reference].set_index("category")["score_mean"]
    summary["reference_score_mean"] = summary["category"].map(ref)
    summary["score_delta"] = summary["score_mean"] - summary["reference_score_mean"]
    summary["score_relative"] = summary["score_mean"] / summary["reference_score_mean"].where(summary["reference_score_mean"] > 0)
    jobs = (table.groupby("method", sort=False)
            .agg(rows=("task", "size"), errors=("score", lambda s: int(s.isna().sum())),
                 **{c: (c, "first") for c in job_columns}).reset_index())
    if job_columns:
        jobs["outside_forward_s"] = jobs["job_wall_s"] - jobs["job_forward_s"]
        jobs["outside_forward_share"] = jobs["outside_forward_s"] / jobs["job_wall_s"]
        total = jobs[["job_wall_s", "job_forward_s"]].sum()
        print(f"[quality] jobs: {total.job_wall_s:.0f} s, forward passes {total.job_forward_s:.0f} s, "
              f"outside them {1 - total.job_forward_s / total.job_wall_s:.1%}", file=sys.stderr)
    print(summary.to_string(float_format="%.3f"), file=sys.stderr)
    return {"scores": scores, "fidelity": fidelity, "summary": summary, "jobs": jobs}

"""The quality stage's tables from the per-method ones: scores, fidelity, a summary by method x
category (with an `all` row computed from the same rows, pooled over categories), and each job's
time outside forward passes.

Scores are compared with the reference on paired samples only (those both scored): a method that
fails on its hardest samples is not averaged over its easy ones against the reference's mean over
all of them. `score_mean_failures_zero` counts a failure as a score of 0."""

from __future__ import annotations

import sys

import numpy as np
import pandas as pd

FIDELITY_COLUMNS = (
    "kl_first",
    "kl_mean",
    "kl_max",
    "top1_agreement",
    "first_divergence",
    "fidelity_positions",
    "fidelity_note",
    "fidelity_reference",
    "same_output_as_reference",
)
JOB_COLUMNS = ("job_wall_s", "job_forward_s", "job_fork_s", "job_cpu_s", "job_decode_steps", "job_decode_row_steps")
# Per row of a job's table, the same for every row of the job.
RUN_COLUMNS = ("job_methods", *JOB_COLUMNS)
SAMPLE = ["task", "sample_id", "protocol"]


def _weighted(values: pd.Series, weights: pd.Series) -> float:
    ok = values.notna() & weights.notna() & (weights > 0)
    return float(np.average(values[ok].astype(float), weights=weights[ok].astype(float))) if ok.any() else float("nan")


def _summarize(rows: pd.DataFrame) -> dict[str, object]:
    """One summary row over `rows` (one method's samples; `reference_score` is the reference's
    score of the same sample, NaN where it has none)."""
    failed = rows["score"].isna()  # an exception: no prediction to score
    ok = rows[~failed]
    paired = ok[ok["reference_score"].notna()]
    compared = ok["fidelity_positions"].notna()  # a reference to compare with (possibly 0 decode positions)
    diverged = ok.loc[compared, "first_divergence"].dropna()
    reference_mean = paired["reference_score"].mean()
    return {
        "categories": rows["category"].nunique(),
        "samples": len(rows),
        "errors": int(failed.sum()),
        "empty_outputs": int((rows["error"] == "empty output").sum()),
        "score_mean": ok["score"].mean(),
        "score_mean_failures_zero": rows["score"].fillna(0.0).mean(),
        "paired_samples": len(paired),
        "paired_score_mean": paired["score"].mean(),
        "reference_score_mean": reference_mean,
        "score_delta": paired["score"].mean() - reference_mean,
        "score_relative": paired["score"].mean() / reference_mean if reference_mean > 0 else float("nan"),
        # KL and agreement pooled over every teacher-forced decode position, not averaged per sample
        "kl_mean": _weighted(ok["kl_mean"], ok["fidelity_positions"]),
        # the first answer token's distribution: 0 under query-aware by construction, the method's under context-only
        "kl_first_mean": float(ok["kl_first"].astype(float).mean()) if compared.any() else float("nan"),
        "top1_agreement": _weighted(ok["top1_agreement"], ok["fidelity_positions"]),
        "fidelity_positions": int(ok["fidelity_positions"].fillna(0).sum()),
        "identical_outputs": int(ok["same_output_as_reference"].fillna(False).astype(bool).sum()),
        "first_divergence_median": float(diverged.median()) if len(diverged) else float("nan"),
        "ratio_end_mean": ok["ratio_end"].mean(),
        "kv_bytes_end_mean": ok["kv_bytes_end"].mean(),
        "ttft_s_median": ok["ttft_s"].median(),
        "tpot_s_median": ok["tpot_s"].median(),
    }


def _jobs(table: pd.DataFrame, job_columns: list[str]) -> pd.DataFrame:
    """One row per job (the methods it ran, one after another in one process): its wall time from
    process start against the sum of its model forward passes."""
    jobs = (
        table.groupby("job_methods", sort=False)
        .agg(
            methods=("method", "nunique"),
            rows=("task", "size"),
            errors=("score", lambda s: int(s.isna().sum())),
            **{c: (c, "first") for c in job_columns},
        )
        .reset_index()
    )
    if job_columns:
        jobs["outside_forward_s"] = jobs["job_wall_s"] - jobs["job_forward_s"]
        jobs["outside_forward_share"] = jobs["outside_forward_s"] / jobs["job_wall_s"]
        total = jobs[["job_wall_s", "job_forward_s"]].sum()
        print(
            f"[quality] {len(jobs)} jobs: {total.job_wall_s:.0f} s, forward passes {total.job_forward_s:.0f} s, "
            f"outside them {1 - total.job_forward_s / total.job_wall_s:.1%}",
            file=sys.stderr,
        )
    return jobs


def summarize(table: pd.DataFrame, reference: str) -> dict[str, pd.DataFrame]:
    table = table.assign(**{c: np.nan for c in FIDELITY_COLUMNS if c not in table})  # only the reference ran
    job_columns = [c for c in JOB_COLUMNS if c in table]
    scores = table.drop(columns=[*FIDELITY_COLUMNS, *(c for c in RUN_COLUMNS if c in table)])
    fidelity = table.loc[
        table.method != reference,
        [
            "method",
            "kind",
            "params",
            "protocol",
            "task",
            "category",
            "sample_id",
            "bucket",
            "context_tokens",
            "question_tokens",
            "new_tokens",
            *FIDELITY_COLUMNS,
            "ratio_end",
            "kv_bytes_end",
            "error",
        ],
    ].reset_index(drop=True)
    ref_scores = table.loc[table.method == reference].set_index(SAMPLE)["score"]
    paired = table.join(ref_scores.rename("reference_score"), on=SAMPLE)
    rows = []
    for (method, kind, protocol), mine in paired.groupby(["method", "kind", "protocol"], sort=False):
        head = {"method": method, "kind": kind, "protocol": protocol}
        for category, group in mine.groupby("category", sort=False):
            rows.append({**head, "category": category, **_summarize(group)})
        rows.append({**head, "category": "all", **_summarize(mine)})
    summary = pd.DataFrame(rows)
    jobs = _jobs(table, job_columns)
    print(summary.to_string(float_format="%.3f"), file=sys.stderr)
    return {"scores": scores, "fidelity": fidelity, "summary": summary, "jobs": jobs}

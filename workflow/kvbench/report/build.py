"""Stage `report`: every table of the report from the stage tables that exist, and its pages."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import pandas as pd

from kvbench.report.claims import CONFIRMED, CONTRADICTED, NOT_MEASURABLE, NOT_RUN, Evidence, evaluate
from kvbench.report.contracts import CONTRACTS, STAGES, Tables
from kvbench.report.correlations import correlation_table
from kvbench.report.joined import MEASURED, corpus_table, method_table
from kvbench.report.recommend import scenarios_from_config, recommendations
from kvbench.report.render import html_page


@dataclass
class ReportTables:
    methods: pd.DataFrame
    corpora: pd.DataFrame
    correlations: pd.DataFrame
    claims: pd.DataFrame
    recommendations: pd.DataFrame
    stages: pd.DataFrame


def table_provenance(table: pd.DataFrame, prov: Mapping[str, Any]) -> dict[str, Any]:
    """The provenance columns for one report table: a table with one row per model keeps its own
    `model` column in place of the provenance one (any other clash is an error of write_table)."""
    return {k: v for k, v in prov.items() if not (k == "model" and "model" in table.columns)}


def _distinct(frames: list[pd.DataFrame], column: str) -> str:
    return ", ".join(sorted({v for f in frames if column in f for v in f[column].dropna()}))


def stage_status(tables: Tables) -> pd.DataFrame:
    rows = []
    for stage in STAGES:
        names = [n for n, c in CONTRACTS.items() if c.stage == stage]
        read = [n for n in names if tables.get(n) is not None]
        frames = [tables.get(n) for n in read]
        rows.append({
            "stage": stage, "status": "ran" if read else NOT_RUN,
            "tables": ", ".join(CONTRACTS[n].path for n in (read or names)),
            "rows": sum(len(f) for f in frames) if read else None,
            # the provenance of what was read (the table's own provenance columns are the report's)
            "source_config_hash": _distinct(frames, "config_hash"),
            "source_git_commit": _distinct(frames, "git_commit"),
        })
    return pd.DataFrame(rows)


def build(tables: Tables, cfg: Mapping[str, Any], methods: Mapping[str, dict], seed: int) -> ReportTables:
    """`cfg` is the config's `report` section, `methods` its method specs."""
    baseline = cfg["baseline"]
    joined = method_table(tables, baseline)
    corr = correlation_table(tables, cfg["bootstrap"], seed, cfg["level"])
    evidence = Evidence(tables, dict(methods), baseline, cfg["kv_dtype"], cfg["kv_codec"], joined, corr)
    return ReportTables(
        methods=joined,
        corpora=corpus_table(tables, cfg["kv_dtype"], cfg["kv_codec"]),
        correlations=corr,
        claims=evaluate(evidence),
        recommendations=recommendations(joined, scenarios_from_config(cfg["scenarios"]), baseline),
        stages=stage_status(tables),
    )


def _not_run_note(stages: pd.DataFrame) -> str:
    missing = stages[stages.status == NOT_RUN].stage.tolist()
    return f"Stages not run: {', '.join(missing)}; what depends on them says so." if missing else "Every stage ran."


def claims_page(report: ReportTables) -> str:
    note = (f"Verdicts: {CONFIRMED}, {CONTRADICTED}, {NOT_MEASURABLE} (the run is too small to test it), "
            f"{NOT_RUN} (a stage or a method it needs is missing). Each verdict follows the rule in its row; "
            "'seed_number' quotes the seed, 'ours' is computed from the source table.")
    columns = ["origin", "claim", "seed_number", "model", "ours", "verdict", "source", "rule"]
    return html_page("Seed claims, checked against this run", [
        ("Claims", note, report.claims[columns]),
        ("Stages this report read", _not_run_note(report.stages), report.stages),
    ])


def recommendations_page(report: ReportTables, baseline: str) -> str:
    recs = report.recommendations
    sections = []
    for scenario, rows in recs.groupby("scenario", sort=False):
        first = rows.iloc[0]
        note = f"{first.description} Limits: {first.limits}. Prefer: {first.prefer}."
        sections.append((f"Scenario: {scenario}", note,
                         rows[["model", "category", "bucket", "best", "runner_up", "numbers", "why"]]))
    if not sections:
        sections.append(("No scenarios", "Add scenarios under report.scenarios in the config.", None))
    shown = [c for c in ["model", "method", "category", "bucket", "samples", "prompts", "quality_errors",
                         "system_errors", *MEASURED, *(f"{c}_rel" for c in MEASURED)]
             if c in report.methods and report.methods[c].notna().any()]
    sections.append((f"The numbers behind it (per method; *_rel = / {baseline})", _not_run_note(report.stages),
                     report.methods[shown] if shown else None))
    return html_page("Which KV method for which workload", sections)


def correlations_page(report: ReportTables) -> str:
    note = ("Spearman's rho between each method's measured compression ratio and the outcome, across methods, "
            "with a percentile bootstrap interval over samples (paired: every method resampled alike).")
    return html_page("Does compression ratio predict end-to-end behaviour?", [
        ("Rank correlations", note, report.correlations if len(report.correlations) else None),
    ])


def overview_page(report: ReportTables) -> str:
    return html_page("kvbench report: stages and workloads", [
        ("Stages", _not_run_note(report.stages), report.stages),
        ("Corpora: diversity, KV compressibility, bytes on the wire",
         "Per corpus: mean token diversity, pooled KV compression ratio per weights variant at the report's "
         "dtype and codec (kv stage), and bytes on the wire through the serve stage with the same codec.",
         report.corpora.drop(columns="sources", errors="ignore") if len(report.corpora) else None),
    ])


def costs_page(costs: pd.DataFrame) -> str:
    if costs.empty:
        return html_page("Pipeline cost", [("No benchmark files", "benchmarks/ holds no TSV yet.", None)])
    costs = costs.assign(share_pct=100 * costs.share)
    shown = ["stage", "rule", "job", "jobs", "wall_s", "span_s", "share_pct", "max_rss_mb", "cpu_s", "mean_load"]
    note = ("wall_s: job-seconds (summed over the jobs), span_s: first start to last end (from file times), "
            "share_pct: of all job-seconds, max_rss_mb: the largest job. The report's own job is not in it: "
            "its benchmark is written after it ends.")
    return html_page("Pipeline cost (benchmarks/*.tsv)", [
        ("Per stage", note, costs[costs.level == "stage"][shown].drop(columns=["rule", "job"])),
        ("Per rule", "", costs[costs.level == "rule"][shown].drop(columns="job")),
        ("Per job", "", costs[costs.level == "job"][shown].drop(columns=["jobs", "span_s"])),
    ])


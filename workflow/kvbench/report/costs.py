"""Where the pipeline's time goes: the `benchmark:` TSVs every rule writes, per job, rule and stage.

Snakemake writes a job's TSV when the job ends, so a file's modification time is the job's end;
a stage's span (first start to last end) is therefore approximate, and only meaningful for the
run that wrote the files (copies lose their times).
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Mapping

import pandas as pd

STAGE_ORDER = ("models", "corpus", "kv", "system", "quality", "serve", "report")
COLUMNS = ["level", "stage", "rule", "job", "jobs", "wall_s", "span_s", "share", "max_rss_mb", "cpu_s", "mean_load"]


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    parts = re.split(r"(\{[^}]+\})", pattern)
    body = "".join(f"(?P<{p[1:-1].split(',')[0]}>.+?)" if p.startswith("{") else re.escape(p) for p in parts)
    return re.compile(body + r"\Z")


def rule_of(path: str, patterns: Mapping[str, str]) -> str:
    """The rule whose benchmark pattern matches `path` (fixed names before wildcard patterns)."""
    ranked = sorted(patterns.items(), key=lambda kv: kv[1].count("{"))
    for rule, pattern in ranked:
        if _pattern_regex(pattern).match(path):
            return rule
    return "?"


def read_benchmarks(
    workdir: str | os.PathLike,
    patterns: Mapping[str, str],
    folder: str = "benchmarks",
) -> pd.DataFrame:
    """One row per benchmark file (mean over its repeats). A file no rule of the workflow writes
    (left by a renamed or removed rule) is skipped and named: it would count a job twice."""
    rows = []
    root = Path(workdir)
    for path in sorted((root / folder).rglob("*.tsv")):
        rel = path.relative_to(root).as_posix()
        if rule_of(rel, patterns) == "?":
            print(f"pipeline cost: skipped {rel} (no rule writes it: left by an earlier version)", file=sys.stderr)
            continue
        runs = pd.read_csv(path, sep="\t", na_values=["NA", "-"])
        if runs.empty:
            continue
        wall = float(runs["s"].mean())
        end = path.stat().st_mtime
        rows.append(
            {
                "level": "job",
                "stage": path.relative_to(root / folder).parts[0] if path.parent != root / folder else "-",
                "rule": rule_of(rel, patterns),
                "job": rel[len(folder) + 1 : -len(".tsv")],
                "jobs": 1,
                "wall_s": wall,
                "max_rss_mb": float(runs["max_rss"].max()),
                "cpu_s": float(runs["cpu_time"].mean()),
                "mean_load": float(runs["mean_load"].mean()),
                "start": end - wall,
                "end": end,
            }
        )
    return pd.DataFrame(rows)


def _summarize(jobs: pd.DataFrame, by: list[str], level: str) -> pd.DataFrame:
    agg = jobs.groupby(by, as_index=False).agg(
        jobs=("job", "size"),
        wall_s=("wall_s", "sum"),
        max_rss_mb=("max_rss_mb", "max"),
        cpu_s=("cpu_s", "sum"),
        mean_load=("mean_load", "mean"),
        start=("start", "min"),
        end=("end", "max"),
    )
    agg["span_s"] = agg.end - agg.start
    agg["level"] = level
    return agg


def pipeline_cost(jobs: pd.DataFrame) -> pd.DataFrame:
    """Per job, per rule and per stage: wall time (job-seconds, summed over jobs), span, share of
    all job-seconds, max RSS."""
    if jobs.empty:
        return pd.DataFrame(columns=COLUMNS)
    jobs = jobs.assign(span_s=jobs.wall_s)
    rules = _summarize(jobs, ["stage", "rule"], "rule")
    stages = _summarize(jobs, ["stage"], "stage")
    total = float(jobs.wall_s.sum())
    table = pd.concat([stages, rules, jobs], ignore_index=True)
    table["share"] = table.wall_s / total if total else float("nan")
    levels = {"stage": 0, "rule": 1, "job": 2}
    stages = {s: i for i, s in enumerate(STAGE_ORDER)}
    table["_level"] = table.level.map(levels)
    table["_stage"] = table.stage.map(lambda s: stages.get(s, len(stages)))
    table = table.sort_values(["_level", "_stage", "wall_s"], ascending=[True, True, False], ignore_index=True)
    return table.reindex(columns=COLUMNS)

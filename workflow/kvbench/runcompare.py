"""Compare the Parquet tables of two workflow runs of one config: every column must be equal except
those that differ between any two runs (timings, memory, run ids: VOLATILE; the report's columns
computed from timings: DERIVED) and those the caller ignores (e.g. provenance, when the runs ran
different commits). Rows are matched by their compared columns, so row order does not matter; cells
are compared as text (Python's float repr round-trips, so equal text is bitwise-equal floats),
with the serve stage's run ids and the servers' ports masked (RUN_TEXT), and whatever else the
caller masks (e.g. the two commits, which the report's tables quote from their sources).

Used by bench/kill_resume.py (a killed and resumed run against an uninterrupted one) and
bench/refactor_check.py (a base commit against HEAD).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Collection, Pattern

import pandas as pd

# Differ between any two runs: wall-clock and memory measurements (and ratios of them), request
# run ids and timestamps. Every other column must be equal.
VOLATILE = re.compile(
    r"((_s|_s_std|_mb_s|_tok_s|_tok_s_std)(_median|_mean)?(_rel)?|^(peak_memory_mb|memory_increase_mb|"
    r"peak_rss_mb|max_rss_mb|mean_load|share|outside_forward_share|run_id|start|end|time|seconds)(_rel)?)$"
)
# Inside text: the serve stage's per-run id (prefix of request tags and cache salts, so no run hits
# another's cache) and the ports servers got (in connection errors of the Valkey fault round).
RUN_TEXT = (
    (re.compile(r"(^|[-.])[0-9a-f]{10}(?=[.-])"), r"\1RUN"),
    (re.compile(r"127\.0\.0\.1:\d+"), "127.0.0.1:PORT"),
)
# Columns of the report computed from timings (correlations with TTFT/TPOT, scenario picks that
# prefer speed, speed claims): allowed to differ, since the timings they read differ; the
# deterministic columns they read are compared in the stage tables.
DERIVED = {
    "results/report/correlations.parquet": ("rho", "ci_low", "ci_high"),
    "results/report/recommendations.parquet": (
        "best",
        "best_candidate",
        "runner_up",
        "best_value",
        "runner_up_value",
        "versus_runner_up",
        "versus_runner_up_low",
        "versus_runner_up_high",
        "versus_runner_up_test",
        "tied",
        "numbers",
        "why",
        "qualifying",
    ),
    "results/report/claims.parquet": ("ours", "ours_value", "verdict"),
}


Masks = Collection[tuple[Pattern[str], str]]  # (pattern, replacement) pairs applied to the text


def normalized(table: pd.DataFrame, masks: Masks = ()) -> pd.DataFrame:
    """Every cell as text, with run ids and ports replaced (see RUN_TEXT), then `masks`."""
    text = table.astype(str)
    for pattern, replacement in (*RUN_TEXT, *masks):
        text = text.replace(pattern, replacement, regex=True)
    return text


def _max_abs_difference(a: pd.Series, b: pd.Series) -> float:
    """Largest |a - b| over matched rows; infinite where only one side is missing (NaN)."""
    a, b = a.astype(float), b.astype(float)
    diff = (a - b).abs().where(a.isna() == b.isna(), math.inf)
    return float(diff.max(skipna=True)) if diff.notna().any() else 0.0


def compare_table(rel: str, a: pd.DataFrame, b: pd.DataFrame, ignore: Collection[str] = (), masks: Masks = ()) -> dict:
    """Equal when every column but the volatile, report-derived and ignored ones is equal, rows
    matched by those columns (as text). Also lists the volatile and the ignored columns that
    differ, for the record, and per differing numeric column the largest absolute difference."""
    skipped = [c for c in a.columns if VOLATILE.search(c) or c in DERIVED.get(rel, ())]
    keys = [c for c in a.columns if c not in skipped and c not in ignore]
    if list(a.columns) != list(b.columns) or len(a) != len(b):
        return {
            "rows": len(a),
            "equal": False,
            "differing_columns": "columns or row count",
            "volatile_differing": "",
            "ignored_differing": "",
            "numeric_differences": "{}",
        }
    aligned = []
    for table in (a, b):
        table = table.reset_index(drop=True)
        text = normalized(table, masks)
        order = text.sort_values(keys, kind="stable").index if keys else text.index
        aligned.append((text.loc[order].reset_index(drop=True), table.loc[order].reset_index(drop=True)))
    (a_text, a_values), (b_text, b_values) = aligned
    differing = [c for c in keys if not a_text[c].equals(b_text[c])]
    numeric = {
        c: _max_abs_difference(a_values[c], b_values[c])
        for c in differing
        if all(
            pd.api.types.is_numeric_dtype(t[c]) and not pd.api.types.is_bool_dtype(t[c]) for t in (a_values, b_values)
        )
    }
    return {
        "rows": len(a),
        "equal": not differing,
        "differing_columns": ",".join(differing),
        "volatile_differing": ",".join(c for c in skipped if not a_text[c].equals(b_text[c])),
        "ignored_differing": ",".join(
            c for c in a.columns if c in ignore and c not in skipped and not a_text[c].equals(b_text[c])
        ),
        "numeric_differences": json.dumps(numeric),
    }


def compare_runs(first: Path, second: Path, ignore: Collection[str] = (), masks: Masks = ()) -> list[dict]:
    """One row per Parquet table under results/ of either workdir (`table`: its path there)."""
    paths = {p.relative_to(run).as_posix() for run in (first, second) for p in (run / "results").rglob("*.parquet")}
    rows = []
    for rel in sorted(paths):
        if not (first / rel).exists() or not (second / rel).exists():
            rows.append(
                {
                    "table": rel,
                    "rows": None,
                    "equal": False,
                    "differing_columns": "only in one run",
                    "volatile_differing": "",
                    "ignored_differing": "",
                    "numeric_differences": "{}",
                }
            )
            continue
        tables = pd.read_parquet(first / rel), pd.read_parquet(second / rel)
        rows.append({"table": rel, **compare_table(rel, *tables, ignore, masks)})
    return rows

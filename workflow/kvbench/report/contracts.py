"""What the report reads from each stage: one contract per input table, in one place.

A contract maps the names the report uses (keys) to the columns of the stage's table (values).
When a stage renames a column, change the value here and nothing else. A table that is absent
means its stage did not run: the report says "not run" for what depends on it. A table that is
present but lacks a required column is a broken contract and stops the report with a message
naming the table and the columns.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import numpy as np
import pandas as pd

from kvbench.provenance import PROVENANCE_COLUMNS


@dataclass(frozen=True)
class Contract:
    stage: str
    path: str
    columns: Mapping[str, str]
    optional: Mapping[str, str] = field(default_factory=dict)

    def column(self, name: str) -> str:
        """The table's own column behind a report name (for the claims' source column)."""
        return {**self.columns, **self.optional}[name]


def _same(*names: str) -> dict[str, str]:
    return {n: n for n in names}


CONTRACTS: dict[str, Contract] = {
    "corpus_stats": Contract(
        "corpus", "results/corpus/stats.parquet",
        _same("corpus", "domain", "doc_id", "tokens", "unique_tokens", "diversity_pct"),
    ),
    "corpus_summary": Contract(
        "corpus", "results/corpus/stats_summary.parquet",
        _same("corpus", "domain", "docs", "tokens_mean", "diversity_pct_mean", "pooled_diversity_pct",
              "reference_diversity_pct"),
    ),
    "kv_compressibility": Contract(
        "kv", "results/kv/compressibility.parquet",
        _same("corpus", "weights", "doc_id", "dtype", "codec", "part", "raw_bytes", "compressed_bytes", "error"),
    ),
    "kv_summary": Contract(
        "kv", "results/kv/summary.parquet",
        _same("dtype", "codec", "comparison", "held_fixed", "benchmark_ratio", "realistic_ratio", "inflation"),
    ),
    "system": Contract(
        "system", "results/system/metrics.parquet",
        _same("model", "method", "prompt_id", "corpus", "target_context", "context_tokens", "bucket", "ttft_s", "tpot_s",
              "decode_tok_s", "kv_bytes_end", "ratio_end", "peak_memory_mb", "error"),
        optional=_same("ttft_s_std", "repeats"),
    ),
    # Issue 9 (quality): one row per method x task x sample (categories: see CATEGORY_* below).
    "quality_scores": Contract(
        "quality", "results/quality/scores.parquet",
        {**_same("model", "method", "task", "category", "metric", "bucket", "context_tokens", "score", "error"),
         "sample": "sample_id"},
        # Per-request timings and bytes, if the quality pass records them (issue 9, item 3).
        optional={"ttft_s": "ttft_s", "tpot_s": "tpot_s", "ratio": "ratio_end"},
    ),
    "quality_fidelity": Contract(
        "quality", "results/quality/fidelity.parquet",
        {**_same("model", "method", "category", "kl_mean", "top1_agreement", "first_divergence", "error"),
         "sample": "sample_id"},
        optional=_same("bucket"),
    ),
    # Issue 11 (serve): one row per backend x codec x corpus x round x request, and per
    # backend x codec x corpus.
    "serve_requests": Contract(
        "serve", "results/serve/requests.parquet",
        {**_same("backend", "codec", "corpus", "round", "ttft_s", "error"), "request": "request_id"},
        optional=_same("cached_tokens", "prompt_tokens"),
    ),
    "serve_offload": Contract(
        "serve", "results/serve/offload.parquet",
        _same("backend", "codec", "corpus", "raw_bytes", "wire_bytes", "ratio", "ttft_warmup_s", "ttft_query_s",
              "hits"),
        optional=_same("store_mb_s", "load_mb_s", "outputs_identical", "error"),
    ),
}

# Task category names of the quality stage that claims refer to.
CATEGORY_SUMMARIZATION = "summarization"

STAGES = ("corpus", "kv", "system", "quality", "serve")


class ContractError(ValueError):
    pass


def read_table(name: str, path: str | os.PathLike) -> pd.DataFrame:
    """The table under its report names (+ provenance columns); optional columns absent -> NA."""
    contract = CONTRACTS[name]
    table = pd.read_parquet(path)
    missing = sorted(col for col in contract.columns.values() if col not in table.columns)
    if missing:
        raise ContractError(
            f"{path}: table {name!r} (stage {contract.stage}) lacks column(s) {missing}; "
            f"adapt CONTRACTS[{name!r}] in {Path(__file__).name} if the stage renamed them"
        )
    wanted = {**contract.columns, **contract.optional}
    out = pd.DataFrame({ours: table[theirs] if theirs in table.columns else np.nan for ours, theirs in wanted.items()},
                       index=table.index)
    for col in PROVENANCE_COLUMNS:
        if col in table.columns and col not in out.columns:
            out[col] = table[col]
    return out.reset_index(drop=True)


@dataclass
class Tables:
    """The stage tables the report found; a missing name means its stage did not run."""

    frames: dict[str, pd.DataFrame]
    paths: dict[str, str]

    def get(self, name: str) -> pd.DataFrame | None:
        return self.frames.get(name)

    def has(self, *names: str) -> bool:
        return all(n in self.frames for n in names)

    def stage_ran(self, stage: str) -> bool:
        return any(CONTRACTS[n].stage == stage for n in self.frames)

    def source(self, name: str, *columns: str) -> str:
        """'path: col, col' with the tables' own column names."""
        contract = CONTRACTS[name]
        return f"{contract.path}: {', '.join(contract.column(c) for c in columns)}"


def load_tables(paths: Mapping[str, str | os.PathLike | None]) -> Tables:
    """Read every contract table given a path that exists; skip the rest (stage not run)."""
    frames, found = {}, {}
    for name, path in paths.items():
        if name not in CONTRACTS:
            raise ContractError(f"no contract for table {name!r} (known: {sorted(CONTRACTS)})")
        if path is not None and Path(path).is_file():
            frames[name] = read_table(name, path)
            found[name] = str(path)
    return Tables(frames, found)

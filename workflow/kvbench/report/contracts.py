"""What the report reads from each stage: one contract per input table, in one place.

A contract maps the names the report uses (keys) to the columns of the stage's table (values).
When a stage renames a column, change the value here and nothing else. A table that is absent
means its stage did not run: the report says "not run" for what depends on it. A table that is
present but lacks a required column is a broken contract and stops the report with a message
naming the table and the columns.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import numpy as np
import pandas as pd

from kvbench.provenance import PROVENANCE_COLUMNS


@dataclass(frozen=True)
class Contract:
    stage: str
    path: str  # may hold {model}: one table per model, read together
    columns: Mapping[str, str]
    optional: Mapping[str, str] = field(default_factory=dict)

    def column(self, name: str) -> str:
        """The table's own column behind a report name (for the claims' source column)."""
        return {**self.columns, **self.optional}[name]

    def expand(self, models: Iterable[str]) -> list[str]:
        return [self.path.format(model=m) for m in models] if "{model}" in self.path else [self.path]

    def model_of(self, path: str | os.PathLike) -> str | None:
        """The model a per-model path names (None for a path without {model})."""
        if "{model}" not in self.path:
            return None
        head, tail = (re.escape(part) for part in self.path.split("{model}", 1))
        found = re.search(f"{head}([^/]+){tail}$", Path(path).as_posix())
        return found.group(1) if found else None


def _same(*names: str) -> dict[str, str]:
    return {n: n for n in names}


CONTRACTS: dict[str, Contract] = {
    "corpus_stats": Contract(
        "corpus",
        "results/corpus/stats.parquet",
        _same("corpus", "domain", "doc_id", "tokens", "unique_tokens", "diversity_pct"),
    ),
    "kv_compressibility": Contract(
        "kv",
        "results/kv/compressibility.parquet",
        _same("corpus", "weights", "doc_id", "dtype", "codec", "part", "raw_bytes", "compressed_bytes", "error"),
    ),
    "kv_summary": Contract(
        "kv",
        "results/kv/summary.parquet",
        _same("dtype", "codec", "comparison", "held_fixed", "benchmark_ratio", "realistic_ratio", "inflation"),
    ),
    "system": Contract(
        "system",
        "results/system/metrics.parquet",
        _same(
            "model",
            "method",
            "prompt_id",
            "corpus",
            "target_context",
            "context_tokens",
            "bucket",
            "ttft_s",
            "tpot_s",
            "decode_tok_s",
            "kv_bytes_end",
            "ratio_end",
            "peak_memory_mb",
            "error",
        ),
        optional=_same("ttft_s_std", "repeats", "doc_id"),
    ),
    # Issue 18 (paired timing): per model, one row per method x prompt x repeat; the runs of one
    # (prompt, repeat) ran in one process, interleaved, so they pair with the baseline's.
    "system_runs": Contract(
        "system",
        "results/system/runs.parquet",
        _same(
            "model",
            "method",
            "prompt_id",
            "corpus",
            "repeat",
            "ttft_s",
            "tpot_s",
            "decode_tok_s",
            "kv_bytes_end",
            "ratio_end",
            "error",
        ),
        optional=_same("job", "kind", "params", "e2e_s", "bucket", "target_context", "context_tokens", "doc_id"),
    ),
    # Issue 9 (quality): per model, one row per method x task x sample (categories: CATEGORY_* below).
    "quality_scores": Contract(
        "quality",
        "results/quality/{model}/scores.parquet",
        {
            **_same("model", "method", "task", "category", "metric", "bucket", "context_tokens", "score", "error"),
            "sample": "sample_id",
        },
        # Per-sample timings and bytes of the same pass (issue 9, item 3); "empty output" rows keep
        # their score (an empty answer scores 0): only a null score is a failed sample.
        optional={
            "ttft_s": "ttft_s",
            "tpot_s": "tpot_s",
            "kv_bytes": "kv_bytes_end",
            "ratio": "ratio_end",
            **_same("protocol", "kind", "params", "doc_ids"),
        },
    ),
    "quality_fidelity": Contract(
        "quality",
        "results/quality/{model}/fidelity.parquet",
        {
            **_same("model", "method", "category", "kl_mean", "top1_agreement", "first_divergence", "error"),
            "sample": "sample_id",
        },
        # first_divergence is null where the outputs are identical: the continuation's length then.
        # protocol: absent before issue 18 (one protocol, query-aware); kl_first: the first answer token.
        optional={"bucket": "bucket", "positions": "fidelity_positions", **_same("protocol", "task", "kl_first")},
    ),
    # Issue 21 (engine quality): per model, one row per server x task x sample (task rows for a
    # task or server that failed), vLLM's own KV caches and its 16-bit reference server.
    "quality_served": Contract(
        "quality",
        "results/quality/{model}/served.parquet",
        {
            **_same("server", "kv_cache_dtype", "served_dtype", "reference_server", "task", "category", "score"),
            **_same("error", "kl_mean", "kl_first", "top1_agreement"),
            "sample": "sample_id",
            "positions": "fidelity_positions",
        },
        optional=_same("fidelity_note", "decode_kl_mean", "decode_positions", "top_k", "difference"),
    ),
    # Issue 11 (serve): per backend x codec x corpus. Bytes and ratio exist only for backends that
    # store through a codec (valkey), TTFT and hits only for rows that ran (not "unsupported").
    "serve_offload": Contract(
        "serve",
        "results/serve/offload.parquet",
        _same("backend", "codec", "corpus"),
        # status: "ok", "N requests failed" or "unsupported: ..." (a row that is no result)
        optional={
            **_same("raw_bytes", "wire_bytes", "ratio", "status", "store_mb_s", "load_mb_s", "weights"),
            "ttft_warmup_s": "ttft_warmup_mean_s",
            "ttft_query_s": "ttft_query_mean_s",
            "ttft_hit_s": "ttft_hit_mean_s",
            "hits": "query_hits",
            "outputs_identical": "outputs_identical_share",
        },
    ),
    # Issue 20 (serve): the blog's comparison on the engine, per weights x corpus x codec.
    "serve_engine": Contract(
        "serve",
        "results/serve/engine.parquet",
        _same("weights", "corpus", "codec", "served_dtype", "ratio"),
        optional=_same(
            "dtype_note",
            "predicted_ratio",
            "inflation",
            "inflation_ci_low",
            "inflation_ci_high",
            "inflation_n",
            "realistic_n",
            "inflation_draws",
        ),
    ),
}

# Task category names of the quality stage that claims refer to.
CATEGORY_SUMMARIZATION = "summarization"
# The quality stage's protocols (issue 18). Tables without a `protocol` column come from the stage
# before it, which compressed after the whole prompt: they read as this protocol.
QUERY_AWARE, CONTEXT_ONLY = "query-aware", "context-only"
DEFAULT_PROTOCOL = QUERY_AWARE

STAGES = ("corpus", "kv", "system", "quality", "serve")


class ContractError(ValueError):
    pass


def read_table(name: str, path: str | os.PathLike) -> pd.DataFrame:
    """The table under its report names (+ provenance columns); optional columns absent -> NaN.
    A per-model table without a `model` column gets the model its path names."""
    contract = CONTRACTS[name]
    table = pd.read_parquet(path)
    if "model" not in table.columns and contract.model_of(path) is not None:
        table["model"] = contract.model_of(path)
    missing = sorted(col for col in contract.columns.values() if col not in table.columns)
    if missing:
        raise ContractError(
            f"{path}: table {name!r} (stage {contract.stage}) lacks column(s) {missing}; "
            f"adapt CONTRACTS[{name!r}] in {Path(__file__).name} if the stage renamed them"
        )
    wanted = {**contract.columns, **contract.optional}
    out = pd.DataFrame(
        {ours: table[theirs] if theirs in table.columns else np.nan for ours, theirs in wanted.items()},
        index=table.index,
    )
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


PathLike = str | os.PathLike


def load_tables(paths: Mapping[str, PathLike | Sequence[PathLike] | None]) -> Tables:
    """Read every contract table given a path that exists (per-model tables: several paths, read
    together); skip the rest (stage not run)."""
    frames, found = {}, {}
    for name, given in paths.items():
        if name not in CONTRACTS:
            raise ContractError(f"no contract for table {name!r} (known: {sorted(CONTRACTS)})")
        listed = [] if given is None else [given] if isinstance(given, (str, os.PathLike)) else list(given)
        present = [str(p) for p in listed if Path(p).is_file()]
        if present:
            frames[name] = pd.concat([read_table(name, p) for p in present], ignore_index=True)
            found[name] = ", ".join(present)
    return Tables(frames, found)

"""Does the measured compression ratio predict end-to-end behaviour? Spearman's rho between each
method's measured ratio and its quality, TTFT and TPOT, across methods, per task category, with
a paired bootstrap interval over samples (the same resampled samples for every method).

The quality categories hold few samples each on a small run (below MIN_SAMPLES: no interval), so
each model also gets one row per outcome over all its categories pooled (category POOLED). Its
bootstrap resamples samples across categories (not within them: with one or two samples per
category a stratified draw would hardly vary), so differences between categories widen it.
Samples (prompts) that share a source document are resampled by document (n: `documents`; see
kvbench.report.cells), the pooled rows above all. Quality rows are per protocol. `methods_differ_p` tests whether the methods differ in the outcome
at all (kvbench.report.bootstrap.equal_means_test): where they do not, no rank correlation with
anything can be told from noise."""

from __future__ import annotations

import pandas as pd

from kvbench.report.bootstrap import equal_means_test, rng_for
from kvbench.report.contracts import CONTRACTS, DEFAULT_PROTOCOL, Tables
from kvbench.report.joined import SYSTEM_CATEGORY, workload_prompts
from kvbench.report.samples import first_document, with_protocol
from kvbench.report.stats import bootstrap_spearman

POOLED = "all categories (pooled)"
SAMPLE = ["category", "task", "sample"]


def _matrix(rows: pd.DataFrame, sample: list[str], value: str) -> pd.DataFrame:
    """samples x methods."""
    return rows.pivot_table(index=sample, columns="method", values=value, aggfunc="mean")


def _documents(rows: pd.DataFrame, sample: list[str], column: str, first: bool = False) -> pd.Series | None:
    """Each sample's source document (the first of a JSON list where `first`), by `sample`; None
    where the table has none."""
    if column not in rows or rows[column].isna().all():
        return None
    docs = rows[column].map(first_document) if first else rows[column].astype(object)
    found = rows.assign(_doc=docs).groupby(sample)["_doc"].first()
    return found.where(found.notna(), [f"unit:{i}" for i in found.index])  # no document: its own


def _broadcast(per_method: pd.Series, like: pd.DataFrame) -> pd.DataFrame:
    return pd.DataFrame(
        [per_method.reindex(like.columns).to_numpy()] * len(like), index=like.index, columns=like.columns
    )


def _quality_pairs(scores: pd.DataFrame, system: pd.DataFrame | None):
    """(model, protocol, category, outcome, source, x, y) from the quality stage: the ratio per sample
    if it recorded one, else each method's median ratio over the system stage's workload prompts.
    Every scored sample counts (an empty output scores 0); per category, and pooled per model."""
    ratio_of = None
    if system is not None:
        sys_ok = workload_prompts(system[system.error.isna()])
        ratio_of = sys_ok.groupby(["model", "method"]).ratio_end.median()
    for (model, protocol), part in with_protocol(scores).groupby(["model", "protocol"]):
        groups = [(c, rows) for c, rows in part.groupby("category")]
        if len(groups) > 1:
            groups.append((POOLED, part))
        scores_path = CONTRACTS["quality_scores"].expand([model])[0]
        for category, rows in groups:
            own_ratio = rows.ratio.notna().any()
            # Latency comes from the system stage's pairs only: the quality pass batches every method's
            # rows in one decode step, so its per-sample timings are shares of shared steps.
            for outcome, column in (("quality", "score"),):
                if rows[column].isna().all():
                    continue
                y = _matrix(rows, SAMPLE, column)
                if own_ratio:
                    x, src = _matrix(rows, SAMPLE, "ratio"), scores_path
                elif ratio_of is not None and model in ratio_of.index.get_level_values(0):
                    x = _broadcast(ratio_of[model], y)
                    src = f"{scores_path} + ratio from {CONTRACTS['system'].path}"
                else:
                    continue
                yield model, protocol, category, outcome, src, x, y, _documents(rows, SAMPLE, "doc_ids", first=True)


def _system_pairs(system: pd.DataFrame):
    rows = workload_prompts(system[system.error.isna()])
    for model, part in rows.groupby("model"):
        x = _matrix(part, ["prompt_id"], "ratio_end")
        for outcome in ("ttft_s", "tpot_s"):
            yield (
                model,
                DEFAULT_PROTOCOL,
                SYSTEM_CATEGORY,
                outcome,
                CONTRACTS["system"].path,
                x,
                _matrix(part, ["prompt_id"], outcome),
                _documents(part, ["prompt_id"], "doc_id"),
            )


def correlation_table(tables: Tables, n_boot: int, seed: int, level: float = 0.95) -> pd.DataFrame:
    scores, system = tables.get("quality_scores"), tables.get("system")
    pairs = []
    if scores is not None:
        pairs += list(_quality_pairs(scores, system))
    covered = {(m, o) for m, _, _, o, *_ in pairs}
    if system is not None:  # TTFT and TPOT from the system stage where the quality pass has none
        pairs += [p for p in _system_pairs(system) if (p[0], p[3]) not in covered]
    rows = []
    for model, protocol, category, outcome, source, x, y, documents in pairs:
        r = bootstrap_spearman(x, y, n_boot, seed, level, documents=documents)
        differ, _ = equal_means_test(
            y.to_numpy(float),
            n_boot,
            rng_for(seed, "correlations", model, protocol, category, outcome),
            None if documents is None else documents.reindex(y.index).to_numpy(object),
        )
        rows.append(
            {
                "model": model,
                "protocol": protocol,
                "category": category,
                "outcome": outcome,
                "rho": r.rho,
                "ci_low": r.ci_low,
                "ci_high": r.ci_high,
                "methods": r.n_items,
                "samples": r.n_samples,
                "documents": r.n_documents,
                "methods_differ_p": differ,
                "level": level,
                "bootstrap": n_boot,
                "bootstrap_seed": seed,
                "source": source,
            }
        )
    columns = [
        "model",
        "protocol",
        "category",
        "outcome",
        "rho",
        "ci_low",
        "ci_high",
        "methods",
        "samples",
        "documents",
        "methods_differ_p",
        "level",
        "bootstrap",
        "bootstrap_seed",
        "source",
    ]
    return pd.DataFrame(rows, columns=columns)

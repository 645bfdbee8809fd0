"""A serve recommendation per scenario: among the backend x codec configurations measured on the
load corpora (realistic documents by default, real weights), the one that meets the scenario's
`serve` limits and is best by its preferred column, at each level of the sweep (a concurrency, or
the request rate of an open-loop round).

Columns: `ttft_hit_p90_s` (hits), `goodput_rps` (requests per second of round time whose TTFT is
within `ttft_slo` x recompute's median TTFT at the lowest closed-loop concurrency, an absolute
target; at an open-loop level it cannot exceed the offered rate), `wire_bytes_per_token`
(bytes the store holds per cached token), `outputs_identical` (hits answering as recompute).
A limit with `relative: true` divides by recompute's value at the same level (none where that is 0). A column a
configuration did not measure (recompute and prefix store nothing) cannot meet a limit on it.
The pick is printed only when the bootstrap interval of best minus runner-up excludes 0;
otherwise `undecided at n=...`. Beside it: Kendall's tau between the realistic and synthetic
rankings by wire ratio over the codecs whose size depends on the data (lossless compressors);
fixed-size formats rank alike by construction and are left out.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np
import pandas as pd

from kvbench.report.stats import kendall_tau
from kvbench.serve.intervals import LEVEL, RESAMPLES
from kvbench.serve.names import is_lossless
from kvbench.serve.summary import effective_hits, with_rate

COLUMNS = ("ttft_hit_p90_s", "goodput_rps", "wire_bytes_per_token", "outputs_identical")
NONE = "none qualifies"
LEVEL_KEY = ["concurrency", "rate_rps"]  # a load level: requests in flight, and the open-loop rate (0: closed loop)


def data_dependent(codec: str) -> bool:
    """A format whose size depends on the data: a lossless compressor (not `none`)."""
    return is_lossless(codec) and codec != "none"


def wire_rank_agreement(engine: pd.DataFrame) -> tuple[float, int]:
    """Kendall's tau between the realistic and synthetic documents' wire ratios (real weights)
    over the codecs whose size depends on the data, from the engine table (every stored codec
    of every cell)."""
    if engine.empty or "ratio" not in engine:
        return math.nan, 0
    sel = engine[(engine.weights == "real") & engine.codec.map(data_dependent).astype(bool)]
    table = sel.pivot_table(index="codec", columns="corpus", values="ratio")
    if not {"realistic", "synthetic"} <= set(table.columns):
        return math.nan, 0
    return kendall_tau(table.realistic, table.synthetic)


def _draws(values: np.ndarray, statistic, rng: np.random.Generator) -> np.ndarray:
    if len(values) == 0:
        return np.full(RESAMPLES, np.nan)
    return np.array([statistic(values[rng.integers(0, len(values), len(values))]) for _ in range(RESAMPLES)])


def busy_s(group: pd.DataFrame) -> float:
    """Seconds a cell's requests took: each of its rounds' first start to last end, summed (an
    interleaved level asks a cell's plan in several rounds, other cells' between them)."""
    if group.empty:
        return math.nan
    rounds = group.groupby("block") if "block" in group else [(0, group)]
    return float(sum(r.end.max() - r.start.min() for _, r in rounds))


def candidates(
    requests: pd.DataFrame, offload: pd.DataFrame, corpora: list[str], block_size: int, slo: float, seed: int
) -> tuple[pd.DataFrame, dict[tuple, dict[str, np.ndarray]]]:
    """One row per backend x codec x level (concurrency and request rate: 0 in a closed-loop round)
    with every column, and per row the bootstrap draws of each column (for the pick's interval)."""
    query = with_rate(requests)
    query = query[(query["round"] == "query") & (query.weights == "real") & query.corpus.isin(corpora)]
    if query.empty:
        return pd.DataFrame(), {}
    closed = query[query.rate_rps == 0]
    lowest = closed.concurrency.min()
    ref = closed[(closed.backend == "recompute") & (closed.concurrency == lowest)].ttft_s.median()
    slo_s = slo * ref if ref == ref else math.nan
    rng = np.random.default_rng(seed)
    rows, draws = [], {}
    for (backend, codec, level, rate), group in query.groupby(["backend", "codec", *LEVEL_KEY], sort=False):
        hits = group[effective_hits(group, backend)]
        span = busy_s(group)
        good = (group.ttft_s <= slo_s).to_numpy(float)
        ttft = hits.ttft_s.dropna().to_numpy(float)
        same = hits.output_matches_recompute.astype("Float64").dropna().to_numpy(float)
        wire = offload[
            (offload.backend == backend)
            & (offload.codec == codec)
            & (offload.weights == "real")
            & offload.corpus.isin(corpora)
        ]
        per_token = (
            wire.wire_bytes.sum() / (wire.stored_chunks.sum() * block_size)
            if "stored_chunks" in wire and wire.stored_chunks.sum() > 0
            else math.nan
        )
        key = (backend, codec, int(level), float(rate))
        rows.append(
            {
                "backend": backend,
                "codec": codec,
                "concurrency": int(level),
                "rate_rps": float(rate),
                "requests": len(group),
                "hits": len(hits),
                "ttft_hit_p90_s": float(np.percentile(ttft, 90)) if len(ttft) else math.nan,
                "goodput_rps": good.sum() / span if span else math.nan,
                "ttft_slo_s": slo_s,
                "wire_bytes_per_token": per_token,
                "outputs_identical": float(same.mean()) if len(same) else math.nan,
            }
        )
        draws[key] = {
            "ttft_hit_p90_s": _draws(ttft, lambda v: np.percentile(v, 90), rng),
            "goodput_rps": _draws(good, lambda v: v.sum() / span, rng),
            "wire_bytes_per_token": np.full(RESAMPLES, per_token),  # measured bytes, not sampled
            "outputs_identical": _draws(same, np.mean, rng),
        }
    table = pd.DataFrame(rows)
    for column in COLUMNS:
        base = table[table.backend == "recompute"].set_index(LEVEL_KEY)[column]
        levels = pd.MultiIndex.from_frame(table[LEVEL_KEY])
        ref = base.reindex(levels).to_numpy()
        # no ratio to a recompute that measured nothing, or none within the target (goodput 0 past capacity)
        table[f"{column}_rel"] = table[column].to_numpy() / np.where(ref > 0, ref, np.nan)
    return table, draws


def _met(row: Mapping[str, Any], limits: Mapping[str, Mapping[str, Any]]) -> list[str]:
    missed = []
    for column, spec in limits.items():
        value = row.get(f"{column}_rel" if spec.get("relative") else column)
        for bound, op in (("min", np.greater_equal), ("max", np.less_equal)):
            if bound in spec and not (value == value and op(value, spec[bound])):
                missed.append(
                    f"{column} {bound} {spec[bound]:g}{' x recompute' if spec.get('relative') else ''} "
                    f"({'not measured' if value != value else f'{value:.3g}'})"
                )
    return missed


def recommend(
    requests: pd.DataFrame,
    offload: pd.DataFrame,
    scenarios: Mapping[str, Mapping[str, Any]],
    corpora: list[str],
    block_size: int,
    seed: int,
    engine: pd.DataFrame,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(one row per scenario x level, the candidates table behind it)."""
    tau, n_tau = wire_rank_agreement(engine)
    out, behind = [], []
    for name, scenario in scenarios.items():
        serve = scenario.get("serve")
        if not serve:
            continue
        table, draws = candidates(requests, offload, corpora, block_size, float(serve.get("ttft_slo", 1.0)), seed)
        if table.empty:
            continue
        ((order, prefer),) = serve["prefer"].items()
        table = table.assign(
            scenario=name, missed=[", ".join(_met(r, serve.get("limits", {}))) for r in table.to_dict("records")]
        )
        behind.append(table)
        for (level, rate), cell in table.groupby(LEVEL_KEY):
            ok = cell[(cell.missed == "") & cell[prefer].notna()].sort_values(prefer, ascending=order == "min")
            row = {
                "scenario": name,
                "concurrency": int(level),
                "rate_rps": float(rate),
                "prefer": f"{order} {prefer}",
                "candidates": len(cell),
                "qualifying": len(ok),
                "wire_rank_tau": tau,
                "wire_rank_n": n_tau,
                "level": LEVEL,
            }
            label = lambda r: r.backend if r.codec == "-" else f"{r.backend} {r.codec}"  # noqa: E731
            if ok.empty:
                closest = cell.assign(k=cell.missed.str.count(",")).sort_values("k").iloc[0]
                out.append({**row, "best": NONE, "why": f"closest {label(closest)} misses {closest.missed}"})
                continue
            best = ok.iloc[0]
            row |= {"best_candidate": label(best), "best_value": best[prefer]}
            if len(ok) == 1:
                out.append(
                    {
                        **row,
                        "best": label(best),
                        "why": f"the only one within every limit ({prefer} {best[prefer]:.3g})",
                    }
                )
                continue
            runner = ok.iloc[1]
            diff = (
                draws[(best.backend, best.codec, best.concurrency, best.rate_rps)][prefer]
                - draws[(runner.backend, runner.codec, runner.concurrency, runner.rate_rps)][prefer]
            )
            tail = 100 * (1 - LEVEL) / 2
            low, high = np.nanpercentile(diff, [tail, 100 - tail]) if np.isfinite(diff).any() else (math.nan, math.nan)
            decided = (low > 0 or high < 0) or (low == high == best[prefer] - runner[prefer] != 0)
            n = f"n={int(best.requests)}+{int(runner.requests)}"
            row |= {
                "runner_up": label(runner),
                "runner_up_value": runner[prefer],
                "diff_ci_low": low,
                "diff_ci_high": high,
                "best": label(best) if decided else f"undecided at {n}",
                "why": (
                    f"{label(best)} {prefer} {best[prefer]:.3g} vs {label(runner)} {runner[prefer]:.3g}: "
                    f"difference [{low:.3g}, {high:.3g}] ({LEVEL:.0%}, {n})" + ("" if decided else ", includes 0")
                ),
            }
            out.append(row)
    columns = [
        "scenario",
        "concurrency",
        "rate_rps",
        "best",
        "best_candidate",
        "best_value",
        "runner_up",
        "runner_up_value",
        "diff_ci_low",
        "diff_ci_high",
        "level",
        "why",
        "prefer",
        "qualifying",
        "candidates",
        "wire_rank_tau",
        "wire_rank_n",
    ]
    most = {}  # per scenario: configurations at its fullest level (the lowest runs every codec)
    for row in out:
        most[row["scenario"]] = max(most.get(row["scenario"], 0), row["candidates"])
    for row in out:  # a level that ran fewer (serve.load.codecs) picks among those only: say so
        if row["candidates"] < most[row["scenario"]]:
            row["why"] += f"; among the {row['candidates']} of {most[row['scenario']]} configurations run at this level"
    return (
        pd.DataFrame(out).reindex(columns=columns),
        pd.concat(behind, ignore_index=True) if behind else pd.DataFrame(),
    )

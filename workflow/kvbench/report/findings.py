"""The headline findings of the front page, each a sentence rendered from its table (with its
interval where the table has one: kvbench.report.blocks.interval), never typed by hand.

A finding is one function registered with `@finding(name, *tables)`: it takes the tables (paths
under results/) and returns the sentence; the README holds it between
`<!-- generated:NAME -->` markers, and `make readme` renders it. A table that lacks the rows a
finding reads gives a sentence that says so, not a guess.
"""

from __future__ import annotations

from typing import Any, Callable

import pandas as pd

from kvbench.report.blocks import Block, interval
from kvbench.report.render import fmt

FINDINGS: dict[str, Block] = {}


def finding(name: str, *tables: str) -> Callable[[Callable[..., str]], Callable[..., str]]:
    def register(render: Callable[..., str]) -> Callable[..., str]:
        FINDINGS[name] = Block(render, tables, inline=True)
        return render

    return register


def _times(value: float) -> str:
    return f"{fmt(value)}×"


@finding("finding-diversity", "corpus/stats_summary.parquet")
def diversity(t: pd.DataFrame) -> str:
    rows = {f"{r.corpus} {r.domain}" if r.corpus != r.domain else r.corpus: r for r in t.itertuples()}
    if "synthetic" not in rows or len(rows) < 2:
        return "not measured in this snapshot (`corpus/stats_summary.parquet` lacks the synthetic or another corpus)"
    shown = [
        f"{name} {fmt(r.diversity_pct_mean)} % ({fmt(r.tokens_mean)} tokens a document)" for name, r in rows.items()
    ]
    return "token diversity (distinct tokens ÷ tokens of a document, mean per corpus): " + ", ".join(shown)


def _kv_row(t: pd.DataFrame, dtype: str, benchmark: str, realistic: str = "realistic+real") -> pd.Series | None:
    found = t[
        (t.dtype == dtype)
        & (t.codec == "zstd-3")
        & (t.benchmark_setting == benchmark)
        & (t.realistic_setting == realistic)
    ]
    return None if found.empty else found.iloc[0]


@finding("finding-kv", "kv/summary.parquet")
def kv_inflation(t: pd.DataFrame) -> str:
    dummy = _kv_row(t, "bf16", "realistic+dummy")
    if dummy is None:
        return "not measured in this snapshot (no bf16 zstd-3 dummy-vs-real row in `kv/summary.parquet`)"
    text = (
        f"at bf16, zstd-3 compresses the KV cache of realistic documents {_times(dummy.realistic_ratio)} with real "
        f"weights and {_times(dummy.benchmark_ratio)} with dummy weights: dummy weights inflate the ratio "
        f"{_times(dummy.inflation)}"
    )
    if pd.notna(dummy.get("layer_inflation")):
        text += f" ({_times(dummy.layer_inflation)} with each layer compressed alone)"
    repetitive = _kv_row(t, "bf16", "synthetic+real")
    if repetitive is not None:
        text += f"; repetitive input with real weights inflates it {_times(repetitive.inflation)}"
    fp32 = _kv_row(t, "fp32", "realistic+dummy")
    if fp32 is not None:
        text += f"; at fp32 dummy weights inflate it {_times(fp32.inflation)}"
    return text


@finding("finding-wire", "serve/offload.parquet")
def wire(t: pd.DataFrame) -> str:
    valkey = t[(t.backend == "valkey") & (t.codec != "all") & t.ratio.notna()]
    if "weights" in valkey:  # real weights: the dummy-weights cells are the engine finding's
        valkey = valkey[valkey.weights == "real"]
    lossless, lossy = valkey[valkey.predicted_ratio.notna()], valkey[valkey.predicted_ratio.isna()]
    if lossless.empty:
        return "not measured in this snapshot (no lossless valkey row in `serve/offload.parquet`)"
    worst = (lossless.ratio / lossless.predicted_ratio - 1).abs().max()

    def same(rows: pd.DataFrame) -> str:
        compared = rows.outputs_compared.fillna(0)
        return f"{int(round((rows.outputs_identical_share.fillna(0) * compared).sum()))} of {int(compared.sum())}"

    text = (
        f"through vLLM and Valkey, every lossless codec's measured wire ratio lies within "
        f"{fmt(100 * worst)} % of the kv stage's prediction ({len(lossless)} codec × corpus cells), and "
        f"{same(lossless)} cache hits answered exactly as recompute did"
    )
    if not lossy.empty:
        text += f"; through the lossy wire formats ({', '.join(dict.fromkeys(lossy.codec))}) {same(lossy)} did"
    return text


@finding("finding-engine", "serve/engine.parquet")
def engine(t: pd.DataFrame) -> str:
    """The blog's comparison on the serving engine, for zstd-3 (the kv finding's codec)."""
    cells = t[t.codec == "zstd-3"].set_index(["weights", "corpus"])
    if ("dummy", "synthetic") not in cells.index or ("real", "realistic") not in cells.index:
        return "not measured in this snapshot (no zstd-3 dummy+synthetic and real+realistic rows in `serve/engine.parquet`)"
    bench, real = cells.loc[("dummy", "synthetic")], cells.loc[("real", "realistic")]
    return (
        f"on vLLM at {bench.served_dtype}, zstd-3 shrinks the KV chunks our connector sends to Valkey "
        f"{_times(real.ratio)} with real weights on realistic documents (kv stage: {_times(real.predicted_ratio)}) and "
        f'{_times(bench.ratio)} with dummy weights on "hi hi hi" documents (kv stage: '
        f"{_times(bench.predicted_ratio)}): the benchmark setting inflates the ratio {_times(bench.inflation)}"
        f"{interval(bench, 'inflation')} (95 %, {bench.inflation_n} vs {bench.realistic_n} documents)"
    )


@finding("finding-overhead", "serve/offload.parquet")
def overhead(t: pd.DataFrame) -> str:
    """TTFT with our connector over recompute's, real weights: the warm-up storing every codec
    and each codec's misses, with their verdicts against the budget."""
    if "overhead_verdict" not in t:
        return "not measured in this snapshot (`serve/offload.parquet` has no overhead_verdict)"
    rows = t[(t.backend == "valkey") & (t.weights == "real") & t.overhead_verdict.fillna("").ne("")]
    warm, misses = rows[rows.codec == "all"], rows[(rows.codec != "all") & (rows.corpus == "realistic")]
    if warm.empty or misses.empty:
        return "not measured in this snapshot (no real-weights warm-up or realistic misses in `serve/offload.parquet`)"
    shown = [
        f"{r.corpus} {fmt(r.warmup_vs_recompute)}{interval(r._asdict(), 'warmup_vs_recompute')} ({r.overhead_verdict}"
        + (f", on [{fmt(r.verdict_ci_low)}, {fmt(r.verdict_ci_high)}] against either prefix pass)" if _hull(r) else ")")
        for r in warm.itertuples(index=False)
    ]
    codecs = t[(t.backend == "valkey") & (t.weights == "real") & (t.codec != "all")].codec.nunique()
    misses = misses.assign(verdict=misses.overhead_verdict.str.split(" at ").str[0])
    tally = "; ".join(
        f"{verdict} for "
        + ", ".join(
            f"{r.codec} {fmt(r.miss_vs_recompute)}{interval(r._asdict(), 'miss_vs_recompute')} "
            f"({r.overhead_verdict.split(' at ')[1]})"
            for r in group.itertuples(index=False)
        )
        for verdict, group in misses.groupby("verdict", sort=True)
    )
    control = t[(t.backend == "prefix") & (t.weights == "real") & (t.corpus == "realistic")]
    if "miss_vs_recompute" in control and control.miss_vs_recompute.notna().any():
        c = control[control.miss_vs_recompute.notna()].iloc[0]
        units = c.get("miss_vs_recompute_units", c.miss_vs_recompute_n)
        blocks = f" in {units:.0f} blocks" if units == units and units != c.miss_vs_recompute_n else ""
        tally += (
            f"; the control, vLLM's prefix-cache misses (nothing offloaded: the drift and noise left), "
            f"{fmt(c.miss_vs_recompute)}{interval(c, 'miss_vs_recompute')} (n={c.miss_vs_recompute_n:.0f}{blocks})"
        )
    return (
        f"TTFT with our connector over a recompute's (geometric mean of paired ratios), warm-up storing all "
        f"{codecs} codecs in the background: {', '.join(shown)}; misses on realistic documents (each storing "
        f"its codec): {tally} (95 % intervals, budget {fmt(rows.overhead_budget.iloc[0])}×)"
    )


def _hull(r: Any) -> bool:
    """The warm-up's verdict read an interval of its own (the hull over the prefix warm-up's passes)."""
    low, high = getattr(r, "verdict_ci_low", None), getattr(r, "verdict_ci_high", None)
    return (
        low is not None and low == low and (low, high) != (r.warmup_vs_recompute_ci_low, r.warmup_vs_recompute_ci_high)
    )


FIDELITY_PAIRS = (("kivi2", "kivi4"), ("turboquant3", "turboquant4"), ("snapkv", "snapkv50"))


@finding("finding-fidelity", "quality/*/summary.parquet")
def fidelity(t: pd.DataFrame) -> str:
    parts = []
    if "protocol" not in t:
        t = t.assign(protocol="query-aware")
    for (model, protocol), rows in t[t.category == "all"].groupby(["model", "protocol"], sort=False):
        rows = rows.set_index("method")
        pairs = [
            f"{a} {fmt(rows.loc[a].kl_mean)}{interval(rows.loc[a], 'kl_mean')} vs {b} "
            f"{fmt(rows.loc[b].kl_mean)}{interval(rows.loc[b], 'kl_mean')}"
            for a, b in FIDELITY_PAIRS
            if a in rows.index and b in rows.index
        ]
        if not pairs:
            continue
        first = ""
        if "kl_first_mean" in rows and protocol != "query-aware":  # query-aware: exact by construction
            lossy = rows.kl_first_mean.dropna()
            if len(lossy):
                first = (
                    f"; KL at the first answer token from {fmt(lossy.min())} ({lossy.idxmin()}) to "
                    f"{fmt(lossy.max())} ({lossy.idxmax()})"
                )
        reference = rows.loc[rows.kl_mean.isna()]
        scored = (
            (
                f"; `{reference.index[0]}`'s own task score is {fmt(reference.score_mean.iloc[0])} over "
                f"{int(reference.samples.iloc[0])} samples"
            )
            if len(reference)
            else ""
        )
        parts.append(f"{model}, {protocol}: KL(full ‖ method) per decode position, {'; '.join(pairs)}{first}{scored}")
    return " — ".join(parts) or "not measured in this snapshot (the quality summary has no pair of FIDELITY_PAIRS)"


@finding("finding-ratio-predicts", "report/correlations.parquet")
def ratio_predicts(t: pd.DataFrame) -> str:
    rows = t[(t.category == "all categories (pooled)") & t.rho.notna()]
    if rows.empty:
        return "not measured in this snapshot (no pooled correlation in `report/correlations.parquet`)"
    parts = []
    for r in rows.itertuples():
        if pd.isna(r.ci_low):
            verdict = "no interval"
        else:
            verdict = "inconclusive" if r.ci_low <= 0 <= r.ci_high else "the interval excludes 0"
        span = "" if pd.isna(r.ci_low) else f" [{r.ci_low:+.2f}, {r.ci_high:+.2f}]"
        protocol = f"{r.protocol}, " if "protocol" in rows and rows.protocol.nunique() > 1 else ""
        parts.append(f"{protocol}with {r.outcome} ρ {r.rho:+.2f}{span} ({verdict})")
    first = rows.iloc[0]
    level = f"{fmt(100 * first.level)} % bootstrap intervals, " if "level" in rows else ""
    counted = f"{int(first.samples)} samples"
    if "documents" in rows and first.documents < first.samples:  # resampled by document (before: no column)
        counted = f"{int(first.documents)} documents, {counted}"
    return (
        f"Spearman's ρ of the measured ratio across {int(first.methods)} methods, pooled over categories "
        f"({level}{counted}): " + "; ".join(parts)
    )

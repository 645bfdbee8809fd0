"""The seeds' claims, checked against this run's tables.

Each claim is one function registered with @claim: it reads the evidence (the stage tables, the
per-sample and per-prompt units with their baseline pairs, the joined method table) and returns a
Finding per model (and protocol, for quality claims): our number, the test its verdict rests on
(kvbench.report.decide: what is compared, the statistic, its bootstrap interval, n, MDE), the table
and columns it came from, and the rule. The verdicts of all claims are decided together: Holm's
adjustment over the family, then `confirmed` / `contradicted` only where the adjusted p-value is
below alpha and the interval excludes the null; `inconclusive` otherwise. `not measurable at this
scale` is left for a run that cannot test a claim at all (prompts too short, a size the config
fixes), `not run` for a missing stage or method. The seed's own number is a quotation of the seed
(the blog or the paper explainer), the only typed figure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import pandas as pd

from kvbench.report.bootstrap import Estimate, Resample, equal_means_test, rng_for
from kvbench.report.cells import DOCUMENT, Cell, Panel, quality_panel
from kvbench.report.contracts import CATEGORY_SUMMARIZATION, Tables
from kvbench.report.decide import (
    CONFIRMED,
    CONTRADICTED,
    INCONCLUSIVE,
    Test,
    band_test,
    extreme_test,
    family_levels,
    family_threshold_test,
    no_interval,
    threshold_test,
    verdicts,
)
from kvbench.report.stats import MIN_METHODS, kendall_tau, kendall_tau_rows, spearman_rows

NOT_MEASURABLE = "not measurable at this scale"
NOT_RUN = "not run"
VERDICTS = (CONFIRMED, CONTRADICTED, INCONCLUSIVE, NOT_MEASURABLE, NOT_RUN)

# The paper's four method families: claims about "the best/most X method" compare these.
SEED_KINDS = ("kivi", "turboquant", "snapkv", "cam")
LONG_CONTEXT_TOKENS = 4096  # the paper's long-context regime starts around LongBench's 4K+
NOISE_FLOOR = 0.05  # a TTFT or throughput difference below 5 % is not one a reader needs resolved
INPUT_INFLATION = 1.10  # "repetitive input inflates": at least 10 % better ratio
WEIGHTS_INFLATION = 2.0  # "dummy weights ... far better": at least twice the ratio
DIVERSITY_FOLD = 100.0  # "hundreds of times more diverse": at least 100x
CAM_VARIATION = 1.5  # "varies with the workload": a max/min realized ratio of 1.5 ...
CAM_SPREAD = math.log(CAM_VARIATION) / 4  # ... over +-2 SD of log ratio: SD 0.10 more than a fixed budget
PREDICTS_RHO = 0.7  # ratio "predicts" an outcome: |rho| >= 0.7
RANKS_AGREE_TAU = 0.8  # rankings agree: Kendall's tau >= 0.8 (at most 10 % of pairs swap)
SCORE_FLOOR = 0.05  # a category where the baseline scores below this has no relative quality
QUALITY_EFFECT = 0.05  # relative quality: 5 % of the baseline's score
RANK_EFFECT = 0.1  # rank statistics: 0.1 of rho or tau


@dataclass
class Evidence:
    tables: Tables
    methods: dict[str, dict[str, Any]]  # the config's method specs, by name
    baseline: str
    kv_dtype: str
    kv_codec: str
    method_table: pd.DataFrame
    correlations: pd.DataFrame
    paired: pd.DataFrame | None = None  # kvbench.report.samples.paired_quality
    units: pd.DataFrame | None = None  # kvbench.report.samples.system_units
    n_boot: int = 1000
    seed: int = 0
    level: float = 0.95


@dataclass
class Finding:
    verdict: str | None  # None: decided by `test` with the family (kvbench.report.decide.verdicts)
    ours: str
    source: str
    rule: str
    model: str = "-"
    value: float = math.nan  # our headline number, for tables that quote it
    protocol: str = "-"
    test: Test | None = field(default=None, repr=False)


@dataclass(frozen=True)
class Claim:
    id: str
    seed: str
    text: str
    seed_number: str
    check: Callable[[Evidence], list[Finding]]


CLAIMS: dict[str, Claim] = {}


def claim(id: str, seed: str, text: str, seed_number: str):
    def register(fn: Callable[[Evidence], Finding | list[Finding]]):
        def check(ev: Evidence) -> list[Finding]:
            found = fn(ev)
            return found if isinstance(found, list) else [found]

        CLAIMS[id] = Claim(id, seed, text, seed_number, check)
        return fn

    return register


COLUMNS = [
    "claim_id",
    "origin",
    "claim",
    "seed_number",
    "model",
    "protocol",
    "ours",
    "ours_value",
    "verdict",
    "compared",
    "statistic",
    "estimate",
    "ci_low",
    "ci_high",
    "null",
    "n",
    "unit",
    "n_units",
    "mde",
    "effect",
    "n_needed",
    "p_value",
    "p_holm",
    "family",
    "level",
    "source",
    "rule",
]


def evaluate(ev: Evidence) -> pd.DataFrame:
    found = [(c, f) for c in CLAIMS.values() for f in c.check(ev)]
    tests = [f.test if f.verdict is None else None for _, f in found]
    decided, adjusted = verdicts(tests, ev.level)
    levels = family_levels(tests, ev.level)
    family = sum(1 for t in tests if t is not None and t.p_value == t.p_value)
    rows = []
    for (c, f), verdict, test, p_holm, at in zip(found, decided, tests, adjusted, levels):
        row = {
            "claim_id": c.id,
            "origin": c.seed,
            "claim": c.text,
            "seed_number": c.seed_number,
            "model": f.model,
            "protocol": f.protocol,
            "ours": f.ours,
            "ours_value": f.value,
            "verdict": verdict or f.verdict,
            "source": f.source,
            "rule": f.rule,
            "level": ev.level,
        }
        if test is not None:
            iv = test.interval
            row |= {
                "compared": test.compared,
                "statistic": test.statistic,
                "estimate": iv.estimate,
                "ci_low": iv.low,
                "ci_high": iv.high,
                "null": iv.null,
                "n": iv.n,
                "unit": test.counted,
                "n_units": iv.n if iv.n_units is None else iv.n_units,
                "mde": test.mde(at),
                "effect": test.effect,
                "n_needed": test.n_needed(at),
                "p_value": test.p_value,
                "p_holm": p_holm,
                "family": family if test.p_value == test.p_value else 0,
            }
            if verdict == INCONCLUSIVE:
                row["ours"] = f"{f.ours}; inconclusive at n = {iv.n} {test.counted}: {test.describe()}"
        rows.append(row)
    return pd.DataFrame(rows, columns=COLUMNS)


def _models(*frames: pd.DataFrame | None) -> list[str]:
    found = set()
    for frame in frames:
        if frame is not None and len(frame):
            found |= set(frame.model.dropna())
    return sorted(found)


def _named(ev: Evidence, kind: str, **settings: Any) -> list[str]:
    return [
        name
        for name, spec in ev.methods.items()
        if spec.get("kind") == kind and all(spec.get(k) == v for k, v in settings.items())
    ]


def _family(ev: Evidence, name: str) -> str | None:
    return ev.methods.get(name, {}).get("kind")


def _families(ev: Evidence, names: pd.Index | pd.Series, kinds: tuple[str, ...] = SEED_KINDS) -> np.ndarray:
    """Mask of the names whose kind is one of `kinds` (np.array: safe on empty frames)."""
    return np.array([_family(ev, n) in kinds for n in names], dtype=bool)


def _fmt(x: float) -> str:
    return "n/a" if x != x else f"{x:.3g}"


def _ci(est: Estimate, level: float, transform: Callable[[float], float] = lambda v: v) -> str:
    iv = est.interval(level)
    if iv.low != iv.low:
        return f"{_fmt(transform(est.estimate))} (n = {est.n}: no interval)"
    return f"{_fmt(transform(est.estimate))} [{_fmt(transform(iv.low))}, {_fmt(transform(iv.high))}]"


def _doc_resample(ev: Evidence, groups: list[np.ndarray], *key: object) -> Resample:
    """Documents resampled within each group (their rows in order, group after group)."""
    return Resample.of([len(g) for g in groups], ev.n_boot, rng_for(ev.seed, "documents", *key))


# --- the blog ("hi hi hi") ------------------------------------------------------------------


@claim(
    "token-diversity",
    "blog",
    'A "hi hi hi" document has 2 unique tokens; realistic medical and legal documents are hundreds of '
    "times more diverse",
    "0.02 % (2 unique tokens of ~10K) vs corpus means 14.2 % medical, 9.4 % legal: 'hundreds of times' more",
)
def token_diversity(ev: Evidence) -> Finding:
    src = ev.tables.source("corpus_stats", "corpus", "domain", "tokens", "unique_tokens", "diversity_pct")
    rule = (
        f"diversity falls with length, so at equal length: the least diverse realistic domain's mean "
        f"diversity / that of a synthetic document of the domain's mean length (its unique tokens / that "
        f"length), bootstrap over the realistic documents within each domain; confirmed if the interval lies "
        f"above {DIVERSITY_FOLD:g}x, contradicted if below; not measurable if documents are too short to show it"
    )
    stats = ev.tables.get("corpus_stats")
    if stats is None:
        return Finding(NOT_RUN, "stage corpus not run", src, rule)
    synthetic = stats[stats.corpus == "synthetic"]
    realistic = stats[stats.corpus == "realistic"].sort_values(["domain", "doc_id"], ignore_index=True)
    if synthetic.empty or realistic.empty:
        return Finding(NOT_MEASURABLE, "needs both the synthetic and the realistic corpus", src, rule)
    domains = realistic.groupby("domain").agg(diversity=("diversity_pct", "mean"), tokens=("tokens", "mean"))
    unique = float(synthetic.unique_tokens.median())
    groups = [np.flatnonzero(realistic.domain == d) for d in domains.index]
    r = _doc_resample(ev, groups, "token-diversity")
    folds = []
    for d, rows in zip(domains.index, groups):
        mask = np.isin(np.arange(len(realistic)), rows)
        div = r.mean(np.where(mask, realistic.diversity_pct, np.nan))
        tokens = r.mean(np.where(mask, realistic.tokens, np.nan))
        scale = 100 * unique  # a synthetic document of T tokens has diversity 100 * unique / T %
        folds.append(Estimate(div.estimate * tokens.estimate / scale, div.draws * tokens.draws / scale, div.n))
    worst = Estimate(
        min(f.estimate for f in folds), np.min(np.vstack([f.draws for f in folds]), axis=0), min(len(g) for g in groups)
    )  # n: the smallest domain's documents
    ours = (
        f"{_fmt(synthetic.diversity_pct.mean())} % ({unique:.0f} unique tokens in "
        f"{synthetic.tokens.mean():.0f}) vs "
        + ", ".join(f"{_fmt(row.diversity)} % {d} ({row.tokens:.0f} tokens)" for d, row in domains.iterrows())
        + f": {worst.estimate:.0f}x at equal length"
    )
    if domains.tokens.min() < DIVERSITY_FOLD * unique:
        return Finding(
            NOT_MEASURABLE, ours + " (documents too short for a 100x difference)", src, rule, value=worst.estimate
        )
    test = threshold_test(
        "least diverse realistic domain vs a synthetic document of its length",
        f"diversity fold (null {DIVERSITY_FOLD:g}x)",
        worst,
        DIVERSITY_FOLD,
        ev.level,
        "documents",
        RANK_EFFECT * DIVERSITY_FOLD,
    )
    return Finding(None, ours, src, rule, value=worst.estimate, test=test)


def _doc_bytes(kv: pd.DataFrame, corpus: str, weights: str, dtype: str, codec: str) -> pd.DataFrame:
    """Raw and compressed bytes per document (K and V together, rows without an error)."""
    rows = kv[
        (kv.corpus == corpus) & (kv.weights == weights) & (kv.dtype == dtype) & (kv.codec == codec) & kv.error.isna()
    ]
    return rows.groupby("doc_id")[["raw_bytes", "compressed_bytes"]].sum()


def _inflation_estimate(ev: Evidence, bench: tuple[str, str], real: tuple[str, str], *key: object) -> Estimate | None:
    """Pooled ratio (total raw / total compressed) of the benchmark-style setting over the realistic
    one's, documents resampled (paired where both settings hold the same documents)."""
    kv = ev.tables.get("kv_compressibility")
    if kv is None:
        return None
    b, r = (_doc_bytes(kv, *setting, ev.kv_dtype, ev.kv_codec) for setting in (bench, real))
    if b.empty or r.empty:
        return None
    if bench[0] == real[0]:  # same corpus, other weights: the same documents, paired
        docs = b.index.intersection(r.index)
        groups, b, r = [np.arange(len(docs))], b.loc[docs], r.loc[docs]
        vectors = [v.to_numpy(float) for v in (b.raw_bytes, b.compressed_bytes, r.raw_bytes, r.compressed_bytes)]
    else:  # two corpora: independent documents, each resampled within its own
        nb, nr = len(b), len(r)
        groups = [np.arange(nb), np.arange(nb, nb + nr)]
        pad_b, pad_r = np.full(nr, np.nan), np.full(nb, np.nan)
        vectors = [
            np.r_[b.raw_bytes, pad_b],
            np.r_[b.compressed_bytes, pad_b],
            np.r_[pad_r, r.raw_bytes],
            np.r_[pad_r, r.compressed_bytes],
        ]
    res = _doc_resample(ev, groups, *key)
    bench_ratio, real_ratio = res.ratio(vectors[0], vectors[1]), res.ratio(vectors[2], vectors[3])
    return Estimate(
        bench_ratio.estimate / real_ratio.estimate,
        bench_ratio.draws / real_ratio.draws,
        min(bench_ratio.n, real_ratio.n),
    )


def _inflation(
    ev: Evidence, comparison: str, held: str, threshold: float, what: str, bench: tuple[str, str], real: tuple[str, str]
) -> Finding:
    src = (
        ev.tables.source(
            "kv_compressibility", "corpus", "weights", "doc_id", "dtype", "codec", "raw_bytes", "compressed_bytes"
        )
        + "; "
        + ev.tables.source("kv_summary", "comparison", "inflation")
    )
    rule = (
        f"{what} (pooled raw / compressed bytes) at {ev.kv_dtype}, {ev.kv_codec}, bootstrap over documents; "
        f"confirmed if the interval lies above {threshold:g}x, contradicted if below"
    )
    summary = ev.tables.get("kv_summary")
    est = _inflation_estimate(ev, bench, real, comparison, held)
    if summary is None and est is None:
        return Finding(NOT_RUN, "stage kv not run", src, rule)
    row = (
        summary[
            (summary.comparison == comparison)
            & (summary.held_fixed == held)
            & (summary.dtype == ev.kv_dtype)
            & (summary.codec == ev.kv_codec)
        ]
        if summary is not None
        else pd.DataFrame()
    )
    if est is None and row.empty:
        return Finding(NOT_MEASURABLE, f"no {comparison} ({held}) rows at {ev.kv_dtype}, {ev.kv_codec}", src, rule)
    if est is None:  # the summary alone: a point, no documents to resample
        r = row.iloc[0]
        ours = (
            f"{_fmt(r.benchmark_ratio)}x vs {_fmt(r.realistic_ratio)}x ({held}): {what} {_fmt(r.inflation)}x "
            "(no per-document table: no interval)"
        )
        test = no_interval(
            f"{comparison} ({held})",
            f"{what} (null {threshold:g}x)",
            float(r.inflation),
            0,
            ev.level,
            "documents",
            RANK_EFFECT * threshold,
            threshold,
        )
        return Finding(None, ours, src, rule, value=float(r.inflation), test=test)
    ours = f"{what} {_ci(est, ev.level)}x ({ev.kv_dtype}, {ev.kv_codec}, {held}) over {est.n} documents"
    test = threshold_test(
        f"{comparison} ({held})",
        f"{what} (null {threshold:g}x)",
        est,
        threshold,
        ev.level,
        "documents",
        RANK_EFFECT * threshold,
    )
    return Finding(None, ours, src, rule, value=est.estimate, test=test)


@claim(
    "dummy-weights-inflate",
    "blog",
    "Dummy weights make KV caches compress far better than trained weights do",
    "not quantified: 'very good' ratios with dummy weights, 'changed completely' with Qwen3-8B-FP8",
)
def dummy_weights_inflate(ev: Evidence) -> Finding:
    return _inflation(
        ev,
        "dummy_vs_real",
        "corpus=realistic",
        WEIGHTS_INFLATION,
        "dummy / real ratio",
        ("realistic", "dummy"),
        ("realistic", "real"),
    )


@claim(
    "repetitive-input-inflates",
    "blog",
    "Repetitive input makes KV caches compress better than realistic text does",
    "not quantified: regular activations 'look better than reality'",
)
def repetitive_input_inflates(ev: Evidence) -> Finding:
    return _inflation(
        ev,
        "synthetic_vs_realistic",
        "weights=real",
        INPUT_INFLATION,
        "synthetic / realistic ratio",
        ("synthetic", "real"),
        ("realistic", "real"),
    )


def _codec_tau(ev: Evidence, kv: pd.DataFrame) -> tuple[Estimate | None, int]:
    """Kendall's tau between the codecs ranked by pooled ratio on synthetic and on realistic input
    (real weights), documents resampled within each corpus; (None, codecs) below MIN_METHODS codecs."""
    rows = kv[(kv.weights == "real") & (kv.dtype == ev.kv_dtype) & (kv.codec != "none") & kv.error.isna()]
    per = rows.groupby(["corpus", "doc_id", "codec"])[["raw_bytes", "compressed_bytes"]].sum()
    corpora = ("synthetic", "realistic")
    if not set(corpora) <= set(per.index.get_level_values("corpus")):
        return None, 0
    codecs = sorted(set.intersection(*(set(per.loc[c].index.get_level_values("codec")) for c in corpora)))
    if len(codecs) < MIN_METHODS:
        return None, len(codecs)
    tables = {c: per.loc[c].unstack("codec")[["raw_bytes", "compressed_bytes"]] for c in corpora}
    sizes = [len(tables[c]) for c in corpora]
    res = _doc_resample(ev, [np.arange(n) for n in sizes], "hi-ranks-wrong")
    ratios = {}
    for i, corpus in enumerate(corpora):
        before, after = sum(sizes[:i]), sum(sizes[i + 1 :])
        ests = []
        for codec in codecs:
            raw, comp = (
                np.r_[np.full(before, np.nan), tables[corpus][(part, codec)].to_numpy(float), np.full(after, np.nan)]
                for part in ("raw_bytes", "compressed_bytes")
            )
            ests.append(res.ratio(raw, comp))
        ratios[corpus] = (np.array([e.estimate for e in ests]), np.column_stack([e.draws for e in ests]))
    point = kendall_tau_rows(ratios["synthetic"][0][None], ratios["realistic"][0][None])[0]
    draws = kendall_tau_rows(ratios["synthetic"][1], ratios["realistic"][1])
    return Estimate(float(point), draws, min(sizes)), len(codecs)  # n: the smaller corpus's documents


def _serve_tau(offload: pd.DataFrame, value: str, data_dependent: bool = False) -> tuple[float, int]:
    """Backend x codec configurations ranked by `value`, synthetic vs realistic, real weights
    ("unsupported" rows and partial failures left out); `data_dependent`: only codecs whose size
    depends on the data (fixed-size formats rank alike by construction)."""
    from kvbench.serve.recommend import data_dependent as sized_by_data

    weights = offload.get("weights", pd.Series("real", index=offload.index)).fillna("real")
    ok = offload[(offload.status.isna() | (offload.status == "ok")) & (weights == "real")]
    if data_dependent:
        ok = ok[ok.codec.map(sized_by_data).astype(bool)]
    table = ok.groupby(["backend", "codec", "corpus"])[value].mean().unstack("corpus")
    if not {"synthetic", "realistic"} <= set(table.columns):
        return math.nan, 0
    return kendall_tau(table.synthetic, table.realistic)


@claim(
    "hi-ranks-wrong",
    "blog",
    'Benchmarks on "hi hi hi" rank connectors, codecs and backends on a workload nobody runs',
    "not quantified: comparing on 'hi hi hi' only ranks them on a workload nobody runs",
)
def hi_ranks_wrong(ev: Evidence) -> Finding:
    rule = (
        f"Kendall's tau-b between the codecs ranked by pooled KV ratio on synthetic and on realistic input "
        f"(kv stage, real weights), bootstrap over the documents of each corpus; confirmed if the interval lies "
        f"below {RANKS_AGREE_TAU:g} (more than 10 % of pairs swap), contradicted if above. The serve stage's "
        "wire-ratio (real weights, codecs whose size depends on the data) and hit-TTFT taus are shown, not "
        "decisive: its table has no per-document rows to resample"
    )
    kv, offload = ev.tables.get("kv_compressibility"), ev.tables.get("serve_offload")
    source = "; ".join(
        [
            ev.tables.source(
                "kv_compressibility", "corpus", "weights", "doc_id", "dtype", "codec", "raw_bytes", "compressed_bytes"
            ),
            ev.tables.source("serve_offload", "weights", "backend", "codec", "corpus", "ratio", "ttft_hit_s", "status"),
        ]
    )
    if kv is None and offload is None:
        return Finding(NOT_RUN, "no KV compressibility table (stage kv) and no serve stage", source, rule)
    shown = []
    if offload is not None:
        for what, column, sized in (
            ("codecs sized by the data, by wire ratio (serve)", "ratio", True),
            ("backend x codec by hit TTFT (serve)", "ttft_hit_s", False),
        ):
            tau, n = _serve_tau(offload, column, data_dependent=sized)
            shown.append(f"{what}: tau {_fmt(tau)} over {n}")
    else:
        shown.append("serve: not run")
    if kv is None:
        return Finding(NOT_MEASURABLE, "; ".join(shown) + " (kv stage not run: nothing to resample)", source, rule)
    est, codecs = _codec_tau(ev, kv)
    if est is None:
        return Finding(
            NOT_MEASURABLE,
            f"codecs by KV ratio: {codecs} ranked on both corpora (fewer than {MIN_METHODS}); " + "; ".join(shown),
            source,
            rule,
        )
    ours = f"codecs by KV ratio (kv stage, real weights, {ev.kv_dtype}): tau {_ci(est, ev.level)} over {codecs}; "
    test = threshold_test(
        "codec ranking by KV ratio, synthetic vs realistic input",
        f"Kendall's tau-b (null {RANKS_AGREE_TAU:g})",
        est,
        RANKS_AGREE_TAU,
        ev.level,
        "documents",
        RANK_EFFECT,
    )
    # agreement confirms the seed's opposite: the test's direction is flipped
    test = Test(
        test.compared,
        test.statistic,
        test.interval,
        test.p_value,
        -test.direction,
        test.supports,
        test.unit,
        test.effect,
    )
    return Finding(None, ours + "; ".join(shown), source, rule, value=est.estimate, test=test)


@claim(
    "dummy-weights-inflate-on-the-engine",
    "blog",
    'On the serving engine, dummy weights and "hi hi hi" documents make the offloaded KV look far more '
    "compressible than real weights and realistic documents",
    "not quantified: 'very good' ratios through a Valkey connector with dummy weights, 'changed completely' "
    "with Qwen3-8B-FP8",
)
def dummy_weights_inflate_on_the_engine(ev: Evidence) -> Finding:
    src = ev.tables.source(
        "serve_engine",
        "weights",
        "corpus",
        "codec",
        "served_dtype",
        "ratio",
        "inflation",
        "inflation_n",
        "realistic_n",
        "inflation_draws",
    )
    rule = (
        f"wire ratio of what our connector stored (dummy weights, synthetic documents) / (real weights, "
        f"realistic documents), {ev.kv_codec}, at the dtype vLLM served, bootstrap over the two cells' "
        f"documents (the serve stage's draws); confirmed if the interval lies above {WEIGHTS_INFLATION:g}x, "
        f"contradicted if below"
    )
    engine = ev.tables.get("serve_engine")
    if engine is None:
        return Finding(NOT_RUN, "stage serve not run", src, rule)
    row = engine[(engine.codec == ev.kv_codec) & engine.inflation.notna()]
    if row.empty:
        return Finding(
            NOT_MEASURABLE,
            f"no dummy+synthetic vs real+realistic cells for {ev.kv_codec} "
            "(serve.weights needs dummy, serve.corpora both)",
            src,
            rule,
        )
    r = row.iloc[0]
    n = min(int(r.inflation_n), int(r.realistic_n))  # n: the smaller cell's documents
    draws = r.inflation_draws
    est = (
        Estimate(float(r.inflation), np.asarray(draws, float), n)
        if draws is not None and not (isinstance(draws, float) and draws != draws)
        else None
    )
    what = "dummy+synthetic / real+realistic wire ratio"
    ours = (
        f"{what} {_ci(est, ev.level) if est is not None else _fmt(r.inflation) + ' (no draws: no interval)'}x "
        f"({ev.kv_codec}, served {r.served_dtype}) over {int(r.inflation_n)} and {int(r.realistic_n)} documents"
    )
    if isinstance(r.dtype_note, str) and r.dtype_note:
        ours += f"; {r.dtype_note}"
    compared, statistic = f"the engine's wire ratio, {ev.kv_codec}", f"{what} (null {WEIGHTS_INFLATION:g}x)"
    if est is None:
        test = no_interval(
            compared,
            statistic,
            float(r.inflation),
            n,
            ev.level,
            "documents",
            RANK_EFFECT * WEIGHTS_INFLATION,
            WEIGHTS_INFLATION,
        )
    else:
        test = threshold_test(
            compared, statistic, est, WEIGHTS_INFLATION, ev.level, "documents", RANK_EFFECT * WEIGHTS_INFLATION
        )
    return Finding(None, ours, src, rule, value=float(r.inflation), test=test)


# --- the paper (KIVI / TurboQuant / SnapKV / CaM) ---------------------------------------------


def _quality_cells(ev: Evidence) -> list[Cell]:
    """One cell per model x protocol over every category and bucket (resampled within each where each
    holds enough samples: kvbench.report.cells.STRATUM_MIN)."""
    if ev.paired is None or not len(ev.paired):
        return []
    return list(quality_panel(ev.paired, ev.n_boot, ev.seed).cells(("all",)))


def _category_quality(ev: Evidence, cell: Cell, methods: list[str]) -> tuple[dict[str, dict[str, Estimate]], str, list]:
    """Per method x category: relative quality (the method's mean score / the baseline's, paired by
    sample) in the categories where the baseline scores at least SCORE_FLOOR; where it scores below
    that everywhere, top-1 agreement with it (fidelity) instead. Also the column used and the
    categories left out."""
    score, r = cell.matrix("score"), cell.resample
    categories = cell.units.category.to_numpy()
    base = score[ev.baseline].to_numpy(float) if ev.baseline in score else np.full(len(categories), np.nan)
    kept, dropped = [], []
    for c in sorted(set(categories)):
        mean = np.nanmean(np.where(categories == c, base, np.nan)) if np.isfinite(base[categories == c]).any() else 0
        (kept if mean >= SCORE_FLOOR else dropped).append(c)
    out: dict[str, dict[str, Estimate]] = {}
    if kept:
        for m in methods:
            v = score[m].to_numpy(float)
            out[m] = {
                c: r.ratio(np.where(categories == c, v, np.nan), np.where(categories == c, base, np.nan)) for c in kept
            }
        return out, "relative quality", dropped
    top1, weights = cell.matrix("top1_agreement"), cell.matrix("positions")
    if not top1.notna().any().any():
        return {}, "", dropped
    for m in methods:
        if m in top1 and top1[m].notna().any():
            v, w = top1[m].to_numpy(float), weights[m].fillna(1.0).clip(lower=1.0).to_numpy(float)
            out[m] = {c: r.mean(np.where(categories == c, v, np.nan), w) for c in sorted(set(categories))}
    return out, "top1_agreement", []


def _n_units(ests: list[Estimate]) -> int | None:
    """The fewest samples behind estimates whose n counts documents (None where n counts samples)."""
    counts = [e.n_units for e in ests]
    return None if None in counts else min(counts)


def _lowest(per: dict[str, Estimate]) -> Estimate:
    """The lowest of `per` (per draw), restrictable to fewer units as its parts are (a difference of
    two methods' lowest is then on the samples both have)."""
    ests = list(per.values())
    whole = all(e.mask is not None and e.restrict for e in ests)
    return Estimate(
        min(e.estimate for e in ests),
        np.min(np.vstack([e.draws for e in ests]), axis=0),
        min(e.n for e in ests),
        n_units=_n_units(ests),
        mask=np.logical_or.reduce([e.mask for e in ests]) if whole else None,
        restrict=(lambda mask: _lowest({k: e.restrict(mask) for k, e in per.items()})) if whole else None,
    )


def _listed(
    estimates: dict[str, Estimate], level: float, higher: bool = True, transform: Callable[[float], float] = lambda v: v
) -> str:
    order = sorted(estimates, key=lambda k: -estimates[k].estimate if higher else estimates[k].estimate)
    return ", ".join(f"{k} {_ci(estimates[k], level, transform)}" for k in order)


@claim(
    "kivi4-most-stable",
    "paper",
    "KIVI (4-bit) has the most stable quality across tasks",
    "not quantified: KIVI 'rarely makes mistakes' across tasks; the safest default (no bit width given)",
)
def kivi4_most_stable(ev: Evidence) -> list[Finding]:
    rule = (
        f"per method of the paper's four families: its worst category's relative quality (mean score / the "
        f"baseline's on the same samples; categories where the baseline scores < {SCORE_FLOOR:g} left out; top-1 "
        "agreement with the baseline where it scores below that everywhere); paired differences between a 4-bit "
        "KIVI and every other method on one bootstrap of the samples (within each category x bucket where each "
        "holds 20 or more; n: the smallest category's samples): "
        "confirmed if it exceeds every one, contradicted if another exceeds it"
    )
    kivi4 = _named(ev, "kivi", bits=4)
    src = ev.tables.source("quality_scores", "method", "category", "score") + " (relative to the baseline)"
    if not ev.tables.stage_ran("quality"):
        return [Finding(NOT_RUN, "stage quality not run", src, rule)]
    if not kivi4:
        return [Finding(NOT_RUN, "no 4-bit KIVI method in the config", src, rule)]
    out = []
    for cell in _quality_cells(ev):
        model, protocol = cell.key["model"], cell.key["protocol"]
        score = cell.matrix("score")
        methods = [m for m in score.columns if m != ev.baseline and _family(ev, m) in SEED_KINDS]
        per, column, dropped = _category_quality(ev, cell, methods)
        worst = {m: _lowest(cats) for m, cats in per.items() if cats}
        if column == "top1_agreement":
            src = ev.tables.source("quality_fidelity", "method", "category", "top1_agreement")
        family = [m for m in kivi4 if m in worst]
        rivals = [m for m in worst if m not in family]
        if not family or not rivals:
            why = (
                "the baseline scores 0 and no fidelity rows"
                if not column
                else f"no {column} for {kivi4[0]}"
                if not family
                else "fewer than 2 methods of the four families measured"
            )
            out.append(Finding(NOT_MEASURABLE, why, src, rule, model, protocol=protocol))
            continue
        ours = f"worst-category {column}: {_listed(worst, ev.level)}"
        if dropped:
            ours += f" (left out, the baseline scores < {SCORE_FLOOR:g}: {', '.join(dropped)})"
        test = extreme_test(
            f"{'/'.join(family)} vs each other method of the four families",
            f"paired difference of the worst category's {column}",
            worst,
            family,
            rivals,
            True,
            ev.level,
            "samples",
            QUALITY_EFFECT,
        )
        out.append(Finding(None, ours, src, rule, model, worst[family[0]].estimate, protocol, test))
    return out


def _system_cell(ev: Evidence, units: pd.DataFrame, tag: str) -> Cell | None:
    cells = list(Panel(units, ["model"], ["prompt_id"], ["bucket"], ev.n_boot, ev.seed, tag).cells(("all",)))
    return cells[0] if cells else None


def _per_method(cell: Cell, column: str, methods: list[str]) -> dict[str, Estimate]:
    values = cell.matrix(column)
    return {
        m: cell.resample.mean(values[m].to_numpy(float)) for m in methods if m in values and values[m].notna().any()
    }


def _system_models(ev: Evidence) -> list[str]:
    return _models(ev.units) if ev.units is not None else []


def _system_source(ev: Evidence, *columns: str) -> str:
    name = "system_runs" if ev.tables.has("system_runs") else "system"
    return ev.tables.source(name, "method", "prompt_id", *columns)


@claim(
    "snapkv-long-context-throughput",
    "paper",
    "SnapKV gives the best long-context throughput",
    "not quantified: SnapKV is the 'champion' for speed on long documents",
)
def snapkv_throughput(ev: Evidence) -> list[Finding]:
    src = _system_source(ev, "target_context", "decode_tok_s")
    rule = (
        f"decode tok/s on the workload prompts of >= {LONG_CONTEXT_TOKENS} tokens: the geometric mean over "
        "prompts of each method's speed over the baseline's in the same process and round (repeats averaged on "
        "the log scale), paired differences of its log between a SnapKV method and every method of the other three families, bootstrap over prompts; "
        "confirmed if a SnapKV method is faster than every one, contradicted if another is faster than every "
        "SnapKV method"
    )
    if ev.units is None:
        return [Finding(NOT_RUN, "stage system not run", src, rule)]
    out = []
    for model in _system_models(ev):
        units = ev.units[(ev.units.model == model) & _families(ev, ev.units.method)]
        longest = int(units.target_context.max()) if units.target_context.notna().any() else 0
        units = units[units.target_context >= min(longest, LONG_CONTEXT_TOKENS)]
        cell = _system_cell(ev, units, "snapkv-throughput") if len(units) else None
        # Each method's log speed ratio to the baseline of its own process and round: a difference
        # of two such ratios cancels drift between processes (one job per method on clusters).
        speed = _per_method(cell, "lr_decode_tok_s", sorted(units.method.unique())) if cell else {}
        if not speed:
            out.append(Finding(NOT_MEASURABLE, "no measured prompts", src, rule, model))
            continue
        ours = f"at {longest} tokens, decode tok/s / baseline's: {_listed(speed, ev.level, transform=math.exp)}"
        if longest < LONG_CONTEXT_TOKENS:
            out.append(Finding(NOT_MEASURABLE, ours + f" (longest prompt < {LONG_CONTEXT_TOKENS})", src, rule, model))
            continue
        family = [m for m in speed if _family(ev, m) == "snapkv"]
        rivals = [m for m in speed if _family(ev, m) != "snapkv"]
        if not family or not rivals:
            out.append(Finding(NOT_MEASURABLE, ours + " (needs SnapKV and another family)", src, rule, model))
            continue
        test = extreme_test(
            f"{'/'.join(family)} vs each method of the other families",
            "paired difference of log decode tok/s ratio to baseline",
            speed,
            family,
            rivals,
            True,
            ev.level,
            "prompts",
            math.log1p(NOISE_FLOOR),
        )
        out.append(Finding(None, ours, src, rule, model, math.exp(max(speed[m].estimate for m in family)), test=test))
    return out


@claim(
    "turboquant-ttft-overhead",
    "paper",
    "TurboQuant has the highest TTFT overhead (KIVI, SnapKV and CaM barely change TTFT)",
    "not quantified: TurboQuant 'keeps the user waiting longer'",
)
def turboquant_ttft(ev: Evidence) -> list[Finding]:
    src = _system_source(ev, "ttft_s")
    rule = (
        "TTFT overhead: the geometric mean over prompts of TTFT / the baseline's TTFT in the same process and "
        "round (paired runs; repeats averaged on the log scale), every bucket, bootstrap over prompts; paired "
        "differences of its log between a TurboQuant method and every method of the other three families: "
        "confirmed if a TurboQuant method's is higher than every one, contradicted if another's is higher than "
        "every TurboQuant method's"
    )
    if ev.units is None:
        return [Finding(NOT_RUN, "stage system not run", src, rule)]
    out = []
    for model in _system_models(ev):
        units = ev.units[(ev.units.model == model) & _families(ev, ev.units.method)]
        cell = _system_cell(ev, units, "turboquant-ttft") if len(units) else None
        over = _per_method(cell, "lr_ttft_s", sorted(units.method.unique())) if cell else {}
        family = [m for m in over if _family(ev, m) == "turboquant"]
        rivals = [m for m in over if _family(ev, m) != "turboquant"]
        ours = "TTFT / baseline: " + (_listed(over, ev.level, transform=math.exp) if over else "none paired")
        if not family or not rivals:
            out.append(
                Finding(
                    NOT_MEASURABLE,
                    ours + " (needs TurboQuant and another family, paired with the baseline)",
                    src,
                    rule,
                    model,
                )
            )
            continue
        test = extreme_test(
            f"{'/'.join(family)} vs each method of the other families",
            "paired difference of log(TTFT / baseline TTFT)",
            over,
            family,
            rivals,
            True,
            ev.level,
            "prompts",
            math.log1p(NOISE_FLOOR),
        )
        out.append(Finding(None, ours, src, rule, model, math.expm1(max(over[m].estimate for m in family)), test=test))
    return out


# A CaM setting that fixes how many tokens it keeps: its ratio at one length is then set by the config.
CAM_SIZE_KEYS = ("keep_ratio", "capacity", "target")


def _spread(cell: Cell, method: str) -> Estimate:
    """Standard deviation over prompts of log(measured ratio)."""
    x = cell.matrix("lg_ratio")[method].to_numpy(float)
    m1, m2 = cell.resample.mean(x), cell.resample.mean(x * x)
    return Estimate(
        math.sqrt(max(m2.estimate - m1.estimate**2, 0.0)), np.sqrt(np.clip(m2.draws - m1.draws**2, 0, None)), m1.n
    )


@claim(
    "cam-ratio-varies",
    "paper",
    "CaM's realized compression varies with the workload",
    "not quantified: large savings on some days, none at all on others",
)
def cam_ratio_varies(ev: Evidence) -> list[Finding]:
    src = _system_source(ev, "corpus", "target_context", "ratio_end")
    rule = (
        f"spread over the workload prompts at one context length (the longest) of each CaM method's measured "
        f"ratio (SD of its log) minus the largest spread of a fixed-budget control (snapkv), bootstrap over "
        f"prompts; confirmed if some CaM method's interval lies above {CAM_SPREAD:.2f} (a max/min of "
        f"{CAM_VARIATION:g} over +-2 SD), contradicted if every one lies below; not measurable if the config fixes "
        f"CaM's kept size ({', '.join(CAM_SIZE_KEYS)}): the ratio at a given length is then set by construction"
    )
    cams = [m for m in ev.methods if _family(ev, m) == "cam"]
    if ev.units is None or not cams:
        return [
            Finding(NOT_RUN, "stage system not run" if ev.units is None else "no CaM method in the config", src, rule)
        ]
    controls = [m for m in ev.methods if _family(ev, m) == "snapkv"]
    out = []
    for model in _system_models(ev):
        units = ev.units[(ev.units.model == model) & ev.units.method.isin(cams + controls)]
        units = units[units.target_context == units.target_context.max()] if len(units) else units
        mine = units[units.method.isin(cams) & units.ratio.notna()]
        if mine.empty:
            out.append(Finding(NOT_MEASURABLE, "no CaM rows without an error", src, rule, model))
            continue
        span = units[units.ratio.notna()].groupby("method").ratio.agg(["min", "max", "size"])
        at = int(mine.target_context.iloc[0]) if mine.target_context.notna().any() else 0
        ours = f"at {at} tokens: " + "; ".join(
            f"{m}{' (control)' if m in controls else ''}: {_fmt(r['min'])}x-{_fmt(r['max'])}x over "
            f"{r['size']:.0f} prompts"
            for m, r in span.iterrows()
        )
        fixed = sorted({f"{m}: {k}" for m in span.index if m in cams for k in CAM_SIZE_KEYS if k in ev.methods[m]})
        cam_fold = float((span["max"] / span["min"])[span.index.isin(cams)].max())
        if fixed:
            out.append(
                Finding(
                    NOT_MEASURABLE,
                    ours + f" (kept size fixed by the config: {', '.join(fixed)})",
                    src,
                    rule,
                    model,
                    cam_fold,
                )
            )
            continue
        cell = _system_cell(ev, units, "cam-ratio")
        present = [m for m in span.index]
        control = [_spread(cell, m) for m in present if m in controls]
        base = (
            Estimate(
                max(c.estimate for c in control),
                np.max(np.vstack([c.draws for c in control]), axis=0),
                min(c.n for c in control),
            )
            if control
            else None
        )
        theta = {m: (_spread(cell, m) - base) if base else _spread(cell, m) for m in present if m in cams}
        ours += f"; spread over the control's: {_listed(theta, ev.level)}"
        test = family_threshold_test(
            "each CaM method vs the fixed-budget control",
            f"SD of log ratio over prompts, minus the control's (null {CAM_SPREAD:.2f})",
            theta,
            CAM_SPREAD,
            ev.level,
            "prompts",
            CAM_SPREAD / 2,
        )
        out.append(Finding(None, ours, src, rule, model, cam_fold, test=test))
    return out


@claim(
    "summarization-most-fragile",
    "paper",
    "Summarization is the most fragile task category",
    "not quantified: summaries 'become garbage' when too much is pruned or merged",
)
def summarization_fragile(ev: Evidence) -> list[Finding]:
    src = ev.tables.source("quality_scores", "method", "category", "score") + " (relative to the baseline)"
    rule = (
        f"per category: relative quality (mean score / the baseline's on the same samples) averaged over the "
        f"methods of the paper's four families (categories where the baseline scores < {SCORE_FLOOR:g} left out); "
        f"paired differences between {CATEGORY_SUMMARIZATION!r} and every other category on one bootstrap "
        "of the samples (within each category x bucket where each holds 20 or more; n: the smaller category's "
        "samples): confirmed if summarization's "
        "is lower than every one, contradicted if another category's is lower than summarization's"
    )
    if not ev.tables.stage_ran("quality"):
        return [Finding(NOT_RUN, "stage quality not run", src, rule)]
    out = []
    for cell in _quality_cells(ev):
        model, protocol = cell.key["model"], cell.key["protocol"]
        methods = [m for m in cell.matrix("score").columns if m != ev.baseline and _family(ev, m) in SEED_KINDS]
        per, column, dropped = _category_quality(ev, cell, methods)
        if column != "relative quality" or not per:
            out.append(
                Finding(
                    NOT_MEASURABLE,
                    f"no scores relative to the baseline (it scores < {SCORE_FLOOR:g} everywhere)",
                    src,
                    rule,
                    model,
                    protocol=protocol,
                )
            )
            continue
        categories = sorted(next(iter(per.values())))
        mean = {
            c: Estimate(
                float(np.mean([per[m][c].estimate for m in per])),
                np.mean(np.vstack([per[m][c].draws for m in per]), axis=0),
                min(per[m][c].n for m in per),
                n_units=_n_units([per[m][c] for m in per]),
            )
            for c in categories
        }
        ours = f"mean relative quality of {len(per)} methods: {_listed(mean, ev.level, higher=False)}"
        if dropped:
            ours += f" (left out, the baseline scores < {SCORE_FLOOR:g}: {', '.join(dropped)})"
        if CATEGORY_SUMMARIZATION not in mean or len(mean) < 2:
            why = "summarization left out" if CATEGORY_SUMMARIZATION in dropped else "no summarization scores"
            out.append(Finding(NOT_MEASURABLE, f"{ours}; {why}", src, rule, model, protocol=protocol))
            continue
        rivals = [c for c in categories if c != CATEGORY_SUMMARIZATION]
        test = extreme_test(
            f"{CATEGORY_SUMMARIZATION} vs each other category",
            "paired difference of mean relative quality",
            mean,
            [CATEGORY_SUMMARIZATION],
            rivals,
            False,
            ev.level,
            "samples",
            QUALITY_EFFECT,
        )
        out.append(Finding(None, ours, src, rule, model, mean[CATEGORY_SUMMARIZATION].estimate, protocol, test))
    return out


def _rank_estimate(counts: np.ndarray, x: np.ndarray, y: np.ndarray, n: int, n_units: int | None) -> Estimate:
    """Spearman's rho across methods (columns) of their mean x and mean y over the drawn units."""

    def means(c: np.ndarray, v: np.ndarray) -> np.ndarray:
        ok = np.isfinite(v)
        with np.errstate(invalid="ignore", divide="ignore"):
            return (c @ np.where(ok, v, 0.0)) / (c @ ok.astype(float))

    point = spearman_rows(means(np.ones((1, len(x))), x), means(np.ones((1, len(y))), y))[0]
    bx, by = means(counts, x), means(counts, y)
    draws = spearman_rows(bx, by)
    draws[np.isnan(bx).any(axis=1) | np.isnan(by).any(axis=1)] = np.nan
    return Estimate(float(point), draws, n, n_units=n_units)


def _predicts(
    ev: Evidence, what: str, cell: Cell, x: pd.DataFrame, y: pd.DataFrame, unit: str, key: tuple
) -> tuple[str, Test | None] | None:
    """The band test of rho(ratio, outcome) across methods, needing the methods to differ in the
    outcome (equal_means_test) to confirm."""
    keep = x.columns[x.notna().any() & y.notna().any()]
    if len(keep) < MIN_METHODS:
        return None
    xv, yv = x[keep].to_numpy(float), y[keep].to_numpy(float)
    n, n_units = cell.resample.count(np.ones(cell.n_units, bool))
    est = _rank_estimate(cell.resample.counts, xv, yv, n, n_units)
    if est.estimate != est.estimate:
        return f"{what}: no ranking (every method's {what} or ratio is the same)", None
    documents = cell.units[DOCUMENT].to_numpy() if DOCUMENT in cell.units else None
    p_differ, _ = equal_means_test(yv, ev.n_boot, rng_for(ev.seed, "methods-differ", *key), documents)
    p_differ = p_differ if p_differ == p_differ else 1.0
    test = band_test(
        f"measured ratio vs {what} across {len(keep)} methods",
        f"Spearman's rho (poorly: inside +-{PREDICTS_RHO:g}; methods differ in {what}: p {p_differ:.2g})",
        est,
        PREDICTS_RHO,
        ev.level,
        unit,
        RANK_EFFECT,
        also_needed=p_differ,
    )
    return f"{what}: rho {_ci(est, ev.level)}, methods differ p {p_differ:.2g}", test


def _predicts_finding(found: tuple[str, Test | None], src: str, rule: str, model: str, protocol: str) -> Finding:
    ours, test = found
    if test is None:
        return Finding(NOT_MEASURABLE, ours, src, rule, model, protocol=protocol)
    return Finding(None, ours, src, rule, model, test.interval.estimate, protocol, test)


@claim(
    "ratio-predicts-poorly",
    "paper",
    "Compression ratio alone predicts end-to-end behaviour poorly",
    "not quantified: 'the space saved does not necessarily mean better performance'",
)
def ratio_predicts_poorly(ev: Evidence) -> list[Finding]:
    src = (
        ev.tables.source("quality_scores", "method", "score", "ratio")
        + "; "
        + _system_source(ev, "ratio_end", "ttft_s", "tpot_s")
    )
    rule = (
        f"the claim says methods differ in an end-to-end outcome in ways their measured ratio does not order. Per "
        f"outcome (task score per protocol, TTFT, TPOT), Spearman's rho across methods between mean measured ratio "
        f"and the mean outcome, bootstrap over samples or prompts: confirmed "
        f"only if the methods differ in the outcome (bootstrap test of equal means) and rho's interval lies inside "
        f"+-{PREDICTS_RHO:g}; contradicted if it lies beyond {PREDICTS_RHO:g} or -{PREDICTS_RHO:g} (the ratio "
        "orders the outcome); noise with no difference between methods decides nothing"
    )
    out = []
    for cell in _quality_cells(ev):
        model, protocol = cell.key["model"], cell.key["protocol"]
        x = cell.matrix("ratio")
        if not x.notna().any().any():
            continue
        found = _predicts(ev, "task score", cell, x, cell.matrix("score"), "samples", (model, protocol))
        if found:
            out.append(_predicts_finding(found, src, rule, model, protocol))
    if ev.units is not None:
        for model in _system_models(ev):
            cell = _system_cell(ev, ev.units[ev.units.model == model], "ratio-predicts")
            if cell is None:
                continue
            for what, column in (("TTFT", "lg_ttft_s"), ("TPOT", "lg_tpot_s")):
                found = _predicts(ev, what, cell, cell.matrix("ratio"), cell.matrix(column), "prompts", (model, what))
                if found:
                    out.append(_predicts_finding(found, src, rule, model, "-"))
    if not out:
        ran = ev.tables.stage_ran("quality") or ev.tables.stage_ran("system")
        return [
            Finding(
                NOT_MEASURABLE if ran else NOT_RUN,
                "fewer than 3 methods with a measured ratio" if ran else "stages quality and system not run",
                src,
                rule,
            )
        ]
    return out

"""The seeds' claims, checked against this run's tables.

Each claim is one function registered with @claim: it reads the evidence (the stage tables, the
joined method table, the rank correlations) and returns a Finding per model: our number, the
verdict, the table and columns it came from, and the rule that decided the verdict. The seed's
own number is a quotation of the seed (the blog or the paper explainer), the only typed figure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import pandas as pd

from kvbench.report.contracts import CATEGORY_SUMMARIZATION, Tables
from kvbench.report.joined import workload_prompts
from kvbench.report.stats import kendall_tau

CONFIRMED = "confirmed"
CONTRADICTED = "contradicted"
NOT_MEASURABLE = "not measurable at this scale"
NOT_RUN = "not run"
INCONCLUSIVE = "inconclusive"  # the interval includes no effect (or the threshold)

# The paper's four method families: claims about "the best/most X method" compare these.
SEED_KINDS = ("kivi", "turboquant", "snapkv", "cam")
LONG_CONTEXT_TOKENS = 4096  # the paper's long-context regime starts around LongBench's 4K+
NOISE_FLOOR = 0.05          # TTFT differences below 5 % are not resolved on a shared CPU
INPUT_INFLATION = 1.10      # "repetitive input inflates": at least 10 % better ratio
WEIGHTS_INFLATION = 2.0     # "dummy weights ... far better": at least twice the ratio
DIVERSITY_FOLD = 100.0      # "hundreds of times more diverse": at least 100x
CAM_VARIATION = 1.5         # "varies with the workload": max/min realized ratio at least 1.5
PREDICTS_RHO = 0.7          # ratio "predicts" an outcome: |rho| >= 0.7 and its interval excludes 0
RANKS_AGREE_TAU = 0.8       # rankings agree: Kendall's tau >= 0.8 (at most 10 % of pairs swap)


@dataclass
class Evidence:
    tables: Tables
    methods: dict[str, dict[str, Any]]  # the config's method specs, by name
    baseline: str
    kv_dtype: str
    kv_codec: str
    method_table: pd.DataFrame
    correlations: pd.DataFrame


@dataclass
class Finding:
    verdict: str
    ours: str
    source: str
    rule: str
    model: str = "-"
    value: float = math.nan  # our headline number, for tables that quote it


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


def evaluate(ev: Evidence) -> pd.DataFrame:
    rows = []
    for c in CLAIMS.values():
        for f in c.check(ev):
            rows.append({"claim_id": c.id, "origin": c.seed, "claim": c.text, "seed_number": c.seed_number,
                         "model": f.model, "ours": f.ours, "ours_value": f.value, "verdict": f.verdict,
                         "source": f.source, "rule": f.rule})
    return pd.DataFrame(rows)


def _models(*frames: pd.DataFrame | None) -> list[str]:
    found = set()
    for frame in frames:
        if frame is not None and len(frame):
            found |= set(frame.model.dropna())
    return sorted(found)


def _named(ev: Evidence, kind: str, **settings: Any) -> list[str]:
    return [name for name, spec in ev.methods.items()
            if spec.get("kind") == kind and all(spec.get(k) == v for k, v in settings.items())]


def _family(ev: Evidence, name: str) -> str | None:
    return ev.methods.get(name, {}).get("kind")


def _families(ev: Evidence, names: pd.Index | pd.Series, kinds: tuple[str, ...] = SEED_KINDS) -> np.ndarray:
    """Mask of the names whose kind is one of `kinds` (np.array: safe on empty frames)."""
    return np.array([_family(ev, n) in kinds for n in names], dtype=bool)


def _fmt(x: float) -> str:
    return "n/a" if x != x else f"{x:.3g}"


# --- the blog ("hi hi hi") ------------------------------------------------------------------


@claim("token-diversity", "blog",
       'A "hi hi hi" document has 2 unique tokens; realistic medical and legal documents are hundreds of '
       "times more diverse",
       "0.02 % (2 unique tokens of ~10K) vs corpus means 14.2 % medical, 9.4 % legal: 'hundreds of times' more")
def token_diversity(ev: Evidence) -> Finding:
    src = ev.tables.source("corpus_stats", "corpus", "domain", "tokens", "unique_tokens", "diversity_pct")
    rule = (f"diversity falls with length, so at equal length: confirmed if every realistic domain's mean "
            f"diversity is >= {DIVERSITY_FOLD:g}x that of a synthetic document of the same length "
            f"(its unique tokens / the domain's mean length); not measurable if documents are too short to show it")
    stats = ev.tables.get("corpus_stats")
    if stats is None:
        return Finding(NOT_RUN, "stage corpus not run", src, rule)
    synthetic = stats[stats.corpus == "synthetic"]
    domains = stats[stats.corpus == "realistic"].groupby("domain").agg(
        diversity=("diversity_pct", "mean"), tokens=("tokens", "mean"))
    if synthetic.empty or domains.empty:
        return Finding(NOT_MEASURABLE, "needs both the synthetic and the realistic corpus", src, rule)
    unique = float(synthetic.unique_tokens.median())
    fold = (domains.diversity / (100 * unique / domains.tokens)).min()
    ours = (f"{_fmt(synthetic.diversity_pct.mean())} % ({unique:.0f} unique tokens in "
            f"{synthetic.tokens.mean():.0f}) vs " + ", ".join(
                f"{_fmt(r.diversity)} % {d} ({r.tokens:.0f} tokens)" for d, r in domains.iterrows())
            + f": {fold:.0f}x at equal length")
    if domains.tokens.min() < DIVERSITY_FOLD * unique:
        return Finding(NOT_MEASURABLE, ours + " (documents too short for a 100x difference)", src, rule, value=fold)
    return Finding(CONFIRMED if fold >= DIVERSITY_FOLD else CONTRADICTED, ours, src, rule, value=fold)


def _inflation(ev: Evidence, comparison: str, held: str, threshold: float, what: str) -> Finding:
    src = ev.tables.source("kv_summary", "comparison", "held_fixed", "dtype", "codec", "inflation")
    rule = f"confirmed if {what} >= {threshold:g}x at {ev.kv_dtype}, {ev.kv_codec}"
    summary = ev.tables.get("kv_summary")
    if summary is None:
        return Finding(NOT_RUN, "stage kv not run", src, rule)
    row = summary[(summary.comparison == comparison) & (summary.held_fixed == held)
                  & (summary.dtype == ev.kv_dtype) & (summary.codec == ev.kv_codec)]
    if row.empty:
        return Finding(NOT_MEASURABLE, f"no {comparison} ({held}) row at {ev.kv_dtype}, {ev.kv_codec}", src, rule)
    r = row.iloc[0]
    ours = (f"{_fmt(r.benchmark_ratio)}x vs {_fmt(r.realistic_ratio)}x ({ev.kv_dtype}, {ev.kv_codec}, {held}): "
            f"{what} {_fmt(r.inflation)}x")
    return Finding(CONFIRMED if r.inflation >= threshold else CONTRADICTED, ours, src, rule, value=float(r.inflation))


@claim("dummy-weights-inflate", "blog",
       "Dummy weights make KV caches compress far better than trained weights do",
       "not quantified: 'very good' ratios with dummy weights, 'changed completely' with Qwen3-8B-FP8")
def dummy_weights_inflate(ev: Evidence) -> Finding:
    return _inflation(ev, "dummy_vs_real", "corpus=realistic", WEIGHTS_INFLATION, "dummy / real ratio")


@claim("repetitive-input-inflates", "blog",
       "Repetitive input makes KV caches compress better than realistic text does",
       "not quantified: regular activations 'look better than reality'")
def repetitive_input_inflates(ev: Evidence) -> Finding:
    return _inflation(ev, "synthetic_vs_realistic", "weights=real", INPUT_INFLATION, "synthetic / realistic ratio")


def _codec_tau(kv: pd.DataFrame, dtype: str) -> tuple[float, int]:
    from kvbench.kv.summary import pooled_ratios

    ratios = pooled_ratios(kv[(kv.weights == "real") & (kv.dtype == dtype) & (kv.codec != "none")],
                           by=["corpus", "codec"])
    table = ratios.pivot(index="codec", columns="corpus", values="ratio")
    if not {"synthetic", "realistic"} <= set(table.columns):
        return math.nan, 0
    return kendall_tau(table.synthetic, table.realistic)


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


@claim("hi-ranks-wrong", "blog",
       'Benchmarks on "hi hi hi" rank connectors, codecs and backends on a workload nobody runs',
       "not quantified: comparing on 'hi hi hi' only ranks them on a workload nobody runs")
def hi_ranks_wrong(ev: Evidence) -> Finding:
    rule = (f"Kendall's tau-b of the codecs ranked by compression ratio (kv stage; serve stage's wire ratio), "
            f"synthetic vs realistic input; confirmed if any ratio tau < {RANKS_AGREE_TAU:g} (more than 10 % of "
            f"pairs swap), contradicted if all >= {RANKS_AGREE_TAU:g}. The hit-TTFT tau is shown, not decisive: "
            "TTFTs of codecs differ by less than the run's noise")
    sources, taus = [], {}
    kv, offload = ev.tables.get("kv_compressibility"), ev.tables.get("serve_offload")
    sources.append(ev.tables.source("kv_compressibility", "corpus", "weights", "dtype", "codec", "raw_bytes",
                                    "compressed_bytes"))
    sources.append(ev.tables.source("serve_offload", "backend", "codec", "corpus", "ratio", "ttft_hit_s", "status"))
    if kv is not None:
        taus[f"codecs by KV ratio (kv stage, real weights, {ev.kv_dtype})"] = _codec_tau(kv, ev.kv_dtype)
    shown = {}
    if offload is not None:
        taus["codecs sized by the data, by wire ratio (serve)"] = _serve_tau(offload, "ratio", data_dependent=True)
        shown["backend x codec by hit TTFT (serve, not decisive)"] = _serve_tau(offload, "ttft_hit_s")
    source = "; ".join(sources)
    if not taus:
        return Finding(NOT_RUN, "no KV compressibility table (stage kv) and no serve stage", source, rule)
    parts = [f"{what}: tau {_fmt(t)} over {n}" for what, (t, n) in {**taus, **shown}.items()]
    if offload is None:
        parts.append("serve: not run")
    measured = [t for t, n in taus.values() if t == t]
    if not measured:
        return Finding(NOT_MEASURABLE, "; ".join(parts) + " (fewer than 3 items ranked)", source, rule)
    low = min(measured)
    return Finding(CONFIRMED if low < RANKS_AGREE_TAU else CONTRADICTED, "; ".join(parts), source, rule, value=low)


@claim("dummy-weights-inflate-on-the-engine", "blog",
       'On the serving engine, dummy weights and "hi hi hi" documents make the offloaded KV look far more '
       "compressible than real weights and realistic documents",
       "not quantified: 'very good' ratios through a Valkey connector with dummy weights, 'changed completely' "
       "with Qwen3-8B-FP8")
def dummy_weights_inflate_on_the_engine(ev: Evidence) -> Finding:
    src = ev.tables.source("serve_engine", "weights", "corpus", "codec", "served_dtype", "ratio", "inflation",
                           "inflation_ci_low", "inflation_ci_high", "inflation_n")
    rule = (f"wire ratio of what our connector stored (dummy weights, synthetic documents) / (real weights, "
            f"realistic documents), {ev.kv_codec}, at the dtype vLLM served, with a 95 % bootstrap interval over "
            f"store events: confirmed if the interval lies above {WEIGHTS_INFLATION:g}x, inconclusive if it "
            f"includes 1x (no effect) or {WEIGHTS_INFLATION:g}x, contradicted if it lies below {WEIGHTS_INFLATION:g}x")
    engine = ev.tables.get("serve_engine")
    if engine is None:
        return Finding(NOT_RUN, "stage serve not run", src, rule)
    row = engine[(engine.codec == ev.kv_codec) & engine.inflation.notna()]
    if row.empty:
        return Finding(NOT_MEASURABLE, f"no dummy+synthetic vs real+realistic cells for {ev.kv_codec} "
                                       "(serve.weights needs dummy, serve.corpora both)", src, rule)
    r = row.iloc[0]
    low, high = float(r.inflation_ci_low), float(r.inflation_ci_high)
    ours = (f"{_fmt(r.inflation)}x [{_fmt(low)}, {_fmt(high)}] ({ev.kv_codec}, served {r.served_dtype}, "
            f"n={int(r.inflation_n)} and {int(r.realistic_n)} store events)")
    if isinstance(r.dtype_note, str) and r.dtype_note:
        ours += f"; {r.dtype_note}"
    if low > WEIGHTS_INFLATION:
        verdict = CONFIRMED
    elif high < WEIGHTS_INFLATION and not low <= 1.0 <= high:
        verdict = CONTRADICTED
    else:
        verdict = INCONCLUSIVE
    return Finding(verdict, ours, src, rule, value=float(r.inflation))


# --- the paper (KIVI / TurboQuant / SnapKV / CaM) ---------------------------------------------


def _category_quality(ev: Evidence, model: str) -> tuple[pd.DataFrame, str]:
    """Per method x category: mean quality relative to the baseline over buckets; where the baseline
    scores zero everywhere, top-1 agreement with it (fidelity) instead."""
    table = ev.method_table[(ev.method_table.model == model) & (ev.method_table.method != ev.baseline)]
    for column in ("quality_rel", "top1_agreement"):
        if column in table and table[column].notna().any():
            return table.groupby(["method", "category"])[column].mean().unstack("category"), column
    return pd.DataFrame(), ""


def _strict_best(values: pd.Series, name: str, highest: bool) -> tuple[str, list[str]]:
    """CONFIRMED if `name` alone holds the extreme, CONTRADICTED if another does, NOT_MEASURABLE on
    a tie for the extreme (with the tied names)."""
    top = values.max() if highest else values.min()
    at_top = sorted(values.index[values == top])
    if len(at_top) > 1 and name in at_top:
        return NOT_MEASURABLE, at_top
    return (CONFIRMED if at_top == [name] else CONTRADICTED), at_top


@claim("kivi4-most-stable", "paper",
       "KIVI (4-bit) has the most stable quality across tasks",
       "not quantified: KIVI 'rarely makes mistakes' across tasks; the safest default (no bit width given)")
def kivi4_most_stable(ev: Evidence) -> list[Finding]:
    rule = ("worst category's quality relative to the baseline (top-1 agreement where the baseline scores 0), "
            "per method of the paper's four families; confirmed if KIVI-4's is the highest alone, not measurable "
            "on a tie")
    kivi4 = _named(ev, "kivi", bits=4)
    src = ev.tables.source("quality_scores", "method", "category", "score") + " (relative to the baseline)"
    if not ev.tables.stage_ran("quality"):
        return [Finding(NOT_RUN, "stage quality not run", src, rule)]
    if not kivi4:
        return [Finding(NOT_RUN, "no 4-bit KIVI method in the config", src, rule)]
    out = []
    for model in _models(ev.method_table):
        per, column = _category_quality(ev, model)
        if column == "top1_agreement":
            src = ev.tables.source("quality_fidelity", "method", "category", "top1_agreement")
        per = per[_families(ev, per.index)]
        worst = per.min(axis=1).dropna() if len(per) else pd.Series(dtype=float)
        if not column:
            why = "the baseline scores 0 and no fidelity rows"
        elif kivi4[0] not in worst.index:
            why = f"no {column} for {kivi4[0]}"
        else:
            why = "fewer than 2 methods of the four families measured"
        if kivi4[0] not in worst.index or len(worst) < 2:
            out.append(Finding(NOT_MEASURABLE, why, src, rule, model))
            continue
        ranked = worst.sort_values(ascending=False)
        ours = f"worst-category {column}: " + ", ".join(f"{m} {_fmt(v)}" for m, v in ranked.items())
        verdict, top = _strict_best(worst, kivi4[0], highest=True)
        if verdict == NOT_MEASURABLE:
            ours += f" (tie: {', '.join(top)})"
        out.append(Finding(verdict, ours, src, rule, model, float(worst[kivi4[0]])))
    return out


@claim("snapkv-long-context-throughput", "paper",
       "SnapKV gives the best long-context throughput",
       "not quantified: SnapKV is the 'champion' for speed on long documents")
def snapkv_throughput(ev: Evidence) -> list[Finding]:
    src = ev.tables.source("system", "method", "target_context", "decode_tok_s")
    rule = (f"median decode tok/s over prompts of >= {LONG_CONTEXT_TOKENS} tokens, the paper's four families; "
            "confirmed if a SnapKV method is the fastest, not measurable on a tie with another family")
    system = ev.tables.get("system")
    if system is None:
        return [Finding(NOT_RUN, "stage system not run", src, rule)]
    out = []
    for model in _models(system):
        rows = workload_prompts(system[(system.model == model) & system.error.isna()])
        rows = rows[_families(ev, rows.method)]
        longest = int(rows.target_context.max()) if len(rows) else 0
        at = rows[rows.target_context >= min(longest, LONG_CONTEXT_TOKENS)]
        speed = at.groupby("method").decode_tok_s.median().sort_values(ascending=False)
        if speed.empty:
            out.append(Finding(NOT_MEASURABLE, "no measured prompts", src, rule, model))
            continue
        ours = f"at {longest} tokens: " + ", ".join(f"{m} {_fmt(v)} tok/s" for m, v in speed.items())
        if longest < LONG_CONTEXT_TOKENS:
            out.append(Finding(NOT_MEASURABLE, ours + f" (longest prompt < {LONG_CONTEXT_TOKENS})", src, rule, model))
            continue
        fastest = speed[speed == speed.iloc[0]].index
        families = {_family(ev, m) for m in fastest}
        verdict = (NOT_MEASURABLE if len(families) > 1 and "snapkv" in families
                   else CONFIRMED if families == {"snapkv"} else CONTRADICTED)
        if verdict == NOT_MEASURABLE:
            ours += f" (tie: {', '.join(fastest)})"
        out.append(Finding(verdict, ours, src, rule, model, float(speed.iloc[0])))
    return out


@claim("turboquant-ttft-overhead", "paper",
       "TurboQuant has the highest TTFT overhead (KIVI, SnapKV and CaM barely change TTFT)",
       "not quantified: TurboQuant 'keeps the user waiting longer'")
def turboquant_ttft(ev: Evidence) -> list[Finding]:
    src = ev.tables.source("system", "method", "prompt_id", "ttft_s", "ttft_s_std")
    rule = ("median over prompts of TTFT / the baseline's TTFT on the same prompt - 1, the paper's four families; "
            f"confirmed if TurboQuant's is highest by more than the noise (max of {NOISE_FLOOR:.0%} and the "
            "repeats' relative spread), contradicted if another family's is")
    system = ev.tables.get("system")
    if system is None:
        return [Finding(NOT_RUN, "stage system not run", src, rule)]
    out = []
    for model in _models(system):
        rows = workload_prompts(system[(system.model == model) & system.error.isna()])
        ttft = rows.pivot_table(index="prompt_id", columns="method", values="ttft_s")
        if ev.baseline not in ttft:
            out.append(Finding(NOT_MEASURABLE, f"no {ev.baseline} rows", src, rule, model))
            continue
        over = ttft.div(ttft[ev.baseline], axis=0).sub(1).median()
        over = over[_families(ev, over.index)].dropna().sort_values(ascending=False)
        spread = (rows.ttft_s_std / rows.ttft_s).median()
        noise = max(NOISE_FLOOR, float(spread) if spread == spread else 0.0)
        tq = over[_families(ev, over.index, ("turboquant",))]
        rest = over[~_families(ev, over.index, ("turboquant",))]
        ours = ", ".join(f"{m} {v:+.1%}" for m, v in over.items()) + f" (noise {noise:.0%})"
        if tq.empty or rest.empty:
            out.append(Finding(NOT_MEASURABLE, ours or "no TurboQuant or no other family", src, rule, model))
            continue
        gap = tq.max() - rest.max()
        verdict = CONFIRMED if gap > noise else CONTRADICTED if gap < -noise else NOT_MEASURABLE
        out.append(Finding(verdict, ours, src, rule, model, float(tq.max())))
    return out


# A CaM setting that fixes how many tokens it keeps: its ratio at one length is then set by the config.
CAM_SIZE_KEYS = ("keep_ratio", "capacity", "target")


@claim("cam-ratio-varies", "paper",
       "CaM's realized compression varies with the workload",
       "not quantified: large savings on some days, none at all on others")
def cam_ratio_varies(ev: Evidence) -> list[Finding]:
    src = ev.tables.source("system", "method", "prompt_id", "corpus", "target_context", "ratio_end")
    rule = (f"max / min measured ratio of each CaM method over the workload prompts at one context length "
            f"(the longest), beside a fixed-budget control (snapkv); confirmed if CaM's is >= {CAM_VARIATION:g} "
            f"and the control's is not; not measurable if the config fixes CaM's kept size "
            f"({', '.join(CAM_SIZE_KEYS)}): the ratio at a given length is then set by construction")
    system = ev.tables.get("system")
    cams = [m for m in ev.methods if _family(ev, m) == "cam"]
    if system is None or not cams:
        return [Finding(NOT_RUN, "stage system not run" if system is None else "no CaM method in the config",
                        src, rule)]
    controls = [m for m in ev.methods if _family(ev, m) == "snapkv"]
    out = []
    for model in _models(system):
        rows = workload_prompts(system[(system.model == model) & system.error.isna()])
        rows = rows[rows.target_context == rows.target_context.max()] if len(rows) else rows
        mine = rows[rows.method.isin(cams)]
        if mine.empty:
            out.append(Finding(NOT_MEASURABLE, "no CaM rows without an error", src, rule, model))
            continue
        span = rows[rows.method.isin(cams + controls)].groupby("method").ratio_end.agg(["min", "max", "size"])
        fold = span["max"] / span["min"]
        cam_fold = float(fold[fold.index.isin(cams)].max())
        control_fold = float(fold[fold.index.isin(controls)].max()) if fold.index.isin(controls).any() else math.nan
        at = int(mine.target_context.iloc[0])
        ours = f"at {at} tokens: " + "; ".join(
            f"{m}{' (control)' if m in controls else ''}: {_fmt(r['min'])}x-{_fmt(r['max'])}x over "
            f"{r['size']:.0f} prompts" for m, r in span.iterrows())
        fixed = sorted({f"{m}: {k}" for m in span.index if m in cams for k in CAM_SIZE_KEYS if k in ev.methods[m]})
        if fixed:
            out.append(Finding(NOT_MEASURABLE, ours + f" (kept size fixed by the config: {', '.join(fixed)})",
                               src, rule, model, cam_fold))
            continue
        varies = cam_fold >= CAM_VARIATION and not control_fold >= CAM_VARIATION
        out.append(Finding(CONFIRMED if varies else CONTRADICTED, ours, src, rule, model, cam_fold))
    return out


@claim("summarization-most-fragile", "paper",
       "Summarization is the most fragile task category",
       "not quantified: summaries 'become garbage' when too much is pruned or merged")
def summarization_fragile(ev: Evidence) -> list[Finding]:
    src = ev.tables.source("quality_scores", "method", "category", "score") + " (relative to the baseline)"
    rule = ("mean quality relative to the baseline over the paper's four families, per category; "
            f"confirmed if {CATEGORY_SUMMARIZATION!r} alone is the lowest, not measurable on a tie")
    if not ev.tables.stage_ran("quality"):
        return [Finding(NOT_RUN, "stage quality not run", src, rule)]
    out = []
    for model in _models(ev.method_table):
        per, column = _category_quality(ev, model)
        per = per[_families(ev, per.index)]
        means = per.mean().dropna().sort_values() if len(per) else pd.Series(dtype=float)
        if CATEGORY_SUMMARIZATION not in means.index or len(means) < 2:
            out.append(Finding(NOT_MEASURABLE, "no summarization scores relative to the baseline", src, rule, model))
            continue
        ours = f"mean {column}: " + ", ".join(f"{c} {_fmt(v)}" for c, v in means.items())
        verdict, low = _strict_best(means, CATEGORY_SUMMARIZATION, highest=False)
        if verdict == NOT_MEASURABLE:
            ours += f" (tie: {', '.join(low)})"
        out.append(Finding(verdict, ours, src, rule, model, float(means[CATEGORY_SUMMARIZATION])))
    return out


@claim("ratio-predicts-poorly", "paper",
       "Compression ratio alone predicts end-to-end behaviour poorly",
       "not quantified: 'the space saved does not necessarily mean better performance'")
def ratio_predicts_poorly(ev: Evidence) -> list[Finding]:
    from kvbench.report.correlations import POOLED

    src = "results/report/correlations.parquet: rho, ci_low, ci_high (measured ratio vs quality, TTFT, TPOT)"
    rule = (f"per outcome x category: ratio predicts if |rho| >= {PREDICTS_RHO:g} and the bootstrap interval "
            f"excludes 0, predicts poorly if the interval lies inside (-{PREDICTS_RHO:g}, {PREDICTS_RHO:g}), "
            "else inconclusive (rows: per category where they have an interval, else pooled); not measurable "
            "if half or more are inconclusive or as many predict as predict poorly; else confirmed if more "
            "predict poorly, contradicted if more predict")
    corr = ev.correlations
    if corr.empty:
        return [Finding(NOT_RUN, "stage system not run", src, rule)]
    out = []
    for model in _models(corr):
        rows = corr[(corr.model == model) & corr.rho.notna() & corr.ci_low.notna()]
        per_category = rows[rows.category != POOLED]
        pooled = per_category.empty and not rows.empty
        rows = rows if pooled else per_category
        if rows.empty:
            out.append(Finding(NOT_MEASURABLE, "no interval: fewer than 3 methods or too few samples", src, rule,
                               model))
            continue
        predicts = (rows.rho.abs() >= PREDICTS_RHO) & ((rows.ci_low > 0) | (rows.ci_high < 0))
        poor = (rows.ci_low > -PREDICTS_RHO) & (rows.ci_high < PREDICTS_RHO)
        unsure = ~(predicts | poor)
        ours = (f"{'pooled over categories (no category has an interval): ' if pooled else ''}"
                f"predicts {int(predicts.sum())}, poorly {int(poor.sum())}, inconclusive {int(unsure.sum())} "
                "of " + f"{len(rows)}: " + ", ".join(
                    f"{r.outcome}/{r.category} rho {r.rho:+.2f} [{r.ci_low:+.2f}, {r.ci_high:+.2f}]"
                    for r in rows.itertuples()))
        if unsure.sum() >= len(rows) / 2 or poor.sum() == predicts.sum():
            verdict = NOT_MEASURABLE
        else:
            verdict = CONFIRMED if poor.sum() > predicts.sum() else CONTRADICTED
        out.append(Finding(verdict, ours, src, rule, model, float(predicts.mean())))
    return out

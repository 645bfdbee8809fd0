"""Stage `report`: every table of the report from the stage tables that exist, and its pages."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import pandas as pd

from kvbench.report.bootstrap import MIN_CHANGED
from kvbench.report.claims import CONFIRMED, CONTRADICTED, INCONCLUSIVE, NOT_MEASURABLE, NOT_RUN, Evidence, evaluate
from kvbench.report.contracts import CONTEXT_ONLY, CONTRACTS, STAGES, Tables
from kvbench.report.correlations import correlation_table
from kvbench.report.differences import quality_differences, system_ratios
from kvbench.report.engine import engine_table
from kvbench.report.joined import MEASURED, corpus_table, method_table
from kvbench.report.power import DEFAULT_EFFECTS, POWER, power_table
from kvbench.report.recommend import recommendations, scenarios_from_config
from kvbench.report.render import html_page
from kvbench.report.samples import paired_quality, system_units
from kvbench.report.versus import Versus


@dataclass
class ReportTables:
    methods: pd.DataFrame
    corpora: pd.DataFrame
    correlations: pd.DataFrame
    claims: pd.DataFrame
    recommendations: pd.DataFrame
    stages: pd.DataFrame
    differences: pd.DataFrame
    system_ratios: pd.DataFrame
    power: pd.DataFrame
    engine: pd.DataFrame


TABLES = (
    "methods",
    "corpora",
    "correlations",
    "claims",
    "recommendations",
    "stages",
    "differences",
    "system_ratios",
    "power",
    "engine",
)


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
        rows.append(
            {
                "stage": stage,
                "status": "ran" if read else NOT_RUN,
                "tables": ", ".join(CONTRACTS[n].path for n in (read or names)),
                "rows": sum(len(f) for f in frames) if read else None,
                # the provenance of what was read (the table's own provenance columns are the report's)
                "source_config_hash": _distinct(frames, "config_hash"),
                "source_git_commit": _distinct(frames, "git_commit"),
            }
        )
    return pd.DataFrame(rows)


def effects_of(cfg: Mapping[str, Any]) -> dict[str, float]:
    return {**DEFAULT_EFFECTS, **(cfg.get("power") or {}).get("effects", {})}


def power_of(cfg: Mapping[str, Any]) -> float:
    return float((cfg.get("power") or {}).get("power", POWER))


def _counted(table: pd.DataFrame, unit: str) -> np.ndarray:
    """What each row's n counts: documents where fewer than its units (they share documents)."""
    return np.where(table.n < table.n_units, "documents", unit)


def power_tables(
    paired: pd.DataFrame | None,
    units: pd.DataFrame | None,
    baseline: str,
    effects: Mapping[str, float],
    level: float,
    power: float,
) -> pd.DataFrame:
    """Per comparison: n, spread, MDE and the n a stated effect needs, for the quality stage's
    samples (per model x protocol x method x category x bucket, and pooled over categories) and
    the system stage's prompts (log ratios: the effects as log(1 + effect))."""
    frames = []
    if paired is not None and len(paired):
        quality = power_table(
            paired[paired.method != baseline],
            effects,
            level,
            power,
            by=("model", "protocol", "method", "category", "bucket"),
        )
        frames.append(quality.assign(stage="quality", unit=_counted(quality, "samples")))
    if units is not None and len(units):
        ratios = units[units.method != baseline].rename(columns={f"lr_{c}": f"d_{c}" for c in ("ttft_s", "tpot_s")})
        ratios = ratios[["model", "method", "bucket", "document", "d_ttft_s", "d_tpot_s"]]
        logs = {k: math.log1p(v) for k, v in effects.items() if k in ("ttft_s", "tpot_s")}
        system = power_table(ratios, logs, level, power, by=("model", "method", "bucket"))
        frames.append(
            system.assign(stage="system", unit=_counted(system, "prompts"), quantity="log " + system.quantity)
        )
    columns = [
        "stage",
        "model",
        "protocol",
        "method",
        "category",
        "bucket",
        "quantity",
        "unit",
        "estimate",
        "n",
        "n_units",
        "sd",
        "se",
        "mde",
        "effect",
        "n_needed",
        "level",
        "power",
    ]
    frames = [f for f in frames if len(f)]
    return pd.concat(frames, ignore_index=True).reindex(columns=columns) if frames else pd.DataFrame(columns=columns)


def build(
    tables: Tables,
    cfg: Mapping[str, Any],
    methods: Mapping[str, dict],
    seed: int,
    harness: Mapping[str, Any] | None = None,
) -> ReportTables:
    """`cfg` is the config's `report` section, `methods` its method specs, `harness` the quality
    stage's settings the engine table's notes name (compute_dtype, reference_top_k, fidelity_positions)."""
    baseline, n_boot, level = cfg["baseline"], int(cfg["bootstrap"]), float(cfg["level"])
    effects, power = effects_of(cfg), power_of(cfg)
    paired = paired_quality(tables, baseline)
    prompts = system_units(tables, baseline)
    units, system_source, in_process = prompts
    joined = method_table(tables, baseline, n_boot, seed, level, paired=paired, prompts=prompts)
    corr = correlation_table(tables, n_boot, seed, level)
    evidence = Evidence(
        tables,
        dict(methods),
        baseline,
        cfg["kv_dtype"],
        cfg["kv_codec"],
        joined,
        corr,
        paired,
        units,
        n_boot,
        seed,
        level,
    )
    return ReportTables(
        methods=joined,
        corpora=corpus_table(tables, cfg["kv_dtype"], cfg["kv_codec"]),
        correlations=corr,
        claims=evaluate(evidence),
        recommendations=recommendations(
            joined,
            scenarios_from_config(cfg["scenarios"]),
            baseline,
            Versus(paired, units, baseline, n_boot, seed, level),
        ),
        stages=stage_status(tables),
        differences=quality_differences(paired, baseline, n_boot, seed, level, effects, power),
        system_ratios=system_ratios(units, system_source, in_process, baseline, n_boot, seed, level, effects, power),
        power=power_tables(paired, units, baseline, effects, level, power),
        engine=engine_table(tables, paired, baseline, n_boot, seed, level, harness),
    )


def _not_run_note(stages: pd.DataFrame) -> str:
    missing = stages[stages.status == NOT_RUN].stage.tolist()
    return f"Stages not run: {', '.join(missing)}; what depends on them says so." if missing else "Every stage ran."


def _interval_text(estimate: float, low: float, high: float) -> str:
    if estimate != estimate:
        return ""
    return f"{estimate:.3g} [{low:.3g}, {high:.3g}]" if low == low else f"{estimate:.3g} (no interval)"


def claims_summary(claims: pd.DataFrame) -> pd.DataFrame:
    """One line per claim row: the verdict with the interval and n it rests on."""
    if claims.empty:
        return claims
    interval = [_interval_text(e, lo, hi) for e, lo, hi in zip(claims.estimate, claims.ci_low, claims.ci_high)]
    n = [f"{v:.0f} {u}" if v == v else "" for v, u in zip(claims.n, claims.unit)]
    return pd.DataFrame(
        {
            "claim": claims.claim,
            "model": claims.model,
            "protocol": claims.protocol,
            "verdict": claims.verdict,
            "statistic": claims.statistic,
            "interval": interval,
            "n": n,
            "MDE": claims.mde,
            "p (Holm)": claims.p_holm,
        }
    )


def _claims_note(claims: pd.DataFrame) -> str:
    family = int(claims.family.max()) if "family" in claims and claims.family.notna().any() else 0
    level = float(claims.level.dropna().iloc[0]) if "level" in claims and claims.level.notna().any() else 0.95
    return (
        f"{CONFIRMED} / {CONTRADICTED}: the Holm-adjusted p-value over the {family} claims with a test is below "
        f"{1 - level:.2g} and the {level:.0%} interval (per claim, unadjusted) lies on that side of the null. "
        f"{INCONCLUSIVE}: it does not; the interval, n and the minimum detectable effect (MDE, two-sided, 80 % "
        f"power, at the claim's Holm step) say how far this run is from deciding. {NOT_MEASURABLE}: the run cannot test it at all; "
        f"{NOT_RUN}: a stage or a method it needs is missing."
    )


def claims_page(report: ReportTables) -> str:
    columns = [
        "origin",
        "claim",
        "seed_number",
        "model",
        "protocol",
        "verdict",
        "ours",
        "compared",
        "statistic",
        "estimate",
        "ci_low",
        "ci_high",
        "null",
        "n",
        "unit",
        "mde",
        "effect",
        "n_needed",
        "p_value",
        "p_holm",
        "source",
        "rule",
    ]
    return html_page(
        "Seed claims, checked against this run",
        [
            (
                "Claims",
                _claims_note(report.claims) + " 'seed_number' quotes the seed, 'ours' is computed from the source "
                "table; 'n_needed' is the n at which 'effect' becomes detectable at this run's spread.",
                report.claims[columns],
            ),
            ("Stages this report read", _not_run_note(report.stages), report.stages),
        ],
    )


PROTOCOL_NOTE = (
    "Each row reads one protocol of the quality stage: context-only compresses the context before the "
    "question is seen (the case of a context cached or offloaded once and reused for many questions: "
    "the one a serving user should read); query-aware compresses after the question (the favourable "
    "case). The system stage's columns are the same in both."
)


def _recommendation_rows(recs: pd.DataFrame) -> pd.DataFrame:
    interval = [_interval_text(v, lo, hi) for v, lo, hi in zip(recs.best_value, recs.best_ci_low, recs.best_ci_high)]
    return recs.assign(best_interval=interval)[
        [
            "model",
            "protocol",
            "category",
            "bucket",
            "best",
            "best_interval",
            "best_n",
            "runner_up",
            "versus_runner_up_test",
            "undecided",
            "numbers",
            "why",
        ]
    ].rename(columns={"versus_runner_up_test": "vs runner-up"})


def recommendations_page(report: ReportTables, baseline: str) -> str:
    recs = report.recommendations
    sections = []
    for scenario, rows in recs.groupby("scenario", sort=False):
        first = rows.iloc[0]
        note = (
            f"{first.description} Limits: {first.limits} (met only where the interval's unfavourable end meets "
            f"them). Prefer: {first.prefer}. {PROTOCOL_NOTE}"
        )
        rows = rows.assign(_first=rows.protocol != CONTEXT_ONLY).sort_values(["_first", "model", "category", "bucket"])
        sections.append((f"Scenario: {scenario}", note, _recommendation_rows(rows)))
    if not sections:
        sections.append(("No scenarios", "Add scenarios under report.scenarios in the config.", None))
    shown = [
        c
        for c in [
            "model",
            "method",
            "protocol",
            "category",
            "bucket",
            "samples",
            "prompts",
            "quality_errors",
            "system_errors",
            *(p for c in MEASURED for p in (c, f"{c}_low", f"{c}_high", f"{c}_rel", f"{c}_rel_low", f"{c}_rel_high")),
        ]
        if c in report.methods and report.methods[c].notna().any()
    ]
    sections.append(
        (
            f"The numbers behind it (per method; *_rel = / {baseline}; *_low, *_high: bootstrap interval, "
            f"for quality_rel an exact bound where fewer than {MIN_CHANGED} samples differ from {baseline}'s)",
            _not_run_note(report.stages),
            report.methods[shown] if shown else None,
        )
    )
    return html_page("Which KV method for which workload", sections)


def correlations_page(report: ReportTables) -> str:
    note = (
        "Spearman's rho between each method's measured compression ratio and the outcome, across methods, "
        "with an expanded percentile bootstrap interval over samples (paired: every method resampled alike); "
        "methods_differ_p: a bootstrap test that the methods differ in the outcome at all (where they do not, "
        "no correlation with it can be told from noise)."
    )
    return html_page(
        "Does compression ratio predict end-to-end behaviour?",
        [
            ("Rank correlations", note, report.correlations if len(report.correlations) else None),
        ],
    )


def differences_page(report: ReportTables) -> str:
    diff, ratios = report.differences, report.system_ratios
    note = (
        "Per method: its value and its difference from the reference on the same samples (paired), with "
        "expanded percentile bootstrap intervals over samples (a pooled row resamples within each category and "
        "bucket where each holds 20 samples or more, else all its samples together); per comparison, not adjusted (the claims are). score: task score; kl_mean, top1_agreement: "
        "pooled over teacher-forced positions (the reference's: 0 and 1); first_divergence: identical outputs "
        "count at the continuation's length; ratio: measured bytes. mde: the difference a two-sided paired test "
        "detects with 80 % power at this n and spread; n_needed: the samples 'effect' needs (a pooled row whose samples share documents resamples documents: n and n_needed count them, 'samples' the samples)."
    )
    pooled = diff[(diff.category == "all") & (diff.bucket == "all")] if len(diff) else diff
    ratio_note = (
        "Geometric mean over prompts of the ratio method / baseline on the same prompt and repeat "
        "('pairing' says how the runs were paired), with its interval over prompts; mde and effect are "
        "relative changes."
    )
    return html_page(
        "Each method against the reference, with intervals",
        [
            ("Pooled over categories and buckets", note, pooled if len(pooled) else None),
            (
                "TTFT, TPOT, decode speed and end-to-end time, paired with the baseline",
                ratio_note,
                ratios if len(ratios) else None,
            ),
            ("Every cell (protocol x category x bucket, and pooled)", "", diff if len(diff) else None),
        ],
    )


def engine_page(report: ReportTables) -> str:
    engine = report.engine
    note = (
        "Engine numbers: vLLM serving its own quantized KV cache (--kv-cache-dtype) on the quality tasks, "
        "scored through lm-eval against the server (stage quality_served). Against the engine reference: "
        "the paired score difference from vLLM's 16-bit cache on the same samples, and the fidelity to it "
        "(KL over both top-k lists, a lower bound; its own values 0 and 1). Against a harness method: the "
        "harness's method nearest to the cache (the harness's numbers), each side against its own "
        "reference, paired by sample; `note` says what else differs. Expanded percentile bootstrap intervals "
        "over samples, per comparison (not adjusted); `verdict`: higher or lower where the interval excludes 0, "
        "else inconclusive, or no interval (fewer than 5 samples, or fewer than "
        f"{MIN_CHANGED} that differ); `failed`: the server's rows without a score."
    )
    return html_page(
        "Engine quality: vLLM's own KV caches, next to the harness's methods",
        [("Per server and comparison", note, engine if len(engine) else None)],
    )


def power_page(report: ReportTables) -> str:
    claims = report.claims[report.claims.n.notna()] if len(report.claims) else report.claims
    columns = ["claim", "model", "protocol", "statistic", "n", "unit", "mde", "effect", "n_needed", "verdict"]
    note = (
        "For each claim with a test: its n (documents where its units share them), the minimum detectable effect "
        "(MDE: two-sided, 80 % power, at this run's spread) and the n at which the stated effect becomes "
        "detectable (the spread held), both at the level the verdict is decided at: alpha over Holm's multiplier "
        "at the claim's step and the test's own Bonferroni factor."
    )
    table_note = (
        "Per comparison of a method with the reference: the spread of the per-sample (per-prompt) "
        "differences, the MDE at the observed n and the n that `report.power.effects` needs, per comparison "
        "(at the report's level, unadjusted: these comparisons are not in the claims' family). "
        "kvbench.report.power.power_table computes it from any run's tables (a pilot)."
    )
    return html_page(
        "How much evidence: minimum detectable effects and the n a run needs",
        [
            ("Per claim", note, claims[columns] if len(claims) else None),
            ("Per comparison", table_note, report.power if len(report.power) else None),
        ],
    )


def overview_page(report: ReportTables) -> str:
    recs = report.recommendations
    glance = None
    if len(recs):
        ordered = recs.assign(_first=recs.protocol != CONTEXT_ONLY).sort_values(
            ["scenario", "_first", "model"], kind="stable"
        )
        glance = _recommendation_rows(ordered).drop(columns=["runner_up", "numbers", "why"])
        glance.insert(0, "scenario", ordered.scenario)
    decided = report.claims.verdict.isin([CONFIRMED, CONTRADICTED]).sum() if len(report.claims) else 0
    return html_page(
        "kvbench report: the answer, the evidence, the stages",
        [
            (
                "Recommendation per scenario",
                "The best method within every limit of the scenario (limits met by the "
                "interval's unfavourable end), its preferred value with interval and n, and the paired comparison "
                "with the runner-up that decided it; `undecided at n = ...` where no method's interval meets every "
                "limit, `undecided at n = ...: a or b` where the best does not beat the runner-up. "
                f"{PROTOCOL_NOTE} Details: page Recommendation.",
                glance,
            ),
            (
                f"Claims: {decided} of {len(report.claims)} decided",
                _claims_note(report.claims) + " Details: page Seed claims.",
                claims_summary(report.claims) if len(report.claims) else None,
            ),
            ("Stages", _not_run_note(report.stages), report.stages),
            (
                "Corpora: diversity, KV compressibility, bytes on the wire",
                "Per corpus: mean token diversity, pooled KV compression ratio per weights variant at the report's "
                "dtype and codec (kv stage), and bytes on the wire through the serve stage with the same codec.",
                report.corpora.drop(columns="sources", errors="ignore") if len(report.corpora) else None,
            ),
        ],
    )


def costs_page(costs: pd.DataFrame) -> str:
    if costs.empty:
        return html_page("Pipeline cost", [("No benchmark files", "benchmarks/ holds no TSV yet.", None)])
    costs = costs.assign(share_pct=100 * costs.share)
    shown = ["stage", "rule", "job", "jobs", "wall_s", "span_s", "share_pct", "max_rss_mb", "cpu_s", "mean_load"]
    note = (
        "wall_s: job-seconds (summed over the jobs), span_s: first start to last end (from file times), "
        "share_pct: of all job-seconds, max_rss_mb: the largest job. The report's own job is not in it: "
        "its benchmark is written after it ends."
    )
    return html_page(
        "Pipeline cost (benchmarks/*.tsv)",
        [
            ("Per stage", note, costs[costs.level == "stage"][shown].drop(columns=["rule", "job"])),
            ("Per rule", "", costs[costs.level == "rule"][shown].drop(columns="job")),
            ("Per job", "", costs[costs.level == "job"][shown].drop(columns=["jobs", "span_s"])),
        ],
    )

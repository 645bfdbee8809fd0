"""The generated regions of the docs, one registry: each is rendered from result tables (a table
block, or a sentence inside a paragraph) or from the code's own declarations, between markers

    <!-- generated:NAME -->...<!-- end generated:NAME -->

so no figure in the docs is typed by hand (kvbench.report.readme writes and checks them).

Where each is declared: the stage tables' blocks below; the sentences of the findings in
kvbench.report.findings; blocks rendered from code below (CODE_BLOCKS); and each benchmark's
blocks in the bench script that writes their table (its `BLOCKS`, for the scripts BENCH_SCRIPTS
names), so a bench owns how its table is shown.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Union

import pandas as pd
import yaml

from kvbench.config import SCHEMA
from kvbench.report.render import fmt, markdown_table

Shown = Union[pd.DataFrame, str]  # a table, or markdown (a sentence) already rendered
# Benchmarks whose scripts declare blocks (bench/<name>.py, `BLOCKS`).
BENCH_SCRIPTS = (
    "shared_prefill",
    "decode_overhead",
    "decode_side_by_side",
    "gpu_methods",
    "kill_resume",
    "serve_transfer",
    "side_by_side",
    "snapkv_agreement",
    "store_priority",
    "turboquant_scores",
)


@dataclass(frozen=True)
class Block:
    """How one generated region is rendered. `tables` are paths under results/ (globs, each
    concatenated over its matches) passed to `render` in that order; a block without tables is
    rendered from the code. `make` is the command that writes the tables; `inline` regions are
    sentences inside a paragraph."""

    render: Callable[..., Shown]
    tables: tuple[str, ...] = ()
    make: str = "make run"
    inline: bool = False


def interval(row: pd.Series, column: str) -> str:
    """` [low, high]` when the table carries an interval for `column` (`<column>_ci_low`,
    `<column>_ci_high`), else nothing: sentences show the interval wherever a table has one."""
    low, high = row.get(f"{column}_ci_low"), row.get(f"{column}_ci_high")
    return "" if low is None or high is None or pd.isna(low) or pd.isna(high) else f" [{fmt(low)}, {fmt(high)}]"


# --- stage tables -------------------------------------------------------------------------------


def _interval(estimate: pd.Series, low: pd.Series, high: pd.Series) -> list[str]:
    return [
        "" if e != e else f"{e:.3g} [{lo:.3g}, {hi:.3g}]" if lo == lo else f"{e:.3g} (no interval)"
        for e, lo, hi in zip(estimate, low, high)
    ]


def _claims(t: pd.DataFrame) -> pd.DataFrame:
    """Each verdict with the test it rests on: statistic, interval, n, MDE, the n the stated effect
    needs, and the Holm-adjusted p-value."""
    n = ["" if v != v else f"{v:.0f} {u}" for v, u in zip(t.n, t.unit)]
    return pd.DataFrame(
        {
            "claim": t.origin + ": " + t.claim,
            "seed's number": t.seed_number,
            "model": t.model,
            "protocol": t.protocol,
            "ours": t.ours,
            "verdict": t.verdict,
            "test": t.compared.fillna("") + "; " + t.statistic.fillna(""),
            "interval": _interval(t.estimate, t.ci_low, t.ci_high),
            "n": n,
            "MDE": t.mde,
            "n needed": t.n_needed,
            "p (Holm)": t.p_holm,
            "source": t.source,
        }
    )


def _recommendations(t: pd.DataFrame) -> pd.DataFrame:
    shown = ["scenario", "model", "protocol", "category", "bucket", "best", "interval", "best_n", "runner_up", "why"]
    return t.assign(interval=_interval(t.best_value, t.best_ci_low, t.best_ci_high))[shown].rename(
        columns={"runner_up": "runner-up", "best_n": "n", "interval": "preferred value [interval]"}
    )


def _costs(t: pd.DataFrame) -> pd.DataFrame:
    """Per stage; CPU seconds next to job-seconds show how much of a job's wall time was its own work
    (far less on a machine other jobs share)."""
    t = t[t.level == "stage"]
    t = t.assign(share=(100 * t.share).round(1))[["stage", "jobs", "wall_s", "cpu_s", "span_s", "share", "max_rss_mb"]]
    return t.rename(
        columns={
            "wall_s": "job-seconds",
            "cpu_s": "CPU seconds",
            "span_s": "span (s)",
            "share": "share %",
            "max_rss_mb": "max RSS (MB)",
        }
    )


def _costs_total(t: pd.DataFrame) -> str:
    """The whole run in one sentence: its job-seconds and its slowest stage."""
    stages = t[t.level == "stage"]
    if stages.empty:
        return "no stage ran"
    top = stages.loc[stages.wall_s.idxmax()]
    return (
        f"the run's {int(stages.jobs.sum())} jobs took {fmt(stages.wall_s.sum())} job-seconds in all, "
        f"the most in stage {top.stage} ({fmt(100 * top.share)} %)"
    )


def _corpus(t: pd.DataFrame) -> pd.DataFrame:
    return t[
        [
            "corpus",
            "domain",
            "docs",
            "tokens_mean",
            "diversity_pct_mean",
            "pooled_diversity_pct",
            "entropy_bits_mean",
            "text_zstd_ratio_mean",
            "reference_diversity_pct",
        ]
    ]


def _kv(t: pd.DataFrame) -> pd.DataFrame:
    """Pooled raw / compressed ratios of the benchmark-style settings against realistic + real weights."""
    keep = t.comparison.isin(["dummy_vs_real", "synthetic_vs_realistic", "synthetic+dummy_vs_realistic+real"])
    t = t[keep & t.codec.isin(["zstd-3", "zstd-3+byteplane"])]
    return t[
        [
            "dtype",
            "codec",
            "benchmark_setting",
            "realistic_setting",
            "benchmark_ratio",
            "realistic_ratio",
            "inflation",
            "layer_inflation",
            "benchmark_below_normal_pct",
        ]
    ].sort_values(["codec", "dtype", "benchmark_setting", "realistic_setting"])


def _system(t: pd.DataFrame) -> pd.DataFrame:
    t = t.assign(kv_mb_end=t.kv_bytes_end / 1e6, failed=t.error.notna())
    out = t.groupby(["model", "method"], sort=False).agg(
        prompts=("prompt_id", "size"),
        failed=("failed", "sum"),
        ttft_s=("ttft_s", "median"),
        tpot_s=("tpot_s", "median"),
        kv_mb_end=("kv_mb_end", "median"),
        ratio_end=("ratio_end", "median"),
    )
    return out.reset_index()


def _quality(t: pd.DataFrame) -> pd.DataFrame:
    t = t[t.category == "all"]
    cols = [
        "model",
        "method",
        "samples",
        "errors",
        "score_mean",
        "score_delta",
        "kl_mean",
        "top1_agreement",
        "identical_outputs",
        "ratio_end_mean",
    ]
    return t[[c for c in cols if c in t.columns]]


def _quality_categories(t: pd.DataFrame) -> pd.DataFrame:
    """Mean task score per model × method (rows) and category (columns, samples in the header)."""
    t = t[t.category != "all"]
    samples = t.groupby("category", sort=False).samples.max()
    out = t.pivot_table(index=["model", "method"], columns="category", values="score_mean", sort=False)
    out = out[[c for c in samples.index if c in out.columns]]
    return out.rename(columns={c: f"{c} ({samples[c]})" for c in out.columns}).reset_index()


def _cam_merge(t: pd.DataFrame) -> str:
    """What CaM's merge costs over the SnapKV selection it shares (`cam-prefill` keeps `snapkv`'s
    positions), per model and protocol."""
    parts = []
    for (model, protocol), cell in t[t.category == "all"].groupby(["model", "protocol"], sort=True):
        rows = cell.set_index("method")
        if not {"snapkv", "cam-prefill"} <= set(rows.index):
            continue
        s, c = rows.loc["snapkv"], rows.loc["cam-prefill"]
        parts.append(
            f"{model}, {protocol}: KL to full {fmt(s.kl_mean)}{interval(s, 'kl_mean')} → "
            f"{fmt(c.kl_mean)}{interval(c, 'kl_mean')}, top-1 agreement {fmt(s.top1_agreement)} → "
            f"{fmt(c.top1_agreement)}"
        )
    if not parts:
        return "not measured in this snapshot (the quality stage ran no `snapkv` and `cam-prefill` pair)"
    return "the merge alone moves (snapkv → cam-prefill) " + "; ".join(parts)


def _serve(t: pd.DataFrame) -> pd.DataFrame:
    cols = [
        "backend",
        "codec",
        "corpus",
        "status",
        "ratio",
        "predicted_ratio",
        "ttft_hit_mean_s",
        "ttft_miss_mean_s",
        "query_hits",
        "outputs_identical_share",
    ]
    return t[[c for c in cols if c in t.columns]]


def _serve_engine(t: pd.DataFrame) -> pd.DataFrame:
    """The blog's comparison on the engine: wire ratio per weights x corpus x codec next to the kv
    stage's prediction; the benchmark cell's inflation over the realistic one with its interval."""
    t = t.sort_values(["codec", "weights", "corpus"])
    return pd.DataFrame(
        {
            "codec": t.codec,
            "weights": t.weights,
            "corpus": t.corpus,
            "served dtype": t.served_dtype,
            "chunks": t.stored_chunks,
            "wire ratio": t.ratio,
            "kv stage's prediction": t.predicted_ratio,
            "inflation over real+realistic [95 %]": _interval(t.inflation, t.inflation_ci_low, t.inflation_ci_high),
            "n (documents)": [
                "" if n == 0 else f"{n} vs {r}" for n, r in zip(t.inflation_n.fillna(0).astype(int), t.realistic_n)
            ],
        }
    )


def _serve_vs_recompute(t: pd.DataFrame) -> pd.DataFrame:
    """TTFT with our connector over recompute's (geometric mean of paired ratios, same weights, corpus
    and concurrency): the
    warm-up that stores every codec, and each codec's misses; each codec's hit TTFT."""
    out = []
    rows = t[(t.backend == "valkey") & t.status.eq("ok")].sort_values(["weights", "corpus", "codec"])
    for r in rows.to_dict("records"):
        what = "warmup" if r["codec"] == "all" else "miss"
        get = lambda key: r.get(f"{what}_{key}", float("nan"))  # noqa: E731
        hit = [r["ttft_hit_median_s"]], [r["ttft_hit_ci_low"]], [r["ttft_hit_ci_high"]]
        low, high = r.get("verdict_ci_low", float("nan")), r.get("verdict_ci_high", float("nan"))
        out.append(
            {
                "weights": r["weights"],
                "corpus": r["corpus"],
                "requests": "warm-up (stores every codec)" if what == "warmup" else f"misses, {r['codec']}",
                "TTFT / recompute [95 %]": _interval(
                    [get("vs_recompute")], [get("vs_recompute_ci_low")], [get("vs_recompute_ci_high")]
                )[0],
                "pairs (recompute's requests)": f"{get('vs_recompute_n'):.0f} ({get('recompute_n'):.0f})",
                "paired by": get("vs_recompute_paired_by"),
                "budget": r.get("overhead_verdict", ""),
                "verdict reads": f"[{low:.3g}, {high:.3g}]" if low == low else "",
                "hit TTFT median s [95 %]": "" if what == "warmup" else _interval(*hit)[0],
                "hits": "" if what == "warmup" else r["query_hits"],
            }
        )
    return pd.DataFrame(out)


def _serve_load(t: pd.DataFrame) -> pd.DataFrame:
    """The load sweep: hit TTFT percentiles (p90 with its interval), misses, throughput, per
    concurrency level and open-loop request rate."""
    t = t.assign(rate_rps=t.rate_rps if "rate_rps" in t else 0.0)
    t = t.sort_values(["weights", "corpus", "backend", "codec", "rate_rps", "concurrency"])
    open_loop = t.rate_rps > 0
    return pd.DataFrame(
        {
            "weights": t.weights,
            "corpus": t.corpus,
            "backend": t.backend,
            "codec": t.codec,
            "in flight": t.concurrency.astype(object).where(~open_loop, "any"),
            "offered requests/s": t.rate_rps.astype(object).where(open_loop, "—"),
            "requests": t.requests,
            "hits": t.hits,
            "hit TTFT p50 s": t.ttft_hit_p50_s,
            "hit TTFT p90 s [95 %]": _interval(t.ttft_hit_p90_s, t.ttft_hit_p90_ci_low, t.ttft_hit_p90_ci_high),
            "miss TTFT p50 s": t.ttft_miss_p50_s,
            "requests/s": t.throughput_rps,
            "errors": t.errors,
        }
    )


def _serve_recommendations(t: pd.DataFrame) -> pd.DataFrame:
    cols = ["scenario", "concurrency", "rate_rps", "prefer", "candidates", "qualifying", "best", "why"]
    return t[[c for c in cols if c in t.columns]]


STAGE_BLOCKS: dict[str, Block] = {
    "claims": Block(_claims, ("report/claims.parquet",)),
    "recommendations": Block(_recommendations, ("report/recommendations.parquet",)),
    "pipeline-cost": Block(_costs, ("report/pipeline_cost.parquet",)),
    "pipeline-cost-total": Block(_costs_total, ("report/pipeline_cost.parquet",), inline=True),
    "corpus": Block(_corpus, ("corpus/stats_summary.parquet",)),
    "kv": Block(_kv, ("kv/summary.parquet",)),
    "system": Block(_system, ("system/metrics.parquet",)),
    "quality": Block(_quality, ("quality/*/summary.parquet",)),
    "quality-categories": Block(_quality_categories, ("quality/*/summary.parquet",)),
    "quality-cam-merge": Block(_cam_merge, ("quality/*/summary.parquet",), inline=True),
    "serve": Block(_serve, ("serve/offload.parquet",)),
    "serve-engine": Block(_serve_engine, ("serve/engine.parquet",)),
    "serve-vs-recompute": Block(_serve_vs_recompute, ("serve/offload.parquet",)),
    "serve-load": Block(_serve_load, ("serve/load.parquet",)),
    "serve-recommendations": Block(_serve_recommendations, ("serve/recommendations.parquet",)),
}


# --- from the code ------------------------------------------------------------------------------


def _method_kinds() -> str:
    """Every method kind: its doc, reference and settings, from kvbench.methods.kinds."""
    from kvbench.methods.kinds import methods_table

    return methods_table()


def _schema_rows(node: dict, path: str) -> list[dict]:
    rows = []
    for key, sub in (node.get("properties") or {}).items():
        name = f"{path}.{key}" if path else key
        kind = sub.get("type", "")
        default = sub.get("default")
        shown = json.dumps(default)
        shown = "" if default is None or isinstance(default, dict) or len(shown) > 40 else f"`{shown}`"
        allowed = " / ".join(map(str, sub.get("enum") or sub.get("items", {}).get("enum", [])))
        rows.append(
            {
                "key": f"`{name}`",
                "type": kind if isinstance(kind, str) else "/".join(kind),
                "default": shown,
                "values": allowed,
                "description": " ".join(str(sub.get("description", "")).split()),
            }
        )
        rows += _schema_rows(sub, name)
        if isinstance(sub.get("additionalProperties"), dict):
            rows += _schema_rows(sub["additionalProperties"], f"{name}.<name>")
    return rows


def _config_options() -> pd.DataFrame:
    """Every key of workflow/schemas/config.schema.yaml: type, default, allowed values, description."""
    return pd.DataFrame(_schema_rows(yaml.safe_load(SCHEMA.read_text()), ""))


def _gpu_cost() -> str:
    """GPU hours of config/gpu.yaml per rule and model, from kvbench.resources' formula (estimates)."""
    from kvbench.resources import cost_table

    config = yaml.safe_load((Path(__file__).resolve().parents[3] / "config" / "gpu.yaml").read_text())
    rows = cost_table(config)
    lines = ["| rule | model | jobs | GPU-hours (estimate) |", "|---|---|---|---|"]
    lines += [f"| {r['rule']} | {r['model']} | {r['jobs']} | {r['gpu_hours']:.2f} |" for r in rows]
    lines.append(f"| total | | {sum(r['jobs'] for r in rows)} | {sum(r['gpu_hours'] for r in rows):.1f} |")
    return "\n".join(lines)


CODE_BLOCKS: dict[str, Block] = {
    "method-kinds": Block(_method_kinds),
    "config-options": Block(_config_options),
    "gpu-cost": Block(_gpu_cost),
}


# --- the registry -------------------------------------------------------------------------------


def bench_script(root: Path, name: str):
    """bench/<name>.py loaded as Python runs it (its folder first on sys.path while it imports, so
    `from side_by_side import ...` works), once per process."""
    if name in sys.modules:
        return sys.modules[name]
    folder = str(root / "bench")
    spec = importlib.util.spec_from_file_location(name, root / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    finally:
        sys.path.remove(folder)
    return module


def registry(root: Path) -> dict[str, Block]:
    """Every block by name: stage tables, findings, code, and each bench script's."""
    from kvbench.report.findings import FINDINGS

    blocks: dict[str, Block] = {}
    sources = [STAGE_BLOCKS, FINDINGS, CODE_BLOCKS, *(bench_script(root, s).BLOCKS for s in BENCH_SCRIPTS)]
    for source in sources:
        twice = set(blocks) & set(source)
        if twice:
            raise ValueError(f"generated block(s) declared twice: {', '.join(sorted(twice))}")
        blocks |= source
    return blocks


def read_tables(block: Block, data: Path) -> tuple[list[pd.DataFrame], list[Path]] | None:
    """The block's tables from `data` (a results/ folder or the docs' snapshot), or None if one is missing."""
    tables, paths = [], []
    for pattern in block.tables:
        found = sorted(data.glob(pattern))
        if not found:
            return None
        tables.append(pd.concat([pd.read_parquet(p) for p in found], ignore_index=True))
        paths += found
    return tables, paths


def render(block: Block, data: Path) -> str:
    """The region's body: the table with a line naming its source tables (as under results/), their
    config hash and commit; a sentence alone; or, without tables, what to run to measure it."""
    if not block.tables:
        shown = block.render()
        return f"\n{shown if isinstance(shown, str) else markdown_table(shown)}\n"
    read = read_tables(block, data)
    if read is None:
        todo = f"`{block.make}`, then `make readme`"
        return f"not measured yet ({todo})" if block.inline else f"\n_Not measured yet: {todo}._\n"
    tables, paths = read
    shown = block.render(*tables)
    if block.inline:
        return shown
    listed = ", ".join(f"`results/{p.relative_to(data).as_posix()}`" for p in paths)
    origin = f"_Generated by `make readme` from {listed}"
    if {"config_hash", "git_commit"} <= set(tables[0].columns) and len(tables[0]):
        first = tables[0].iloc[0]
        commit, dirty = first.git_commit.partition("+")[::2]
        # a table measured on uncommitted changes says so (its commit alone would not be what ran)
        origin += f" (config {first.config_hash}, commit {commit[:12]}{'+' + dirty if dirty else ''})"
    return f"\n{origin}._\n\n{shown if isinstance(shown, str) else markdown_table(shown)}\n"

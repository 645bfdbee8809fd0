"""The README quotes results only through generated blocks: tables rendered from the stages'
Parquet files between markers, so no number in them is typed by hand.

    python -m kvbench.report.readme [--results results] [--check] [README.md]

rewrites every block from the tables (`--check`: exit 1 and name the stale blocks instead). A
block whose table is missing is named and makes the command exit 1; blocks not in the README are
not rendered, so their tables need not exist.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Callable, Union

import numpy as np
import pandas as pd

from kvbench.report.render import markdown_table

START = "<!-- generated:{name} -->"
END = "<!-- end generated:{name} -->"


def _interval(estimate: pd.Series, low: pd.Series, high: pd.Series) -> list[str]:
    return ["" if e != e else f"{e:.3g} [{lo:.3g}, {hi:.3g}]" if lo == lo else f"{e:.3g} (no interval)"
            for e, lo, hi in zip(estimate, low, high)]


def _claims(t: pd.DataFrame) -> pd.DataFrame:
    """Each verdict with the test it rests on: statistic, interval, n, MDE, the n the stated effect
    needs, and the Holm-adjusted p-value."""
    n = ["" if v != v else f"{v:.0f} {u}" for v, u in zip(t.n, t.unit)]
    return pd.DataFrame({
        "claim": t.origin + ": " + t.claim, "seed's number": t.seed_number, "model": t.model, "protocol": t.protocol,
        "ours": t.ours, "verdict": t.verdict, "test": t.compared.fillna("") + "; " + t.statistic.fillna(""),
        "interval": _interval(t.estimate, t.ci_low, t.ci_high), "n": n, "MDE": t.mde, "n needed": t.n_needed,
        "p (Holm)": t.p_holm, "source": t.source})


def _recommendations(t: pd.DataFrame) -> pd.DataFrame:
    shown = ["scenario", "model", "protocol", "category", "bucket", "best", "interval", "best_n", "runner_up", "why"]
    return t.assign(interval=_interval(t.best_value, t.best_ci_low, t.best_ci_high))[shown].rename(
        columns={"runner_up": "runner-up", "best_n": "n", "interval": "preferred value [interval]"})


def _costs(t: pd.DataFrame) -> pd.DataFrame:
    t = t[t.level == "stage"]
    t = t.assign(share=(100 * t.share).round(1))[["stage", "jobs", "wall_s", "span_s", "share", "max_rss_mb"]]
    return t.rename(columns={"wall_s": "job-seconds", "span_s": "span (s)", "share": "share %",
                             "max_rss_mb": "max RSS (MB)"})


def _corpus(t: pd.DataFrame) -> pd.DataFrame:
    return t[["corpus", "domain", "docs", "tokens_mean", "diversity_pct_mean", "pooled_diversity_pct",
              "entropy_bits_mean", "text_zstd_ratio_mean", "reference_diversity_pct"]]


def _kv(t: pd.DataFrame) -> pd.DataFrame:
    """Pooled raw / compressed ratios of the benchmark-style settings against realistic + real weights."""
    keep = t.comparison.isin(["dummy_vs_real", "synthetic_vs_realistic", "synthetic+dummy_vs_realistic+real"])
    t = t[keep & t.codec.isin(["zstd-3", "zstd-3+byteplane"])]
    return t[["dtype", "codec", "benchmark_setting", "realistic_setting", "benchmark_ratio", "realistic_ratio",
              "inflation", "layer_inflation", "benchmark_below_normal_pct"]].sort_values(
        ["codec", "dtype", "benchmark_setting", "realistic_setting"])


def _system(t: pd.DataFrame) -> pd.DataFrame:
    t = t.assign(kv_mb_end=t.kv_bytes_end / 1e6, failed=t.error.notna())
    out = t.groupby(["model", "method"], sort=False).agg(
        prompts=("prompt_id", "size"), failed=("failed", "sum"), ttft_s=("ttft_s", "median"),
        tpot_s=("tpot_s", "median"), kv_mb_end=("kv_mb_end", "median"), ratio_end=("ratio_end", "median"))
    return out.reset_index()


def _quality(t: pd.DataFrame) -> pd.DataFrame:
    t = t[t.category == "all"]
    cols = ["model", "method", "samples", "errors", "score_mean", "score_delta", "kl_mean", "top1_agreement",
            "identical_outputs", "ratio_end_mean"]
    return t[[c for c in cols if c in t.columns]]


def _quality_categories(t: pd.DataFrame) -> pd.DataFrame:
    """Mean task score per model × method (rows) and category (columns, samples in the header)."""
    t = t[t.category != "all"]
    samples = t.groupby("category", sort=False).samples.max()
    out = t.pivot_table(index=["model", "method"], columns="category", values="score_mean", sort=False)
    out = out[[c for c in samples.index if c in out.columns]]
    return out.rename(columns={c: f"{c} ({samples[c]})" for c in out.columns}).reset_index()


def _serve(t: pd.DataFrame) -> pd.DataFrame:
    cols = ["backend", "codec", "corpus", "status", "ratio", "predicted_ratio", "ttft_hit_mean_s",
            "ttft_miss_mean_s", "query_hits", "outputs_identical_share"]
    return t[[c for c in cols if c in t.columns]]


def _peers(pairs: pd.DataFrame) -> pd.DataFrame:
    """bench/side_by_side.py's pairs (whole generations): ratios ours / peer (medians over rounds of
    same-round ratios), raw and divided by each side's DynamicCache run (`÷ DynamicCache`: without
    the two venvs' base speeds; the range is over rounds), each side's overhead over its DynamicCache
    run, both sides' measured bytes and decode steps."""
    pct = lambda col: (100 * pairs[col]).round(1)  # noqa: E731
    return pd.DataFrame({
        "prompt": pairs.prompt_id, "tokens": pairs.context_tokens, "ours": pairs.ours, "peer": pairs.peer,
        "TTFT ours/peer": pairs.ttft_ratio, "TPOT ours/peer": pairs.tpot_ratio,
        "TTFT ours/peer ÷ DynamicCache": pairs.ttft_norm_ratio, "TPOT ours/peer ÷ DynamicCache": pairs.tpot_norm_ratio,
        "TPOT ÷ DynamicCache range": pairs.tpot_norm_ratio_min.round(3).astype(str) + "–" + pairs.tpot_norm_ratio_max.round(3).astype(str),
        "TTFT vs DynamicCache, ours %": pct("ttft_overhead_ours"), "TTFT vs DynamicCache, peer %": pct("ttft_overhead_peer"),
        "TPOT vs DynamicCache, ours %": pct("tpot_overhead_ours"), "TPOT vs DynamicCache, peer %": pct("tpot_overhead_peer"),
        "KV MB ours": pairs.bytes_ours / 1e6, "KV MB peer": pairs.bytes_peer / 1e6,
        "new tokens ours/peer": pairs.new_tokens_ours.astype(str) + "/" + pairs.new_tokens_peer.astype(str),
        "rounds": pairs.rounds})


def _peers_decode(pairs: pd.DataFrame) -> pd.DataFrame:
    """bench/decode_side_by_side.py's pairs (ours and the peers in one process, decode steps
    interleaved): the median over rounds of ours / peer TPOT on the same steps, and its range; each
    side's TPOT over the process's DynamicCache and over its own full cache; both sides' bytes after
    the last step; how often the two predict the same next token; the verdict: `yes` only where ours
    is at least as fast while holding at most the peer's bytes (faster with more: by how much)."""
    faster, extra = pairs.tpot_ratio <= 1, 100 * (pairs.bytes_ours / pairs.bytes_peer - 1)
    more = "faster, +" + extra.round(1).astype(str) + " % bytes"
    verdict = np.select([faster & (extra <= 0), faster], ["yes", more], "no")
    return pd.DataFrame({
        "prompt": pairs.prompt_id, "tokens": pairs.context_tokens, "ours": pairs.ours, "peer": pairs.peer,
        "steps": pairs.steps, "rounds": pairs.rounds, "TPOT ours/peer": pairs.tpot_ratio,
        "range over rounds": pairs.tpot_ratio_min.round(3).astype(str) + "–" + pairs.tpot_ratio_max.round(3).astype(str),
        "TPOT / DynamicCache, ours": pairs.tpot_vs_dynamic_ours, "TPOT / DynamicCache, peer": pairs.tpot_vs_dynamic_peer,
        "TPOT / own full, ours": pairs.tpot_vs_own_full_ours, "TPOT / own full, peer": pairs.tpot_vs_own_full_peer,
        "TPOT ours (s)": pairs.tpot_ours_s, "TPOT peer (s)": pairs.tpot_peer_s,
        "KV MB ours": pairs.bytes_ours / 1e6, "KV MB peer": pairs.bytes_peer / 1e6,
        "same next token %": (100 * pairs.next_token_agreement).round(1), "ours ≤ peer at ≤ its bytes": verdict})


def _snapkv_agreement(t: pd.DataFrame) -> pd.DataFrame:
    """Per prompt, over its (layer, KV head) pairs: the share of kvpress's kept positions ours keeps."""
    out = t.groupby("prompt_id", sort=False).agg(
        tokens=("context_tokens", "first"), heads=("shared", "size"), mean_shared=("shared", "mean"),
        min_shared=("shared", "min"), below_100=("shared", lambda s: int((s < 1).sum())),
        max_gap=("max_relative_score_gap", "max")).reset_index()
    out[["mean_shared", "min_shared"]] = (100 * out[["mean_shared", "min_shared"]]).round(2)
    return out.rename(columns={"prompt_id": "prompt", "heads": "(layer, head) pairs", "mean_shared": "mean shared %",
                               "min_shared": "min shared %", "below_100": "pairs below 100 %",
                               "max_gap": "max relative score gap"})


def _decode_overhead(t: pd.DataFrame) -> pd.DataFrame:
    """Per method: the median over steps of the step's time over the same step's `full` time
    (the bench interleaves methods within a step), wall clock and process CPU time."""
    columns = {}
    for clock, label in (("seconds", "wall"), ("cpu_seconds", "CPU")):
        per_step = t.pivot(index="step", columns="method", values=clock)
        columns[f"TPOT / full ({label})"] = per_step.div(per_step["full"], axis=0).median()
    per_method = t.sort_values("step").groupby("method")
    out = pd.DataFrame({"tokens": per_method.context_tokens.first(), "steps": per_method.step.nunique(),
                        "TPOT (s, wall)": per_method.seconds.median(), **columns,
                        "KV MB": per_method.kv_bytes.last() / 1e6})
    return out.sort_values("TPOT / full (wall)").rename_axis("method").reset_index()


def _turboquant_scores(t: pd.DataFrame) -> pd.DataFrame:
    """Per method: key-score error on real K and queries, and next-token fidelity to full."""
    return t[["method", "score_bias", "score_error_std", "attention_kl", "attention_top1", "next_token_kl",
              "top1_agreement"]].round(4)


def _kill_resume(kills: pd.DataFrame, tables: pd.DataFrame) -> str:
    """Per kill: the stage, when, what snakemake held incomplete, what survived it; then the
    comparison of every final table with the uninterrupted run's."""
    def outputs(value: object) -> str:
        return ", ".join(f"`{o}`" for o in value) if value is not None and len(value) else ""

    shown = pd.DataFrame({
        "stage": kills.stage, "killed": kills.killed, "mid-job": kills.get("interrupted"),
        "killed after (s)": kills.get("killed_after_s"), "incomplete outputs": kills.incomplete_jobs.map(outputs),
        "jobs that logged their cleanup": kills.get("jobs_cleaned_up"),
        "processes after 120 s": kills.get("processes_after_120s"), "unlock return code": kills.get("unlock_returncode"),
        "note": kills.note})
    equal = int(tables.equal.sum())
    mid_job = int(kills.interrupted.sum()) if "interrupted" in kills else 0
    differing = ", ".join(f"`{t}` ({c})" for t, c in zip(tables.table[~tables.equal], tables.differing_columns[~tables.equal]))
    summary = (f"{mid_job}/{len(kills)} stages killed mid-job; "
               f"{equal}/{len(tables)} final tables equal to the uninterrupted run's (timing columns aside)"
               + (f"; differing: {differing}" if differing else "")
               + f". Uninterrupted run {kills.reference_run_s.iloc[0]:.0f} s; interrupted run "
               f"({int(kills.killed.sum())} kills, unlocks and the final rerun) {kills.interrupted_run_s.iloc[0]:.0f} s."
               + (f" Both runs ran commit {kills.code_commit.iloc[0][:12]}." if "code_commit" in kills else ""))
    return f"{markdown_table(shown)}\n\n{summary}"


Shown = Union[pd.DataFrame, str]  # a table, or markdown already rendered
# block -> (tables it reads, relative to results/, each globbed and concatenated; how they are shown)
BLOCKS: dict[str, tuple[tuple[str, ...], Callable[..., Shown]]] = {
    "claims": (("report/claims.parquet",), _claims),
    "recommendations": (("report/recommendations.parquet",), _recommendations),
    "pipeline-cost": (("report/pipeline_cost.parquet",), _costs),
    "corpus": (("corpus/stats_summary.parquet",), _corpus),
    "kv": (("kv/summary.parquet",), _kv),
    "system": (("system/metrics.parquet",), _system),
    "quality": (("quality/*/summary.parquet",), _quality),
    "quality-categories": (("quality/*/summary.parquet",), _quality_categories),
    "serve": (("serve/offload.parquet",), _serve),
    "peers": (("bench/side_by_side_pairs.parquet",), _peers),
    "peers-decode": (("bench/decode_side_by_side_pairs.parquet",), _peers_decode),
    "snapkv-agreement": (("bench/snapkv_agreement.parquet",), _snapkv_agreement),
    "decode-overhead": (("bench/decode_overhead.parquet",), _decode_overhead),
    "turboquant-scores": (("bench/turboquant_scores.parquet",), _turboquant_scores),
    "kill-resume": (("bench/kill_resume.parquet", "bench/kill_resume_tables.parquet"), _kill_resume),
}


def render_block(name: str, results: Path) -> str:
    patterns, show = BLOCKS[name]
    tables, where = [], []
    for pattern in patterns:
        paths = sorted(results.glob(pattern))
        if not paths:
            raise FileNotFoundError(f"block {name}: no table {results / pattern} (run the stage or bench that writes it)")
        tables.append(pd.concat([pd.read_parquet(p) for p in paths], ignore_index=True))
        where += paths
    prov = tables[0][["config_hash", "git_commit"]].iloc[:1]
    listed = ", ".join(f"`{p.as_posix()}`" for p in where)
    origin = (f"_Generated from {listed} (config {prov.config_hash.iloc[0]}, commit "
              f"{prov.git_commit.iloc[0][:12]}) by `python -m kvbench.report.readme`._" if len(prov) else "")
    shown = show(*tables)
    return f"{origin}\n\n{shown if isinstance(shown, str) else markdown_table(shown)}"


def update(text: str, results: Path) -> tuple[str, list[str], list[str]]:
    """The text with every block it holds rewritten, the names of blocks that changed, and the
    reasons of blocks left as they were because a table is missing (the README holds every block:
    tests/test_report_tables.py)."""
    changed, missing = [], []
    for name in BLOCKS:
        pattern = re.compile(re.escape(START.format(name=name)) + r"(.*?)" + re.escape(END.format(name=name)), re.S)
        found = pattern.search(text)
        if not found:
            continue
        try:
            body = f"\n{render_block(name, results)}\n"
        except FileNotFoundError as err:
            missing.append(str(err))
            continue
        if found.group(1) != body:
            changed.append(name)
            text = text[:found.start(1)] + body + text[found.end(1):]
    return text, changed, missing


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("readme", nargs="?", default="README.md", type=Path)
    parser.add_argument("--results", default=Path("results"), type=Path)
    parser.add_argument("--check", action="store_true", help="exit 1 if a block differs from the tables")
    args = parser.parse_args(argv)
    text, changed, missing = update(args.readme.read_text(), args.results)
    for reason in missing:
        print(f"{args.readme}: {reason}", file=sys.stderr)
    if args.check:
        if changed:
            print(f"{args.readme}: stale generated block(s): {', '.join(changed)}", file=sys.stderr)
        return 1 if changed or missing else 0
    args.readme.write_text(text)
    print(f"{args.readme}: rewrote {', '.join(changed) or 'nothing (up to date)'}"
          + (f"; {len(missing)} block(s) left as they were, their tables missing" if missing else ""))
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())

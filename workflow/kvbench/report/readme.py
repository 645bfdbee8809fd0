"""The README quotes results only through generated blocks: tables rendered from the stages'
Parquet files between markers, so no number in them is typed by hand.

    python -m kvbench.report.readme [--results results] [--check] [README.md]

rewrites every block from the tables (`--check`: exit 1 and name the stale blocks instead).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Callable

import pandas as pd

from kvbench.report.render import markdown_table

START = "<!-- generated:{name} -->"
END = "<!-- end generated:{name} -->"


def _claims(t: pd.DataFrame) -> pd.DataFrame:
    t = t.assign(claim=t.origin + ": " + t.claim)
    return t[["claim", "seed_number", "model", "ours", "verdict", "source"]].rename(
        columns={"seed_number": "seed's number"})


def _recommendations(t: pd.DataFrame) -> pd.DataFrame:
    return t[["scenario", "model", "category", "bucket", "best", "runner_up", "why"]].rename(
        columns={"runner_up": "runner-up"})


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


def _serve(t: pd.DataFrame) -> pd.DataFrame:
    cols = ["backend", "codec", "corpus", "status", "ratio", "predicted_ratio", "ttft_hit_mean_s",
            "ttft_miss_mean_s", "query_hits", "outputs_identical_share"]
    return t[[c for c in cols if c in t.columns]]


# block -> (tables it reads, relative to results/, globbed and concatenated; how it is shown)
BLOCKS: dict[str, tuple[str, Callable[[pd.DataFrame], pd.DataFrame]]] = {
    "claims": ("report/claims.parquet", _claims),
    "recommendations": ("report/recommendations.parquet", _recommendations),
    "pipeline-cost": ("report/pipeline_cost.parquet", _costs),
    "corpus": ("corpus/stats_summary.parquet", _corpus),
    "kv": ("kv/summary.parquet", _kv),
    "system": ("system/metrics.parquet", _system),
    "quality": ("quality/*/summary.parquet", _quality),
    "serve": ("serve/offload.parquet", _serve),
}


def render_block(name: str, results: Path) -> str:
    pattern, table_of = BLOCKS[name]
    paths = sorted(results.glob(pattern))
    if not paths:
        raise FileNotFoundError(f"block {name}: no table {results / pattern} (run `make run` first)")
    table = pd.concat([pd.read_parquet(p) for p in paths], ignore_index=True)
    prov = table[["config_hash", "git_commit"]].iloc[:1]
    where = ", ".join(f"`{p.as_posix()}`" for p in paths)
    origin = (f"_Generated from {where} (config {prov.config_hash.iloc[0]}, commit "
              f"{prov.git_commit.iloc[0][:12]}) by `python -m kvbench.report.readme`._" if len(prov) else "")
    return f"{origin}\n\n{markdown_table(table_of(table))}"


def update(text: str, results: Path) -> tuple[str, list[str]]:
    """The text with every block it holds rewritten, and the names of blocks that changed (the
    README holds them all: tests/test_report_tables.py)."""
    changed = []
    for name in BLOCKS:
        pattern = re.compile(re.escape(START.format(name=name)) + r"(.*?)" + re.escape(END.format(name=name)), re.S)
        found = pattern.search(text)
        if not found:
            continue
        body = f"\n{render_block(name, results)}\n"
        if found.group(1) != body:
            changed.append(name)
            text = text[:found.start(1)] + body + text[found.end(1):]
    return text, changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("readme", nargs="?", default="README.md", type=Path)
    parser.add_argument("--results", default=Path("results"), type=Path)
    parser.add_argument("--check", action="store_true", help="exit 1 if a block differs from the tables")
    args = parser.parse_args(argv)
    text, changed = update(args.readme.read_text(), args.results)
    if args.check:
        if changed:
            print(f"{args.readme}: stale generated block(s): {', '.join(changed)}", file=sys.stderr)
        return 1 if changed else 0
    args.readme.write_text(text)
    print(f"{args.readme}: rewrote {', '.join(changed) or 'nothing (up to date)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The README quotes results only through generated blocks: tables rendered from the report
stage's Parquet files between markers, so no number in them is typed by hand.

    python -m kvbench.report.readme [--results results/report] [--check] [README.md]

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


def _claims(d: Path) -> pd.DataFrame:
    t = pd.read_parquet(d / "claims.parquet")
    t = t.assign(claim=t.origin + ": " + t.claim)
    return t[["claim", "seed_number", "model", "ours", "verdict", "source"]].rename(
        columns={"seed_number": "seed's number"})


def _recommendations(d: Path) -> pd.DataFrame:
    t = pd.read_parquet(d / "recommendations.parquet")
    return t[["scenario", "model", "category", "bucket", "best", "runner_up", "why"]].rename(
        columns={"runner_up": "runner-up"})


def _costs(d: Path) -> pd.DataFrame:
    t = pd.read_parquet(d / "pipeline_cost.parquet")
    t = t[t.level == "stage"]
    t = t.assign(share=(100 * t.share).round(1))[["stage", "jobs", "wall_s", "span_s", "share", "max_rss_mb"]]
    return t.rename(columns={"wall_s": "job-seconds", "span_s": "span (s)", "share": "share %",
                             "max_rss_mb": "max RSS (MB)"})


BLOCKS: dict[str, tuple[str, Callable[[Path], pd.DataFrame]]] = {
    "claims": ("claims.parquet", _claims),
    "recommendations": ("recommendations.parquet", _recommendations),
    "pipeline-cost": ("pipeline_cost.parquet", _costs),
}


def render_block(name: str, results: Path) -> str:
    file, table_of = BLOCKS[name]
    path = results / file
    prov = pd.read_parquet(path, columns=["config_hash", "git_commit"]).iloc[:1]
    origin = (f"_Generated from `{path.as_posix()}` (config {prov.config_hash.iloc[0]}, commit "
              f"{prov.git_commit.iloc[0][:12]}) by `python -m kvbench.report.readme`._" if len(prov) else "")
    return f"{origin}\n\n{markdown_table(table_of(results))}"


def update(text: str, results: Path) -> tuple[str, list[str]]:
    """The README with every block rewritten, and the names of blocks that changed."""
    changed = []
    for name in BLOCKS:
        pattern = re.compile(re.escape(START.format(name=name)) + r"(.*?)" + re.escape(END.format(name=name)), re.S)
        found = pattern.search(text)
        if not found:
            raise ValueError(f"README has no block {START.format(name=name)} ... {END.format(name=name)}")
        body = f"\n{render_block(name, results)}\n"
        if found.group(1) != body:
            changed.append(name)
            text = text[:found.start(1)] + body + text[found.end(1):]
    return text, changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("readme", nargs="?", default="README.md", type=Path)
    parser.add_argument("--results", default=Path("results/report"), type=Path)
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

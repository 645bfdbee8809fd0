"""The quality stage's budget: wall time of every job (Snakemake's benchmark TSVs) and the share of
the method jobs' time spent outside model forward passes (imports, model loading, lm-eval, task
loading, metrics, writing), from results/quality/<model>/jobs.parquet.

    .venv/bin/python bench/quality_stage.py --run     # rerun the stage (default config), then report
    .venv/bin/python bench/quality_stage.py           # report on the last run

Budget (issue 9): the default stage <= 10 minutes on this 2-core machine, <= 15 % outside forward
passes. Run it on a quiet machine: timings taken while other jobs share the cores mean little.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pandas as pd
import yaml

from kvbench.batches import batches

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", action="store_true", help="rerun the quality stage first (--forcerun quality_tasks)")
    parser.add_argument("--config", default=str(REPO / "config" / "config.yaml"))
    args = parser.parse_args()
    config = yaml.safe_load(Path(args.config).read_text())
    models = config["quality"]["models"]
    targets = [f"results/quality/{m}/summary.parquet" for m in models]
    if args.run:
        snakemake = str(Path(sys.executable).with_name("snakemake"))
        subprocess.run(
            [snakemake, "--cores", "all", "--configfile", args.config, "--forcerun", "quality_tasks", *targets],
            cwd=REPO,
            check=True,
        )
    # The stage's jobs in this config (a file of a renamed rule or an earlier layout would count twice).
    n_jobs = len(
        batches(
            config["quality"]["methods"],
            config["quality"].get("reference", "full"),
            config["quality"].get("methods_per_job"),
        )
    )
    names = [
        "tasks",
        *(f"{m}/{name}" for m in models for name in [*(f"job{i}" for i in range(1, n_jobs + 1)), "summary"]),
    ]
    rows = [
        {
            "job": name,
            "wall_s": float(pd.read_csv(REPO / "benchmarks" / "quality" / f"{name}.tsv", sep="\t")["s"].iloc[0]),
        }
        for name in names
    ]
    jobs = pd.DataFrame(rows)
    print(jobs.to_string(index=False, float_format="%.1f"))
    print(
        f"\nquality stage: {jobs.wall_s.sum():.0f} s ({jobs.wall_s.sum() / 60:.1f} min) over {len(jobs)} jobs, "
        "run one after another (each method job takes the whole machine)"
    )
    for model in models:
        timing = pd.read_parquet(REPO / "results" / "quality" / model / "jobs.parquet")
        wall, forward = timing.job_wall_s.sum(), timing.job_forward_s.sum()
        print(
            f"{model}: {len(timing)} method job(s) {wall:.0f} s, forward passes {forward:.0f} s, outside them "
            f"{wall - forward:.0f} s = {(wall - forward) / wall:.1%} of the method jobs, "
            f"{(jobs.wall_s.sum() - forward) / jobs.wall_s.sum():.1%} of the stage"
        )


if __name__ == "__main__":
    main()

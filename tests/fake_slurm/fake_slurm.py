#!/usr/bin/env python3
"""A FAKE SLURM for running the real snakemake-executor-plugin-slurm on a machine without SLURM.

Not a scheduler anyone should use: it answers the commands the plugin calls (sbatch, squeue,
sacct, scancel, srun, sinfo, sacctmgr, sshare), named as such through symlinks in this folder.
`sbatch` stores the job script and starts a detached runner that waits until one of the
FAKE_SLURM_NODES fake nodes (default 1) has the job's CPUs free, runs the script locally in its own
process group with the SLURM_* variables a job sees, confined to the CPUs it was given (as SLURM's
cpuset confines a job: a server the job starts binds those), and records its state. The nodes split
this machine's CPUs between them; a job asking for more CPUs than a node has gets the whole node
(the profile's counts are for real GPU nodes). `scancel` sends SIGTERM to the job's group, then SIGKILL after FAKE_SLURM_KILL_WAIT_S (as KillWait).

As strict as a real site where a real site refuses (the messages are Slurm's own), against the
cluster that FAKE_SLURM_CLUSTER (a JSON file) describes, else DEFAULT_CLUSTER: sbatch refuses an
account the site does not have, an unknown partition, a GPU type (GRES) the partition lacks or more
GPUs than its nodes hold, memory, CPUs or time above its nodes' or its limit; a job step (`srun`) in
a job submitted with both --ntasks-per-gpu and --cpus-per-task dies as Slurm >= 23.11 makes it die
(the executor plugin 2.6.1 sends both by default: its issues #342, #373). sacctmgr lists the
site's accounts (the plugin checks the given one against them) and sinfo its partitions.

State lives in FAKE_SLURM_DIR (default ./.fake_slurm): one JSON file per job. While the file
FAKE_SLURM_HOLD names exists, no job starts (a queue wait a test can end when it chooses).
Usage: PATH=tests/fake_slurm:$PATH snakemake --workflow-profile workflow/profiles/slurm ...
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

STATE = Path(os.environ.get("FAKE_SLURM_DIR", ".fake_slurm")).resolve()
NODES = int(os.environ.get("FAKE_SLURM_NODES", "1"))
KILL_WAIT_S = float(os.environ.get("FAKE_SLURM_KILL_WAIT_S", "10"))
HOLD = os.environ.get("FAKE_SLURM_HOLD")
FINAL = ("COMPLETED", "FAILED", "CANCELLED")
# sbatch options that take no value (everything else with a leading dash takes one).
SBATCH_FLAGS = {"--parsable", "--requeue", "--no-requeue", "--exclusive", "-H", "--hold"}
# A small site: CPU nodes and GPU nodes of 4 A100s or 4 H100s each (memory per node in MB).
DEFAULT_CLUSTER: dict[str, Any] = {
    "accounts": ["kvbench"],
    "partitions": {
        "cpu": {"default": True, "node_mem_mb": 64000, "node_cpus": 64, "max_time_min": 2880, "gres": {}},
        "gpu": {"node_mem_mb": 262144, "node_cpus": 64, "max_time_min": 2880, "gres": {"a100": 4, "h100": 4}},
    },
}
TRES_FATAL = "srun: fatal: SLURM_TRES_PER_TASK is mutually exclusive with --ntasks-per-gpu and SLURM_NTASKS_PER_GPU"


def cluster() -> dict[str, Any]:
    path = os.environ.get("FAKE_SLURM_CLUSTER")
    return json.loads(Path(path).read_text()) if path else DEFAULT_CLUSTER


def refused(reason: str, detail: str | None = None) -> int:
    if detail:
        print(f"sbatch: error: {detail}", file=sys.stderr)
    print(f"sbatch: error: Batch job submission failed: {reason}", file=sys.stderr)
    return 1


def _minutes(value: str) -> float:
    """A SLURM time in minutes: `M`, `M:S`, `H:M:S`, or `D-H`, `D-H:M`, `D-H:M:S`."""
    days, _, rest = value.rpartition("-")
    parts = [float(p) for p in rest.split(":")]
    if days:  # D-H[:M[:S]]
        hours, minutes, seconds = (parts + [0.0, 0.0])[:3]
    elif len(parts) == 3:
        hours, minutes, seconds = parts
    else:  # M[:S]
        hours, minutes, seconds = 0.0, parts[0], (parts[1:] or [0.0])[0]
    return float(days or 0) * 1440 + hours * 60 + minutes + seconds / 60


def _gpus(options: dict[str, str]) -> tuple[str | None, int] | None:
    """(GPU type or None, count) from --gpus=[type:]N or --gres=gpu[:type][:N]; None: no GPU asked."""
    if spec := options.get("--gpus") or options.get("-G"):
        kind, _, count = spec.rpartition(":")
        return kind or None, int(count)
    for gres in filter(None, (options.get("--gres") or "").split(",")):
        name, *rest = gres.split(":")
        if name == "gpu":
            count = int(rest[-1]) if rest and rest[-1].isdigit() else 1
            return (rest[0] if rest and not rest[0].isdigit() else None), count
    return None


def site_refusal(options: dict[str, str]) -> int | None:
    """What a real slurmctld answers a submission this site cannot run (None: accepted)."""
    site = cluster()
    account = options.get("-A") or options.get("--account")
    if account is not None and account not in site["accounts"]:
        return refused("Invalid account or account/partition combination specified")
    partitions = site["partitions"]
    name = options.get("-p") or options.get("--partition") or next(p for p, v in partitions.items() if v.get("default"))
    if name not in partitions:
        return refused("Invalid partition name specified", f"invalid partition specified: {name}")
    part = partitions[name]
    gpus = _gpus(options)
    if gpus is not None:
        kind, count = gpus
        have = part["gres"].get(kind, 0) if kind else sum(part["gres"].values())
        if have < count:
            return refused("Invalid generic resource (gres) specification")
    if (mem := options.get("--mem")) is not None and int(mem.rstrip("M")) > part["node_mem_mb"]:
        return refused("Requested node configuration is not available", "Memory specification can not be satisfied")
    cpus = options.get("--cpus-per-task") or options.get("-c")
    if cpus is not None and int(cpus) > part["node_cpus"]:
        return refused("Requested node configuration is not available")
    limit = options.get("-t") or options.get("--time")
    if limit is not None and _minutes(limit) > part["max_time_min"]:
        return refused("Requested time limit is invalid (missing or exceeds some limit)")
    return None


@contextmanager
def locked() -> Iterator[None]:
    STATE.mkdir(parents=True, exist_ok=True)
    with open(STATE / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def node_cpus() -> list[list[int]]:
    """Node n's CPUs: consecutive shares of the submitting process's CPUs, as even as they divide,
    fixed by the first sbatch (in STATE) so that every runner splits them the same way. Call locked."""
    path = STATE / "nodes.json"
    if not path.exists():
        cpus = sorted(os.sched_getaffinity(0))
        path.write_text(json.dumps([cpus[n * len(cpus) // NODES : (n + 1) * len(cpus) // NODES] for n in range(NODES)]))
    return json.loads(path.read_text())


def job_file(job_id: int | str) -> Path:
    return STATE / "jobs" / f"{job_id}.json"


def read_job(job_id: int | str) -> dict[str, Any]:
    return json.loads(job_file(job_id).read_text())


def write_job(job: dict[str, Any]) -> None:
    path = job_file(job["id"])
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(job))
    tmp.replace(path)


def all_jobs() -> list[dict[str, Any]]:
    folder = STATE / "jobs"
    return (
        sorted((json.loads(p.read_text()) for p in folder.glob("*.json")), key=lambda j: j["id"])
        if folder.is_dir()
        else []
    )


def parse_sbatch(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    options: dict[str, str] = {}
    positional: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--") and "=" in arg:
            key, value = arg.split("=", 1)
            options[key] = value
        elif arg in SBATCH_FLAGS:
            options[arg] = ""
        elif arg.startswith("-") and len(arg) > 1 and not positional:
            options[arg] = argv[i + 1]
            i += 1
        else:
            positional.append(arg)
        i += 1
    return options, positional


def sbatch(argv: list[str]) -> int:
    options, positional = parse_sbatch(argv)
    if "--wrap" in options:
        script = f"#!/bin/sh\n{options['--wrap']}\n"
    elif positional:
        script = sys.stdin.read() if positional[0] in ("-", "/dev/stdin") else Path(positional[0]).read_text()
    else:
        print("sbatch: error: no script and no --wrap", file=sys.stderr)
        return 1
    cpus = options.get("--cpus-per-task") or options.get("-c") or options.get("--cpus-per-gpu") or "1"
    if not 1 <= NODES <= len(os.sched_getaffinity(0)):
        print(f"sbatch: error: FAKE_SLURM_NODES={NODES}: between 1 and the CPUs here", file=sys.stderr)
        return 1
    if int(cpus) < 1:
        print(f"sbatch: error: --cpus-per-task={cpus}", file=sys.stderr)
        return 1
    if (refusal := site_refusal(options)) is not None:
        return refusal
    with locked():
        node_cpus()
        counter = STATE / "last_id"
        job_id = int(counter.read_text()) + 1 if counter.exists() else 1000
        counter.write_text(str(job_id))
        (STATE / "jobs").mkdir(exist_ok=True)
        (STATE / "jobs" / f"{job_id}.sh").write_text(script)
        workdir = options.get("-D") or options.get("--chdir") or os.getcwd()
        output = (options.get("--output") or options.get("-o") or f"slurm-{job_id}.out").replace("%j", str(job_id))
        write_job(
            {
                "id": job_id,
                "name": options.get("--job-name") or options.get("-J", "sbatch"),
                "comment": options.get("--comment", ""),
                "cpus": int(cpus),  # asked for; at the start, what it got
                "cpu_ids": [],
                "gpus": options.get("--gpus") or options.get("--gres", ""),
                "partition": options.get("-p", ""),
                "account": options.get("-A", ""),
                "mem_mb": options.get("--mem"),
                "time": options.get("-t"),
                # both set: every job step dies (TRES_FATAL), as on Slurm >= 23.11
                "ntasks_per_gpu": options.get("--ntasks-per-gpu"),
                "cpus_per_task": options.get("--cpus-per-task") or options.get("-c"),
                "workdir": workdir,
                "output": str(Path(workdir, output)),
                "state": "PENDING",
                "exit_code": None,
                "pgid": None,
                "submitted": time.time(),
            }
        )
    subprocess.Popen(
        [sys.executable, os.path.realpath(__file__), "_run", str(job_id)],
        start_new_session=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "FAKE_SLURM_DIR": str(STATE)},
    )
    print(job_id if "--parsable" in options else f"Submitted batch job {job_id}")
    return 0


def _alive(pgid: int | None) -> bool:
    if pgid is None:
        return False
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def node_name(node: int) -> str:
    return "fakenode" if node == 0 else f"fakenode{node}"


def _try_start(job_id: int) -> dict[str, Any] | None:
    """Allocate the job's CPUs on the first node that has them free, if no older job waits (FIFO)."""
    with locked():
        job = read_job(job_id)
        if job["state"] != "PENDING":
            return job
        jobs = all_jobs()
        older_waiting = any(j["state"] == "PENDING" and j["id"] < job_id for j in jobs)
        if older_waiting or (HOLD and Path(HOLD).exists()):
            return None
        taken = {c for j in jobs if j["state"] in ("RUNNING", "STARTING") for c in j["cpu_ids"]}
        for node, cpus in enumerate(node_cpus()):
            free, need = [c for c in cpus if c not in taken], min(job["cpus"], len(cpus))
            if len(free) >= need:
                job.update(state="STARTING", node=node, cpus=need, cpu_ids=free[:need])
                write_job(job)
                return job
        return None


def run(job_id: int) -> int:
    """The runner behind one submitted job (detached from sbatch)."""
    while (job := _try_start(job_id)) is None:
        time.sleep(0.2)
    if job["state"] != "STARTING":  # cancelled while pending
        return 0
    env = {
        **os.environ,
        "SLURM_JOB_ID": str(job_id),
        "SLURM_JOBID": str(job_id),
        "SLURM_JOB_NAME": job["name"],
        "SLURM_CPUS_PER_TASK": str(job["cpus"]),
        "SLURM_SUBMIT_DIR": job["workdir"],
        "SLURM_JOB_PARTITION": job["partition"],
        "SLURM_CLUSTER_NAME": "fake",
        "SLURMD_NODENAME": node_name(job["node"]),
    }
    if job["gpus"]:
        env["SLURM_GPUS"] = job["gpus"]
    try:
        Path(job["output"]).parent.mkdir(parents=True, exist_ok=True)
        out = open(job["output"], "ab")
        proc = subprocess.Popen(
            ["/bin/sh", str(STATE / "jobs" / f"{job_id}.sh")],
            cwd=job["workdir"],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=lambda: os.sched_setaffinity(0, job["cpu_ids"]),
        )
    except (OSError, subprocess.SubprocessError) as err:  # the job never started: it fails, its CPUs free
        with locked():
            write_job(read_job(job_id) | {"state": "FAILED", "exit_code": 1, "ended": time.time(), "reason": str(err)})
        return 0
    with out:
        with locked():
            job = read_job(job_id)
            job.update(state="RUNNING", pgid=proc.pid, started=time.time())
            write_job(job)
            if job.get("cancel_requested"):  # scancel came while it was starting (no group to signal yet)
                os.killpg(proc.pid, signal.SIGTERM)
        code = proc.wait()
    with locked():
        job = read_job(job_id)
        cancelled = job.get("cancel_requested")
        job.update(
            state="CANCELLED" if cancelled else ("COMPLETED" if code == 0 else "FAILED"),
            exit_code=code,
            ended=time.time(),
        )
        write_job(job)
    return 0


def scancel(argv: list[str]) -> int:
    ids = [a.split("_")[0] for a in argv if not a.startswith("-")]
    groups = []
    with locked():
        for job_id in ids:
            if not job_file(job_id).exists():
                continue
            job = read_job(job_id)
            if job["state"] in FINAL:
                continue
            job["cancel_requested"] = True
            if job["state"] == "PENDING":
                job["state"] = "CANCELLED"
            elif job["pgid"]:
                groups.append(job["pgid"])
            write_job(job)
    for pgid in groups:
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + KILL_WAIT_S
    while any(map(_alive, groups)) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pgid in filter(_alive, groups):
        os.killpg(pgid, signal.SIGKILL)
    return 0


def _named(argv: list[str]) -> list[dict[str, Any]]:
    name = argv[argv.index("--name") + 1] if "--name" in argv else None
    return [j for j in all_jobs() if name is None or j["name"] == name]


def _shown_state(job: dict[str, Any]) -> str:
    return "PENDING" if job["state"] == "STARTING" else job["state"]


def sacct(argv: list[str]) -> int:
    if "-j" in argv:  # per-step reasons and node lists after a failure
        if any(a.startswith("nodelist") for a in argv):
            job_id = argv[argv.index("-j") + 1].split(".")[0]
            print(node_name(read_job(job_id).get("node", 0)) if job_file(job_id).exists() else "fakenode")
        return 0
    for job in _named(argv):
        print(f"{job['id']}|{_shown_state(job)}")
    return 0


def squeue(argv: list[str]) -> int:
    for job in _named(argv):
        print(f"{job['id']}|{_shown_state(job)}")
    return 0


def srun(argv: list[str]) -> int:
    """Run the command after srun's options in place (the job already holds its CPUs). A step of a
    job submitted with --ntasks-per-gpu and --cpus-per-task dies before it starts, as Slurm's does:
    the job's TRES per task and its tasks per GPU are read from the allocation, whatever the step's
    environment holds (the plugin's jobstep drops the SLURM_* variables; the error stays)."""
    job_id = os.environ.get("SLURM_JOB_ID")
    if job_id and job_file(job_id).exists():
        job = read_job(job_id)
        if job.get("ntasks_per_gpu") and (
            job.get("cpus_per_task") or any(a.startswith("--cpus-per-task") for a in argv)
        ):
            print(TRES_FATAL, file=sys.stderr)
            return 1
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        i += 1
    if i == len(argv):
        print("srun: error: no command", file=sys.stderr)
        return 1
    os.execvp(argv[i], argv[i:])
    return 1


def sinfo(argv: list[str]) -> int:
    """One line per partition (and GPU type), in the `-o` format's fields %P (name, `*` marks the
    default), %G (GRES, `gpu:type:count` or `(null)`), %m (memory per node, MB), %c (CPUs per node),
    %l (time limit); a header unless -h. Default format: %P."""
    fmt = argv[argv.index("-o") + 1] if "-o" in argv else next((a[2:] for a in argv if a.startswith("-o")), "%P")
    if not any("-h" == a or a == "--noheader" for a in argv):
        print(
            fmt.replace("%P", "PARTITION")
            .replace("%G", "GRES")
            .replace("%m", "MEMORY")
            .replace("%c", "CPUS")
            .replace("%l", "TIMELIMIT")
        )
    for name, part in cluster()["partitions"].items():
        for gres in [f"gpu:{k}:{n}" for k, n in part["gres"].items()] or ["(null)"]:
            fields = {
                "%P": name + ("*" if part.get("default") else ""),
                "%G": gres,
                "%m": str(part["node_mem_mb"]),
                "%c": str(part["node_cpus"]),
                "%l": f"{int(part['max_time_min']) // 1440}-00:00:00",
            }
            line = fmt
            for key, value in fields.items():
                line = line.replace(key, value)
            print(line)
    return 0


def sacctmgr(argv: list[str]) -> int:
    """The site's accounts, one a line (as `sacctmgr -n -s list user U format=account`)."""
    print("\n".join(cluster()["accounts"]))
    return 0


def silent(argv: list[str]) -> int:
    """sshare: nothing (the plugin asks sacctmgr first)."""
    return 0


COMMANDS = {
    "sbatch": sbatch,
    "scancel": scancel,
    "sacct": sacct,
    "squeue": squeue,
    "srun": srun,
    "sinfo": sinfo,
    "sacctmgr": sacctmgr,
    "sshare": silent,
}


def main() -> int:
    name = Path(sys.argv[0]).name
    if name == "fake_slurm.py" and sys.argv[1:2] == ["_run"]:
        return run(int(sys.argv[2]))
    if name not in COMMANDS:
        print(f"fake_slurm: unknown command {name!r}", file=sys.stderr)
        return 2
    return COMMANDS[name](sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())

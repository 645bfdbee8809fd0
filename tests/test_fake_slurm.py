"""The FAKE SLURM of tests/fake_slurm itself (what the cluster-path tests rely on): on two fake nodes
jobs run side by side, each confined to the CPUs it was given, first in, first out."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from kvbench.tinyrun import FAKE_SLURM

# A job step through srun (as the SLURM plugin starts each rule) reports its CPUs.
SCRIPT = """#!/bin/sh
{srun} -n1 python3 -c "import os; print(sorted(os.sched_getaffinity(0)), os.environ['SLURM_CPUS_PER_TASK'])" > {out}
sleep {sleep}
"""


def jobs(state: Path) -> list[dict]:
    return sorted((json.loads(p.read_text()) for p in (state / "jobs").glob("*.json")), key=lambda j: j["id"])


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two fake nodes need two CPUs")
def test_fake_slurm_runs_jobs_side_by_side_each_confined_to_its_node_cpus(tmp_path):
    state, hold = tmp_path / "state", tmp_path / "hold"
    hold.touch()  # queue all three before any starts: placement is then deterministic
    env = dict(os.environ) | {"FAKE_SLURM_DIR": str(state), "FAKE_SLURM_NODES": "2", "FAKE_SLURM_HOLD": str(hold)}
    for i in range(3):
        script = tmp_path / f"job{i}.sh"
        script.write_text(
            SCRIPT.format(srun=FAKE_SLURM / "srun", out=tmp_path / f"job{i}.out", sleep=3 if i < 2 else 0)
        )
        asked = str(len(os.sched_getaffinity(0)))  # more than a node has: it gets its node
        subprocess.run(
            [str(FAKE_SLURM / "sbatch"), "--parsable", "--cpus-per-task", asked, "-D", str(tmp_path), str(script)],
            env=env,
            check=True,
            capture_output=True,
        )
    hold.unlink()
    deadline = time.monotonic() + 60
    while any(j["state"] != "COMPLETED" for j in jobs(state)) and time.monotonic() < deadline:
        time.sleep(0.2)
    first, second, third = jobs(state)
    assert [j["state"] for j in (first, second, third)] == ["COMPLETED"] * 3
    assert (first["node"], second["node"]) == (0, 1) and not set(first["cpu_ids"]) & set(second["cpu_ids"])
    assert second["started"] < first["ended"]  # side by side
    assert third["started"] >= min(first["ended"], second["ended"])  # waited for a free node
    machine = sorted(os.sched_getaffinity(0))
    assert sorted(first["cpu_ids"] + second["cpu_ids"]) == machine  # the nodes split the machine
    for i, job in enumerate((first, second, third)):
        cpus, count = (tmp_path / f"job{i}.out").read_text().rsplit(" ", 1)
        assert cpus == str(sorted(job["cpu_ids"])) and int(count) == len(job["cpu_ids"]) == job["cpus"]


def test_fake_slurm_refuses_more_nodes_than_cpus(tmp_path):
    nodes = str(len(os.sched_getaffinity(0)) + 1)
    env = dict(os.environ) | {"FAKE_SLURM_DIR": str(tmp_path), "FAKE_SLURM_NODES": nodes}
    result = subprocess.run([str(FAKE_SLURM / "sbatch"), "--wrap", "true"], env=env, capture_output=True, text=True)
    assert result.returncode != 0 and "FAKE_SLURM_NODES" in result.stderr
    assert not (tmp_path / "jobs").exists()  # nothing queued


def sbatch(tmp_path: Path, *options: str, script: str = "#!/bin/sh\ntrue\n") -> subprocess.CompletedProcess:
    path = tmp_path / "job.sh"
    path.write_text(script)
    env = dict(os.environ) | {"FAKE_SLURM_DIR": str(tmp_path / "state")}
    return subprocess.run(
        [str(FAKE_SLURM / "sbatch"), "--parsable", "-D", str(tmp_path), *options, str(path)],
        env=env,
        capture_output=True,
        text=True,
    )


def wait_final(state: Path, timeout: float = 60) -> list[dict]:
    deadline = time.monotonic() + timeout
    while (
        any(j["state"] not in ("COMPLETED", "FAILED", "CANCELLED") for j in jobs(state)) and time.monotonic() < deadline
    ):
        time.sleep(0.2)
    return jobs(state)


@pytest.mark.parametrize(
    "options, message",
    [
        (["-A", "your-account", "-p", "gpu"], "Invalid account or account/partition combination specified"),
        (["-A", "kvbench", "-p", "your-gpu-partition"], "Invalid partition name specified"),
        (["-A", "kvbench", "-p", "gpu", "--gpus=A100:1"], "Invalid generic resource (gres) specification"),
        (["-A", "kvbench", "-p", "gpu", "--gpus=a100:5"], "Invalid generic resource (gres) specification"),
        (["-A", "kvbench", "-p", "cpu", "--gpus=1"], "Invalid generic resource (gres) specification"),
        (["-A", "kvbench", "-p", "gpu", "--gres=gpu:v100:1"], "Invalid generic resource (gres) specification"),
        (["-A", "kvbench", "-p", "gpu", "--mem", "373303"], "Requested node configuration is not available"),
        (["-A", "kvbench", "-p", "gpu", "--cpus-per-task=65"], "Requested node configuration is not available"),
        (["-A", "kvbench", "-p", "gpu", "-t", "2-00:00:01"], "Requested time limit is invalid"),
    ],
)
def test_fake_slurm_refuses_what_a_real_site_refuses(tmp_path, options, message):
    result = sbatch(tmp_path, *options)
    assert result.returncode == 1 and f"Batch job submission failed: {message}" in result.stderr
    assert not (tmp_path / "state" / "jobs").exists()  # nothing queued


def test_fake_slurm_accepts_what_the_site_has(tmp_path):
    ok = sbatch(tmp_path, "-A", "kvbench", "-p", "gpu", "--gpus=h100:4", "--mem", "262144", "-t", "2880", "-c", "64")
    assert ok.returncode == 0, ok.stderr
    assert [j["state"] for j in wait_final(tmp_path / "state")] == ["COMPLETED"]


@pytest.mark.parametrize("ntasks_per_gpu", [True, False])
def test_a_job_step_dies_when_the_job_has_ntasks_per_gpu_beside_cpus_per_task(tmp_path, ntasks_per_gpu):
    # Slurm >= 23.11, as the plugin's issue #342 reproduces it:
    # sbatch -p gpu --ntasks-per-gpu 1 --cpus-per-task 1 --gres gpu:1 --wrap "srun -n1 nvidia-smi"
    script = f"#!/bin/sh\n{FAKE_SLURM / 'srun'} -n1 --cpus-per-task=1 echo step-ran\n"
    extra = ["--ntasks-per-gpu=1"] if ntasks_per_gpu else []
    result = sbatch(tmp_path, "-p", "gpu", "--gres=gpu:1", "--cpus-per-task=1", *extra, script=script)
    assert result.returncode == 0, result.stderr
    (job,) = wait_final(tmp_path / "state")
    out = Path(job["output"]).read_text()
    if ntasks_per_gpu:
        assert job["state"] == "FAILED" and "SLURM_TRES_PER_TASK is mutually exclusive with --ntasks-per-gpu" in out
        assert "step-ran" not in out
    else:
        assert job["state"] == "COMPLETED" and "step-ran" in out


def test_sinfo_and_sacctmgr_list_the_site(tmp_path):
    env = dict(os.environ) | {"FAKE_SLURM_DIR": str(tmp_path)}
    listed = subprocess.run(
        [str(FAKE_SLURM / "sinfo"), "-h", "-o", "%P %G %m"], env=env, capture_output=True, text=True
    )
    assert listed.stdout.splitlines() == ["cpu* (null) 64000", "gpu gpu:a100:4 262144", "gpu gpu:h100:4 262144"]
    accounts = subprocess.run(
        [str(FAKE_SLURM / "sacctmgr"), "-n", "-s", "list", "user", "me"], env=env, capture_output=True, text=True
    )
    assert accounts.stdout.split() == ["kvbench"]

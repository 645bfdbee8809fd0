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

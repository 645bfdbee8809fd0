"""The SLURM profile's submissions as the real executor plugin (2.6.1) and its jobstep make them,
against the FAKE SLURM (tests/fake_slurm), which refuses what a real site refuses: the profile's GPU
jobs run, the plugin's default GPU submission (--ntasks-per-gpu beside --cpus-per-task) dies in its
job step as on Slurm >= 23.11, and the workflow refuses an unedited profile, an unknown GPU type
and memory above the partition's nodes before it submits anything."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from kvbench.tinyrun import FAKE_SITE, FAKE_SLURM, REPO, SNAKEMAKE, cancel_fake_slurm_jobs, site_profile, slurm_args

# One GPU rule under the name of a profile's GPU rule, so that the profile's set-resources apply.
SNAKEFILE = """
rule serve_server:
    output: "done.txt"
    threads: 1
    resources: gpu=1
    shell: "echo ran on $SLURMD_NODENAME > {output}"
"""


def run_fake(
    workdir: Path, *args: str, snakefile: Path | None = None, timeout: int = 600
) -> subprocess.CompletedProcess:
    env = dict(os.environ) | {
        "PATH": f"{FAKE_SLURM}{os.pathsep}{os.environ['PATH']}",
        "FAKE_SLURM_DIR": str(workdir / ".fake_slurm"),
    }
    cmd = [SNAKEMAKE, "-s", str(snakefile or REPO / "Snakefile"), "-d", str(workdir), "--retries", "0", *args]
    try:
        return subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout)
    finally:
        if (workdir / ".fake_slurm" / "jobs").is_dir():
            cancel_fake_slurm_jobs(workdir, env)


def fake_jobs(workdir: Path) -> list[dict]:
    folder = workdir / ".fake_slurm" / "jobs"
    return [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))] if folder.is_dir() else []


@pytest.mark.parametrize("plugin_default", [False, True])
def test_the_profiles_gpu_job_runs_and_the_plugins_default_dies_in_its_step(tmp_path, plugin_default):
    snakefile = tmp_path / "Snakefile"
    snakefile.write_text(SNAKEFILE)
    args = list(slurm_args(tmp_path))
    if plugin_default:  # the profile as it was: the plugin then adds --ntasks-per-gpu=1
        profile = site_profile(tmp_path) / "config.yaml"
        profile.write_text(re.sub(r"^\s+tasks_per_gpu: 0\n", "", profile.read_text(), flags=re.M))
    result = run_fake(tmp_path, *args, snakefile=snakefile)
    (job,) = fake_jobs(tmp_path)
    assert (job["partition"], job["account"], job["gpus"]) == ("gpu", "kvbench", "a100:1")
    if plugin_default:
        assert result.returncode != 0 and job["state"] == "FAILED" and job["ntasks_per_gpu"] == "1"
        assert "SLURM_TRES_PER_TASK is mutually exclusive with --ntasks-per-gpu" in Path(job["output"]).read_text()
    else:
        assert result.returncode == 0, result.stderr[-3000:]
        assert job["state"] == "COMPLETED" and job["ntasks_per_gpu"] is None and job["cpus_per_task"] == "16"
        assert (tmp_path / "done.txt").read_text().startswith("ran on fakenode")


def test_the_workflow_refuses_an_unedited_profile_before_submitting(tmp_path):
    args = [
        "--workflow-profile",
        str(REPO / "workflow" / "profiles" / "slurm"),
        "--configfile",
        str(REPO / "config" / "gpu-smoke.yaml"),
    ]
    result = run_fake(tmp_path, *args, "--slurm-init-seconds-before-status-checks", "1")
    assert result.returncode != 0
    text = result.stderr + result.stdout
    assert "the SLURM submission would fail; nothing was submitted" in text, text[-3000:]
    assert "slurm_account 'your-account' is a placeholder of workflow/profiles/slurm/config.yaml" in text
    assert re.search(r"\n  [a-z_, ]*kv_capture[a-z_, ]*: gpu_model 'your-gpu-type' is a placeholder", text)
    assert not fake_jobs(tmp_path)


def test_the_workflow_refuses_a_gpu_type_and_memory_the_site_lacks(tmp_path):
    # config/gpu.yaml's serve job holds the Valkey it starts (~365 GiB) above the fake GPU nodes' 256 GiB;
    # and `A100` is not the site's `a100`.
    folder = site_profile(tmp_path, {**FAKE_SITE, "your-gpu-type": "A100"})
    args = ["--workflow-profile", str(folder), "--configfile", str(REPO / "config" / "gpu.yaml")]
    result = run_fake(tmp_path, *args, "--slurm-init-seconds-before-status-checks", "1")
    text = result.stderr + result.stdout
    assert result.returncode != 0 and "nothing was submitted" in text, text[-3000:]
    assert "gpu_model 'A100' is not a GPU type of partition gpu (its GRES types: a100, h100" in text
    mem = yaml.safe_load((REPO / "config" / "gpu.yaml").read_text())
    from kvbench.resources import rule_resources

    need = rule_resources(mem)["serve_server"]["mem_mb"]
    assert f"\n  serve_server: mem_mb {need} exceeds the 262144 MB of partition gpu's nodes" in text
    assert "serve.valkey.url" in text and not fake_jobs(tmp_path)

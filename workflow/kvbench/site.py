"""The SLURM site a run submits to, checked before the first job: what a real slurmctld would
refuse (or queue forever) is refused on the submit host at once, with what to change.

- a `your-...` placeholder of workflow/profiles/slurm/config.yaml left unedited;
- a partition `sinfo` does not list, a `gpu_model` that is not a GRES type of its partition
  (SLURM matches the type exactly: `a100` is not `A100` nor `a100_80gb`);
- more memory (`mem_mb`, from the formula for the run's config) than the partition's nodes have.

Torch- and Snakemake-free: common.smk's onstart hands it the planned jobs' resources.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

PLACEHOLDER = "your-"
CHECKED = ("slurm_account", "slurm_partition", "gpu_model")
PROFILE = "workflow/profiles/slurm/config.yaml"
FIX = {
    "slurm_account": "your account (`sacctmgr -n -s list user $USER format=account` lists them)",
    "slurm_partition": 'a partition (`sinfo -o "%P %G %m"` lists them with GPU types and memory)',
    "gpu_model": 'the GRES type of the partition\'s GPUs, spelled as `sinfo -o "%P %G"` prints it',
}


class SiteError(RuntimeError):
    pass


@dataclass
class Partition:
    name: str
    gpu_types: set[str] = field(default_factory=set)
    node_mem_mb: int = 0  # the largest node's


def parse_sinfo(text: str) -> dict[str, Partition]:
    """`sinfo -h -o "%P %G %m"`: one line per partition and node configuration (`gpu:a100:4(S:0-1)`,
    `(null)`; memory in MB, maybe with a trailing `+`)."""
    found: dict[str, Partition] = {}
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        name, gres, mem = fields[0].rstrip("*"), fields[1], fields[2].rstrip("+")
        part = found.setdefault(name, Partition(name))
        for item in gres.split(","):
            parts = item.split("(")[0].split(":")
            if parts[0] == "gpu" and len(parts) >= 3:
                part.gpu_types.add(parts[1])
        if mem.isdigit():
            part.node_mem_mb = max(part.node_mem_mb, int(mem))
    return found


def sinfo_partitions() -> dict[str, Partition] | None:
    """This site's partitions, or None where `sinfo` is not on PATH or fails (nothing to check against)."""
    if shutil.which("sinfo") is None:
        return None
    try:
        out = subprocess.run(
            ["sinfo", "-h", "-o", "%P %G %m"], capture_output=True, text=True, timeout=60, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_sinfo(out)


def site_problems(
    jobs: Iterable[tuple[str, Mapping[str, Any]]], partitions: Mapping[str, Partition] | None
) -> list[str]:
    """One line per problem (resource, what to do, the rules it concerns), for the (rule, resources)
    of the jobs about to be submitted."""
    found: dict[str, set[str]] = {}

    def problem(text: str, rule: str) -> None:
        found.setdefault(text, set()).add(rule)

    for rule, res in jobs:
        for key in CHECKED:
            value = res.get(key)
            if isinstance(value, str) and value.startswith(PLACEHOLDER):
                problem(f"{key} {value!r} is a placeholder of {PROFILE}: set {FIX[key]}", rule)
        name = res.get("slurm_partition")
        if partitions is None or not isinstance(name, str) or name.startswith(PLACEHOLDER):
            continue
        if name not in partitions:
            problem(
                f"slurm_partition {name!r} is not a partition of this cluster (sinfo lists {', '.join(sorted(partitions)) or 'none'})",
                rule,
            )
            continue
        part = partitions[name]
        model = res.get("gpu_model")
        if int(res.get("gpu") or 0) and isinstance(model, str) and not model.startswith(PLACEHOLDER):
            if model not in part.gpu_types:
                types = ", ".join(sorted(part.gpu_types)) or "none"
                problem(
                    f"gpu_model {model!r} is not a GPU type of partition {name} (its GRES types: {types}; SLURM matches the type exactly)",
                    rule,
                )
        mem = int(res.get("mem_mb") or 0)
        if part.node_mem_mb and mem > part.node_mem_mb:
            hint = (
                ": most of it is the Valkey the job starts; point serve.valkey.url at a store of your own, "
                "or run fewer serve.docs_per_corpus or serve.codecs"
                if rule == "serve_server"
                else ""
            )
            problem(f"mem_mb {mem} exceeds the {part.node_mem_mb} MB of partition {name}'s nodes, which SLURM refuses "
                    f"(\"Requested node configuration is not available\"){hint}", rule)  # fmt: skip
    return [f"{', '.join(sorted(rules))}: {text}" for text, rules in found.items()]


def require_site(jobs: Iterable[tuple[str, Mapping[str, Any]]], partitions: Mapping[str, Partition] | None) -> None:
    if problems := site_problems(jobs, partitions):
        raise SiteError(
            "the SLURM submission would fail; nothing was submitted:\n  "
            + "\n  ".join(problems)
            + f"\nEdit {PROFILE} (or your copy of it), then submit again."
        )

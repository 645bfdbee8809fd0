"""Offline-first hub access: what a config reads from the hub, the prefetch that downloads it on a
node with internet, and the check that it is there before any job runs.

Compute nodes of most clusters have no internet. `make prefetch CONFIG=...` (a login node) puts
every `hub:` model (only HUB_FILES) and the dataset of every `quality.lm_eval_tasks` task into
`hub_cache`, a folder on the shared filesystem, and lists what it fetched in a manifest there
(MANIFEST: paths relative to the cache, sizes). Jobs run with HF_HOME pointing at that folder and
offline; `missing` compares the manifest with the config and the disk (the workflow's onstart
and every job call it), so a run that lacks a file stops before any job starts, naming the
command to run. `model_prepare` links a prefetched snapshot into resources/models/ and never
downloads.

Torch-free: the scripts call this before their heavy imports.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import yaml

from kvbench.atomic import atomic_path

MANIFEST = "kvbench-prefetch.json"
# What transformers and vLLM load from a hub repo: top-level config, sharded safetensors and
# tokenizer files. Not `original/*.pth` (Llama-3.1's second copy of the weights) nor
# `consolidated.safetensors` (Mistral's), which would double the download.
HUB_FILES = (
    "config.json",
    "generation_config.json",
    "model*.safetensors",
    "model.safetensors.index.json",
    "tokenizer*",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
)
DEFAULT_CACHE = Path("~/.cache/huggingface")


class PrefetchError(RuntimeError):
    """Something the config reads from the hub could not be fetched, or is not in the cache."""


@dataclass(frozen=True)
class Need:
    """One thing a config reads from the hub: a model repo, or one dataset config of a repo."""

    kind: str  # "model" | "dataset"
    repo: str
    name: str | None  # dataset config name (LongBench subset)
    keys: tuple[str, ...]  # config keys that ask for it

    @property
    def id(self) -> str:
        return self.repo if self.name is None else f"{self.repo}/{self.name}"


def cache_root(config: Mapping[str, Any]) -> Path:
    """`hub_cache` (relative to the working directory), else the environment's HF_HOME."""
    folder = config.get("hub_cache") or os.environ.get("HF_HOME") or DEFAULT_CACHE
    return Path(folder).expanduser().resolve()


def hub_env(config: Mapping[str, Any], offline: bool | None = None) -> dict[str, str]:
    """Environment of a job (or of the prefetch, `offline=False`): the hub cache and offline mode.
    HF_HUB_CACHE and HF_DATASETS_CACHE are set too, so a user's own settings cannot split them."""
    env = {}
    if config.get("hub_cache"):
        root = cache_root(config)
        env |= {"HF_HOME": str(root), "HF_HUB_CACHE": str(root / "hub"), "HF_DATASETS_CACHE": str(root / "datasets")}
    if config.get("hf_offline", True) if offline is None else offline:
        env |= {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    return env


class _IgnoreTags(yaml.SafeLoader):
    """lm-eval's task files use `!function`; only their plain keys are read here."""


_IgnoreTags.add_multi_constructor("!", lambda loader, suffix, node: None)


def lm_eval_task(task: str) -> dict[str, Any]:
    """One of lm-eval's LongBench task files, read without importing lm-eval (slow)."""
    spec = importlib.util.find_spec("lm_eval")
    if spec is None or spec.origin is None:
        raise PrefetchError("lm-eval is not installed: it is needed to know the datasets of quality.lm_eval_tasks")
    folder = Path(spec.origin).parent / "tasks" / "longbench"
    guess = folder / f"{task.removeprefix('longbench_')}.yaml"
    for path in [guess, *sorted(p for p in folder.glob("*.yaml") if p != guess)]:
        if path.is_file():
            entry = yaml.load(path.read_text(), Loader=_IgnoreTags) or {}
            if entry.get("task") == task:
                return entry
    raise PrefetchError(f"quality.lm_eval_tasks: lm-eval has no task {task!r} in {folder}")


def lm_eval_dataset(task: str) -> tuple[str, str | None]:
    """(dataset_path, dataset_name) of one of lm-eval's LongBench tasks."""
    entry = lm_eval_task(task)
    return str(entry["dataset_path"]), entry.get("dataset_name")


def needs(config: Mapping[str, Any]) -> list[Need]:
    """Every hub model and lm-eval dataset the config reads, each with the keys that ask for it."""
    found = [
        Need("model", source["hub"], None, (f"models.{name}",))
        for name, source in config.get("models", {}).items()
        if "hub" in source
    ]
    datasets: dict[tuple[str, str | None], list[str]] = {}
    for task in config.get("quality", {}).get("lm_eval_tasks") or []:
        datasets.setdefault(lm_eval_dataset(task), []).append(f"quality.lm_eval_tasks: {task}")
    return found + [Need("dataset", path, name, tuple(keys)) for (path, name), keys in datasets.items()]


def read_manifest(root: Path) -> dict[str, dict[str, Any]]:
    path = root / MANIFEST
    manifest = json.loads(path.read_text()) if path.is_file() else {}
    return {"models": manifest.get("models", {}), "datasets": manifest.get("datasets", {})}


def _absent(root: Path, entry: Mapping[str, Any]) -> list[str]:
    """Files of a manifest entry that are gone or have another size than when fetched."""
    gone = []
    for rel, size in entry["files"].items():
        path = root / rel
        if not path.is_file() or path.stat().st_size != size:
            gone.append(rel)
    return gone


def missing(config: Mapping[str, Any]) -> list[str]:
    """One line per hub model or dataset the config reads that is not complete in the cache."""
    needed = needs(config)
    if not needed:
        return []
    root = cache_root(config)
    manifest = read_manifest(root)
    lines = []
    for need in needed:
        entry = manifest[f"{need.kind}s"].get(need.id)
        where = ", ".join(need.keys)
        if entry is None:
            lines.append(f"{where}: {need.kind} {need.id} was never prefetched into {root}")
        elif gone := _absent(root, entry):
            lines.append(
                f"{where}: {need.kind} {need.id}: {len(gone)} file(s) missing or changed in {root} (e.g. {gone[0]})"
            )
    return lines


CONFIGFILES_ENV = "KVBENCH_CONFIGFILES"


def note_configfiles(files: list[str]) -> list[str]:
    """Called while the workflow parses: its jobs (children) name these files in the prefetch command."""
    os.environ[CONFIGFILES_ENV] = os.pathsep.join(files)
    return files


def noted_configfiles() -> list[str]:
    return [f for f in os.environ.get(CONFIGFILES_ENV, "").split(os.pathsep) if f]


def prefetch_command(configfiles: list[str] | tuple[str, ...] = ()) -> str:
    return f"make prefetch CONFIG={configfiles[-1] if configfiles else '<your config file>'}"


def missing_message(config: Mapping[str, Any], lines: list[str], configfiles: list[str] | tuple[str, ...] = ()) -> str:
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    return (
        f"not prefetched (hub cache {cache_root(config)}, as node {node} sees it):\n  "
        + "\n  ".join(lines)
        + f"\nJobs never download. On a node with internet (a login node) run:\n  {prefetch_command(configfiles)}\n"
        "then submit again. The cache (config key hub_cache) must be on a filesystem every compute node mounts."
    )


def require_prefetched(config: Mapping[str, Any], configfiles: list[str] | tuple[str, ...] = ()) -> None:
    if lines := missing(config):
        raise PrefetchError(missing_message(config, lines, configfiles))


def link_prefetched(config: Mapping[str, Any], repo: str, out_dir: Path) -> None:
    """resources/models/<name>: symlinks to a prefetched snapshot's files (no copy of the weights,
    no download)."""
    root = cache_root(config)
    entry = read_manifest(root)["models"].get(repo)
    if entry is None or _absent(root, entry):
        raise PrefetchError(missing_message(config, [f"model {repo} is not (completely) in the cache"]))
    with atomic_path(out_dir, is_dir=True) as tmp:
        snapshot = root / entry["snapshot"]
        for rel in entry["files"]:
            link = tmp / Path(rel).relative_to(entry["snapshot"])
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to((root / rel).resolve())
        if not (tmp / "config.json").exists():
            raise PrefetchError(f"model {repo}: the prefetched snapshot {snapshot} has no config.json")


def _licence_hint(repo: str) -> str:
    from huggingface_hub import HfApi

    try:
        info = HfApi().model_info(repo)
        licence = (info.card_data or {}).get("license") if info.card_data is not None else None
    except Exception:  # the hint is best effort; the error it explains is reported either way
        licence = None
    return f"its licence ({licence})" if licence else "its licence (see the model card)"


def _fetch_model(need: Need, root: Path, log: Callable[[str], None]) -> dict[str, Any]:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    page = f"{constants.ENDPOINT}/{need.repo}"
    try:
        snapshot = Path(snapshot_download(need.repo, allow_patterns=list(HUB_FILES), cache_dir=root / "hub"))
    except GatedRepoError as err:
        token = (
            "HF_TOKEN is set, but its account has no access yet (some licences are approved by hand)"
            if os.environ.get("HF_TOKEN")
            else "HF_TOKEN is not set"
        )
        raise PrefetchError(
            f"{', '.join(need.keys)}: {need.repo} is gated ({token}). Log in to the hub, accept "
            f"{_licence_hint(need.repo)} at {page}, create a read token at {constants.ENDPOINT}/settings/tokens, "
            f"then `export HF_TOKEN=<token>` and run the prefetch again. ({type(err).__name__})"
        ) from err
    except RepositoryNotFoundError as err:
        raise PrefetchError(
            f"{', '.join(need.keys)}: {need.repo} does not exist at {constants.ENDPOINT} (or is "
            "private: set HF_TOKEN to a token that can read it)"
        ) from err
    files = {str(p.relative_to(root)): p.stat().st_size for p in sorted(snapshot.rglob("*")) if p.is_file()}
    log(f"[prefetch] model {need.repo}: {len(files)} files, {sum(files.values()) / 2**30:.2f} GiB -> {snapshot}")
    return {"snapshot": str(snapshot.relative_to(root)), "files": files}


def _fetch_dataset(need: Need, root: Path, log: Callable[[str], None]) -> dict[str, Any]:
    import datasets

    # The call lm-eval makes (ConfigurableTask.download), so the jobs' offline call finds this cache.
    loaded = datasets.load_dataset(need.repo, need.name, cache_dir=str(root / "datasets"))
    files = {}
    for split in loaded.values():
        for cache_file in split.cache_files:
            path = Path(cache_file["filename"])
            files[str(path.relative_to(root))] = path.stat().st_size
    rows = {name: len(split) for name, split in loaded.items()}
    log(f"[prefetch] dataset {need.id}: {rows}")
    return {"splits": rows, "files": files}


def prefetch(config: Mapping[str, Any], log: Callable[[str], None] = print) -> dict[str, Any]:
    """Download what `needs(config)` lists into the cache and record it in the manifest (merged
    with earlier prefetches). Every item is tried; the failures are raised together at the end."""
    root = cache_root(config)
    root.mkdir(parents=True, exist_ok=True)
    failures = []
    for need in needs(config):
        try:
            entry = (_fetch_model if need.kind == "model" else _fetch_dataset)(need, root, log)
        except PrefetchError as err:
            failures.append(str(err))
            continue
        except Exception as err:  # no network, hub down, a dataset that moved: said per item, the rest tried
            failures.append(f"{', '.join(need.keys)}: {need.kind} {need.id}: {type(err).__name__}: {err}")
            continue
        manifest = read_manifest(root)  # reread: another prefetch may have written meanwhile
        manifest[f"{need.kind}s"][need.id] = entry
        with atomic_path(root / MANIFEST) as tmp:
            tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True))
    if failures:
        raise PrefetchError("prefetch incomplete:\n  " + "\n  ".join(failures))
    return read_manifest(root)

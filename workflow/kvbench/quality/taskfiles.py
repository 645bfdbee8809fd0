"""Build every configured task and write it as a local lm-eval task: `<task>.jsonl` (LongBench
records), `<task>.yaml` (`dataset_path: json`, `dataset_kwargs.data_files` as a mapping,
`process_results` calling kvbench's metric functions), a two-line `kvbench_metrics.py` through
which lm-eval finds those functions, and `tasks.json` (what was built, for the runner)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Mapping

import pandas as pd
import yaml

from kvbench.atomic import atomic_path
from kvbench.quality.tasks.base import TASKS, Sources, TaskFile

METRICS_SHIM = (
    "# Written by kvbench: lm-eval loads process_results functions from a module next to the task YAML.\n"
    "from kvbench.quality.metrics import *  # noqa: F401,F403\n"
)
MANIFEST = "tasks.json"


class _Function(str):
    """A `!function module.name` tag in the written YAML."""


class _Dumper(yaml.SafeDumper):
    pass


_Dumper.add_representer(_Function, lambda dumper, value: dumper.represent_scalar("!function", str(value)))
_Dumper.add_representer(
    str,
    lambda dumper, value: dumper.represent_scalar("tag:yaml.org,2002:str", value, style='"' if "\n" in value else None),
)


def metric_key(metric: str) -> str:
    """The metric-specific name lm-eval's LongBench functions return next to `score`."""
    return metric.removesuffix("_first_line") + "_score"


def task_yaml(task: TaskFile, data_file: str) -> str:
    spec = task.spec
    config = {
        "task": task.name,
        "tag": ["kvbench"],
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": data_file}},
        "test_split": "test",
        "output_type": "generate_until",
        "doc_to_text": spec.template,
        "doc_to_target": "{{answers}}",
        "process_results": _Function(f"kvbench_metrics.{spec.metric}"),
        "generation_kwargs": {
            "max_gen_toks": spec.max_gen_tokens,
            "until": list(spec.until),
            "do_sample": False,
            "temperature": 1,
        },
        "metric_list": [
            {"metric": name, "aggregation": "mean", "higher_is_better": True}
            for name in ("score", metric_key(spec.metric))
        ],
        "metadata": {
            "version": 1.0,
            "category": spec.category,
            "metric": spec.metric,
            "chat": spec.chat,
            "longbench": spec.longbench,
        },
    }
    return yaml.dump(config, Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=1000)


def build_tasks(tasks_cfg: Mapping[str, Any], sources: Sources, seed: int) -> list[TaskFile]:
    from kvbench.quality.tasks import catalog  # noqa: F401  (registers every builder)

    files = []
    for name, settings in tasks_cfg.items():
        for task in TASKS[name](sources, dict(settings), seed):
            built = len(task.samples)
            print(f"[quality] {task.name}: {built}/{task.requested} samples", file=sys.stderr, flush=True)
            if built < task.requested:
                print(
                    f"[quality] {task.name}: only {built} samples passed the presence, uniqueness and fit checks",
                    file=sys.stderr,
                    flush=True,
                )
            files.append(task)
    return files


def write_tasks(files: list[TaskFile], out_dir: str | Path) -> None:
    """Write the task folder atomically; data files are named by `out_dir` as given (relative paths
    stay relative to the directory lm-eval runs in, so the folder is byte-identical anywhere)."""
    manifest = []
    with atomic_path(out_dir, is_dir=True) as tmp:
        for task in files:
            if task.samples:  # lm-eval cannot load an empty dataset; the manifest still lists the task
                data_file = f"{Path(out_dir).as_posix()}/{task.name}.jsonl"
                lines = [json.dumps(s, sort_keys=True, ensure_ascii=False) for s in task.samples]
                (tmp / f"{task.name}.jsonl").write_text("".join(line + "\n" for line in lines), encoding="utf-8")
                (tmp / f"{task.name}.yaml").write_text(task_yaml(task, data_file), encoding="utf-8")
            manifest.append(
                {
                    "task": task.name,
                    "samples": len(task.samples),
                    "requested": task.requested,
                    **{k: v for k, v in task.spec.__dict__.items() if k != "template"},
                }
            )
        (tmp / "kvbench_metrics.py").write_text(METRICS_SHIM)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")


def read_manifest(folder: str | Path) -> list[dict[str, Any]]:
    path = Path(folder) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{folder}: no {MANIFEST}; build the tasks first (rule quality_tasks)")
    return list(json.loads(path.read_text()))


def read_samples(folder: str | Path) -> list[dict[str, Any]]:
    """Every built sample: its task's manifest entry with the sample's `_id` and `context`."""
    return [
        {**task, "sample_id": record["_id"], "context": record["context"]}
        for task in read_manifest(folder)
        if task["samples"]
        for record in map(json.loads, (Path(folder) / f"{task['task']}.jsonl").read_text().splitlines())
    ]


def text_tokenizer(model_dir: str | Path) -> Any:
    """The model's fast tokenizer alone (tokenizer.json), without importing torch or transformers."""
    from tokenizers import Tokenizer

    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{model_dir}: no tokenizer.json (the quality tasks count tokens with a fast tokenizer)"
        )
    return Tokenizer.from_file(str(path))


def load_sources(docs: pd.DataFrame, facts: pd.DataFrame, imported: pd.DataFrame | None, tokenizer: Any) -> Sources:
    """Builders see only facts whose location is unambiguous (kvbench.corpus.realistic.locate_facts).
    `tokenizer`: a `tokenizers.Tokenizer`, or a transformers fast tokenizer (its backend is used)."""
    tokenizer = getattr(tokenizer, "backend_tokenizer", tokenizer)
    if "unambiguous" not in facts:
        raise ValueError("facts.parquet has no 'unambiguous' column: rebuild the realistic corpus with this kvbench")
    usable = facts[facts["unambiguous"].astype(bool)]
    return Sources(docs=docs, facts=usable.reset_index(drop=True), imported=imported, tokenizer=tokenizer)

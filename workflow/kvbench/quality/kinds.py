"""Task builders and the settings a `quality.tasks` entry of each may carry.

Torch- and pandas-free on purpose: the workflow checks `quality.tasks` while it parses. Each
builder registers itself under the same name (kvbench.quality.tasks.base.register).
"""

from __future__ import annotations

from typing import Any

COMMON_SETTINGS = ("samples", "context_tokens", "max_gen_tokens")
TASK_SETTINGS: dict[str, tuple[str, ...]] = {
    "single_doc_qa": (),
    "multi_doc_qa": ("documents",),
    "few_shot": ("excerpt_tokens",),
    "summarization": (),
    "retrieval": ("paragraph_tokens",),
    "longbench": ("datasets",),
}


# LongBench's English datasets by category (lm-eval's `longbench_<dataset>` tasks).
LONGBENCH_CATEGORY = {
    "narrativeqa": "single_doc_qa",
    "qasper": "single_doc_qa",
    "multifieldqa_en": "single_doc_qa",
    "hotpotqa": "multi_doc_qa",
    "2wikimqa": "multi_doc_qa",
    "musique": "multi_doc_qa",
    "gov_report": "summarization",
    "qmsum": "summarization",
    "multi_news": "summarization",
    "trec": "few_shot",
    "triviaqa": "few_shot",
    "samsum": "few_shot",
    "passage_count": "retrieval",
    "passage_retrieval_en": "retrieval",
    "lcc": "code",
    "repobench-p": "code",
}


def dataset_of(task: str) -> str:
    """`longbench_hotpotqa_e` -> `hotpotqa`."""
    name = task.removeprefix("longbench_")
    return name[:-2] if name.endswith("_e") and name[:-2] in LONGBENCH_CATEGORY else name


def quality_problems(config: dict[str, Any]) -> list[str]:
    """Cross-references of the `quality` section, one line per problem naming its key."""
    quality, found = config["quality"], []
    found += [
        f"quality.models: {name!r} is not a key of models ({sorted(config['models'])})"
        for name in quality["models"]
        if name not in config["models"]
    ]
    for key in ("methods", "reference"):
        names = quality.get(key, [])
        found += [
            f"quality.{key}: {name!r} is not a key of methods ({sorted(config['methods'])})"
            for name in ([names] if isinstance(names, str) else names)
            if name not in config["methods"]
        ]
    for name, entry in quality.get("tasks", {}).items():
        try:
            check_task(name, entry)
        except ValueError as err:
            found.append(f"quality.tasks.{name}: {err}")
    if "longbench" in quality.get("tasks", {}) and not config["corpus"]["imported"]["path"]:
        found.append("quality.tasks.longbench: needs corpus.imported.path (a folder with LongBench JSONL)")
    found += [
        f"quality.lm_eval_tasks: {task!r} is not one of lm-eval's English LongBench tasks "
        f"(longbench_<dataset>[_e], datasets: {', '.join(sorted(LONGBENCH_CATEGORY))})"
        for task in quality.get("lm_eval_tasks", [])
        if not task.startswith("longbench_") or dataset_of(task) not in LONGBENCH_CATEGORY
    ]
    return found


def check_task(name: str, entry: dict[str, Any]) -> None:
    if name not in TASK_SETTINGS:
        raise ValueError(f"unknown task {name!r}; known: {', '.join(sorted(TASK_SETTINGS))}")
    unknown = set(entry) - set(COMMON_SETTINGS) - set(TASK_SETTINGS[name])
    if unknown:
        allowed = sorted(COMMON_SETTINGS + TASK_SETTINGS[name])
        raise ValueError(f"unknown setting(s) {sorted(unknown)} for task {name!r} (allowed: {', '.join(allowed)})")

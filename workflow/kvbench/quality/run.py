"""The quality tasks with several methods and protocols: lm-eval's `simple_evaluate` with the kvbench
model (every method and protocol from one shared prefill per sample), then one row per sample ×
method × protocol joining the task's own score (lm-eval's `process_results`, applied to each
method's answer) with what the engine measured."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any, Mapping

import pandas as pd

from kvbench.fidelity import Reference
from kvbench.quality.adapter import KvbenchLM, prompt_key
from kvbench.quality.engine import QUERY_AWARE
from kvbench.quality.kinds import dataset_of
from kvbench.quality.longbench import spec as longbench_spec
from kvbench.quality.taskfiles import metric_key, read_manifest


def max_prompt_tokens(cfg: Mapping[str, Any], model: Any) -> int:
    """LongBench's model2maxlen: the prompt budget before middle truncation (a 500-token margin for
    the chat template and the answer by default, as LongBench's 8K models have 7,500)."""
    return int(cfg.get("max_prompt_tokens") or int(model.config.max_position_embeddings) - 500)


def task_table(tasks_dir: str | Path, lm_eval_tasks: list[str]) -> dict[str, dict[str, Any]]:
    """Every task this run evaluates: name -> category, metric, chat, LongBench dataset, stop
    strings, LongBench's maximum generation length."""
    keys = ("category", "metric", "chat", "longbench", "until", "max_gen_tokens")
    table = {t["task"]: {k: t[k] for k in keys} for t in read_manifest(tasks_dir) if t["samples"]}
    for name in lm_eval_tasks:  # lm-eval's official LongBench tasks (they read the hub)
        spec = longbench_spec(dataset_of(name))
        table[name] = {k: getattr(spec, k) for k in keys}
    return table


def sample_ids(task: str, size: int, limit: int | None, seed: int) -> list[int]:
    """`limit` of a task's `size` documents, drawn at random under the run seed and the task's name
    (so every method and model gets the same ones; not lm-eval's first `limit`), in order; all of
    them when `limit` is None or not smaller."""
    if not limit or limit >= size:
        return list(range(size))
    return sorted(random.Random(f"{seed}:{task}").sample(range(size), limit))


def open_tasks(tasks_dir: str | Path, cfg: Mapping[str, Any], seed: int) -> tuple[dict[str, dict[str, Any]], Any, dict]:
    """What a run evaluates: its task table (`task_table`), lm-eval's TaskManager over the task
    folder (and lm-eval's own tasks where configured), and the samples of lm-eval's own tasks
    (`sample_ids` of each, from its size; lm-eval loads each dataset from its cache) by name,
    empty for all (kvbench's tasks are sized when built)."""
    from lm_eval.tasks import TaskManager, get_task_dict

    official = list(cfg.get("lm_eval_tasks") or [])
    manager = TaskManager(include_path=str(tasks_dir), include_defaults=bool(official))
    limit, drawn = cfg.get("lm_eval_limit"), {}
    if limit and official:
        sizes = {name: len(task.eval_docs) for name, task in get_task_dict(official, manager).items()}
        drawn = {name: sample_ids(name, sizes[name], limit, seed) for name in official}
    return task_table(tasks_dir, official), manager, drawn


def seeds(seed: int) -> dict[str, int]:
    """simple_evaluate's seed arguments, all `seed`."""
    return {f"{kind}_seed": seed for kind in ("random", "numpy_random", "torch_random", "fewshot_random")}


def evaluate(
    model: Any,
    tokenizer: Any,
    methods: Mapping[str, dict[str, Any]],
    tasks_dir: str | Path,
    cfg: Mapping[str, Any],
    seed: int,
    *,
    protocols: tuple[str, ...] = (QUERY_AWARE,),
    reference: str | None = None,
    references: dict[str, Reference] | None = None,
) -> tuple[pd.DataFrame, KvbenchLM]:
    """Rows for every sample of every task, method and protocol (an error where it failed), and the
    model object (its `new_references` hold the reference method's continuations, if it ran)."""
    from lm_eval import simple_evaluate

    tasks, manager, drawn_ids = open_tasks(tasks_dir, cfg, seed)
    if not tasks:
        raise ValueError(f"{tasks_dir}: no task has samples (see logs/quality/<model>/tasks.log) and no lm_eval_tasks")
    lm = KvbenchLM(
        model,
        tokenizer,
        methods,
        seed=seed,
        max_gen_cap=int(cfg["max_gen_cap"]),
        max_prompt_tokens=max_prompt_tokens(cfg, model),
        plain_tasks=frozenset(name for name, t in tasks.items() if not t["chat"]),
        protocols=protocols,
        reference=reference,
        references=references,
        top_k=cfg.get("reference_top_k"),
        fidelity_positions=cfg.get("fidelity_positions"),
        prompts_per_batch=int(cfg.get("prompts_per_batch") or 8),
        max_rows=int(cfg.get("max_rows") or 64),
    )
    start = time.monotonic()
    results = simple_evaluate(
        model=lm,
        tasks=list(tasks),
        task_manager=manager,
        log_samples=True,
        bootstrap_iters=0,
        samples=drawn_ids or None,
        **seeds(seed),
    )
    print(f"[quality] lm-eval finished in {time.monotonic() - start:.0f} s")
    task_objects = manager.load(list(results["samples"]))["tasks"]
    rows = []
    for task, task_samples in results["samples"].items():
        info = tasks[task]
        for sample in task_samples:
            doc = sample["doc"]
            # lm-eval logs a drawn sample under its index in the dataset, but numbers the requests the
            # model sees (and so the adapter's keys, where a record has no `_id`) among the drawn ones.
            drawn = drawn_ids.get(task)
            key = prompt_key(task, doc, drawn.index(sample["doc_id"]) if drawn else sample["doc_id"])
            for method, spec in methods.items():
                for protocol in protocols:
                    rows.append(_row(lm, task_objects[task], task, info, doc, sample, key, method, spec, protocol))
    return pd.DataFrame(rows), lm


def _row(
    lm: KvbenchLM,
    task_object: Any,
    task: str,
    info: Mapping[str, Any],
    doc: Mapping[str, Any],
    sample: Mapping[str, Any],
    key: str,
    method: str,
    spec: Mapping[str, Any],
    protocol: str,
) -> dict[str, Any]:
    record = lm.record(method, protocol, key)
    failed = record["error"] is not None and record["error"] != "empty output"
    answer = lm.answer(method, protocol, key)
    metrics = None if failed else task_object.process_results(doc, [answer])
    return {
        "method": method,
        "kind": spec["kind"],
        "params": str(sorted(spec.items())),
        "protocol": protocol,
        "task": task,
        "longbench": info["longbench"],
        "category": info["category"],
        "metric": info["metric"],
        "sample_id": str(doc.get("_id", sample["doc_id"])),
        "lm_eval_doc_id": int(sample["doc_id"]),
        "doc_ids": json.dumps(doc.get("doc_ids")),
        "target_tokens": doc.get("target_tokens"),
        "prediction": answer,
        "references": json.dumps(doc["answers"]),
        "score": None if failed else float(metrics["score"]),
        "metric_score": None if failed else float(metrics[metric_key(info["metric"])]),
        **record,
    }

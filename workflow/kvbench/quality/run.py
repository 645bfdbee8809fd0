"""One method over every task: lm-eval's `simple_evaluate` with the kvbench model, then one row
per sample joining lm-eval's score with what the adapter measured."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any, Mapping

import pandas as pd

from kvbench.quality.adapter import KvbenchLM, reference_key
from kvbench.quality.fidelity import Reference
from kvbench.quality.kinds import dataset_of
from kvbench.quality.longbench import spec as longbench_spec
from kvbench.quality.taskfiles import metric_key, read_manifest


def max_prompt_tokens(cfg: Mapping[str, Any], model: Any) -> int:
    """LongBench's model2maxlen: the prompt budget before middle truncation (a 500-token margin for
    the chat template and the answer by default, as LongBench's 8K models have 7,500)."""
    return int(cfg.get("max_prompt_tokens") or int(model.config.max_position_embeddings) - 500)


def task_table(tasks_dir: str | Path, lm_eval_tasks: list[str]) -> dict[str, dict[str, Any]]:
    """Every task this run evaluates: name -> category, metric, chat, LongBench dataset."""
    table = {t["task"]: {k: t[k] for k in ("category", "metric", "chat", "longbench")}
             for t in read_manifest(tasks_dir) if t["samples"]}
    for name in lm_eval_tasks:  # lm-eval's official LongBench tasks (they read the hub)
        spec = longbench_spec(dataset_of(name))
        table[name] = {"category": spec.category, "metric": spec.metric, "chat": spec.chat, "longbench": spec.longbench}
    return table


def sample_ids(task: str, size: int, limit: int | None, seed: int) -> list[int]:
    """`limit` of a task's `size` documents, drawn at random under the run seed and the task's name
    (so every method and model gets the same ones; not lm-eval's first `limit`), in order; all of
    them when `limit` is None or not smaller."""
    if not limit or limit >= size:
        return list(range(size))
    return sorted(random.Random(f"{seed}:{task}").sample(range(size), limit))


def evaluate_method(
    model: Any, tokenizer: Any, method: str, spec: dict[str, Any], tasks_dir: str | Path, cfg: Mapping[str, Any],
    seed: int, references: dict[str, Reference] | None = None, keep_references: bool = False,
) -> tuple[pd.DataFrame, KvbenchLM]:
    """Rows for every sample of every task (an error where the sample failed), and the model object
    (its `new_references` hold the full cache's references when `keep_references`)."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager, get_task_dict

    official = list(cfg.get("lm_eval_tasks") or [])
    tasks = task_table(tasks_dir, official)
    if not tasks:
        raise ValueError(f"{tasks_dir}: no task has samples (see logs/quality/<model>/tasks.log) and no lm_eval_tasks")
    lm = KvbenchLM(model, tokenizer, method, spec, seed=seed, max_gen_cap=int(cfg["max_gen_cap"]),
                   max_prompt_tokens=max_prompt_tokens(cfg, model),
                   plain_tasks=frozenset(name for name, t in tasks.items() if not t["chat"]),
                   references=references, keep_references=keep_references, top_k=cfg.get("reference_top_k"))
    manager = TaskManager(include_path=str(tasks_dir), include_defaults=bool(official))
    start = time.monotonic()
    limit = cfg.get("lm_eval_limit")  # lm-eval's own tasks only: kvbench's are sized when built
    drawn_ids = None
    if limit and official:  # their sizes, to draw from (lm-eval loads each dataset from its cache)
        sizes = {name: len(task.eval_docs) for name, task in get_task_dict(official, manager).items()}
        drawn_ids = {name: sample_ids(name, sizes[name], limit, seed) for name in official}
    results = simple_evaluate(model=lm, tasks=list(tasks), task_manager=manager, log_samples=True,
                              bootstrap_iters=0, samples=drawn_ids, random_seed=seed, numpy_random_seed=seed,
                              torch_random_seed=seed, fewshot_random_seed=seed)
    print(f"[quality] {method}: lm-eval finished in {time.monotonic() - start:.0f} s")
    rows = []
    for task, samples in results["samples"].items():
        info = tasks[task]
        for sample in samples:
            doc = sample["doc"]
            # lm-eval logs a drawn sample under its index in the dataset, but numbers the requests the
            # model sees (and so the adapter's records and references) by position among the drawn ones.
            drawn = (drawn_ids or {}).get(task)
            record = lm.records[reference_key(task, drawn.index(sample["doc_id"]) if drawn else sample["doc_id"])]
            failed = record["error"] is not None and record["error"] != "empty output"
            rows.append({
                "method": method, "kind": spec["kind"], "params": str(sorted(spec.items())), "task": task,
                "longbench": info["longbench"], "category": info["category"], "metric": info["metric"],
                "sample_id": str(doc.get("_id", sample["doc_id"])), "lm_eval_doc_id": int(sample["doc_id"]),
                "doc_ids": json.dumps(doc.get("doc_ids")), "target_tokens": doc.get("target_tokens"),
                "prediction": sample["filtered_resps"][0], "references": json.dumps(doc["answers"]),
                "score": None if failed else float(sample["score"]),
                "metric_score": None if failed else float(sample[metric_key(info["metric"])]),
                **{k: v for k, v in record.items()},
            })
    return pd.DataFrame(rows), lm

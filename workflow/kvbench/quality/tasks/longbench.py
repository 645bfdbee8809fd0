"""Imported LongBench JSONL (`context`, `input`, `answers`, `dataset` lines in
`corpus.imported.path`): one task per dataset, with lm-eval's LongBench prompt, metric and
generation length for it. Extractive samples (QA, retrieval) whose answer is not in their
context are not built."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from typing import Any

from kvbench.quality.longbench import spec
from kvbench.quality.tasks.base import Sources, TaskFile, contains, register

EXTRACTIVE = ("single_doc_qa", "multi_doc_qa", "retrieval")


@register("longbench")
def build(sources: Sources, settings: dict[str, Any], seed: int) -> list[TaskFile]:
    rows = sources.imported
    if rows is None or "answers" not in rows or rows["answers"].isna().all():
        raise ValueError(
            "quality.tasks.longbench: the imported corpus has no LongBench lines "
            "(JSONL with context, input, answers, dataset in corpus.imported.path)"
        )
    rows = rows[rows["answers"].notna()]
    wanted = settings.get("datasets") or sorted(set(rows.doc_type))
    limit = max(settings["context_tokens"])
    files = []
    for dataset in wanted:
        task_spec = spec(dataset)
        task_spec = replace(task_spec, max_gen_tokens=settings.get("max_gen_tokens", task_spec.max_gen_tokens))
        mine = list(rows[rows.doc_type == dataset].itertuples(index=False))
        random.Random(f"{seed}/longbench/{dataset}").shuffle(mine)
        task = TaskFile(f"kvbench_longbench_{dataset}", task_spec, requested=settings["samples"])
        for row in mine:
            answers = [str(a) for a in json.loads(row.answers)]
            if task_spec.category in EXTRACTIVE and not any(contains(row.text, a) for a in answers):
                continue  # the presence check
            if sources.count(row.text) > limit:
                continue
            classes = json.loads(row.all_classes) if getattr(row, "all_classes", None) else None
            task.samples.append(
                {
                    "_id": str(row.doc_id),
                    "dataset": dataset,
                    "category": task_spec.category,
                    "target_tokens": limit,
                    "context": row.text,
                    "question": row.question or "",
                    "answers": answers,
                    "all_classes": classes,
                    "length": len(row.text.split()),
                    "doc_ids": [str(row.doc_id)],
                    "fact": None,
                }
            )
            if len(task.samples) == settings["samples"]:
                break
        files.append(task)
    return files

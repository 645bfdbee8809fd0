"""LongBench datasets as lm-eval ships them (`lm_eval/tasks/longbench/*.yaml`): prompt, maximum
generation length, stop strings and metric per dataset, read from lm-eval's own task files so
imported LongBench data and the official `longbench_*` tasks run exactly as lm-eval defines them."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import yaml

from kvbench.quality.kinds import LONGBENCH_CATEGORY as CATEGORY
from kvbench.quality.metrics import FIRST_LINE_DATASETS
from kvbench.quality.tasks.base import TaskSpec

NO_CHAT = ("trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p")  # LongBench's pred.py
METRIC = {  # lm-eval's process_results -> ours
    "get_qa_f1_with_score": "qa_f1",
    "get_rouge_with_score": "rouge",
    "get_classification_with_score": "classification",
    "get_retrieval_with_score": "retrieval",
    "get_count_with_score": "count",
    "get_code_sim_with_score": "code_sim",
}


class _Loader(yaml.SafeLoader):
    pass


_Loader.add_constructor("!function", lambda loader, node: loader.construct_scalar(node))


@lru_cache(maxsize=None)
def spec(dataset: str) -> TaskSpec:
    import lm_eval

    if dataset not in CATEGORY:
        raise ValueError(
            f"LongBench dataset {dataset!r} is not supported (English ones: {', '.join(sorted(CATEGORY))})"
        )
    path = Path(lm_eval.__file__).parent / "tasks" / "longbench" / f"{dataset}.yaml"
    task = yaml.load(path.read_text(), Loader=_Loader)
    gen = task["generation_kwargs"]
    metric = METRIC[str(task["process_results"]).rsplit(".", 1)[-1]]
    if dataset in FIRST_LINE_DATASETS and metric in ("qa_f1", "rouge", "classification"):
        metric += "_first_line"
    return TaskSpec(
        category=CATEGORY[dataset],
        template=task["doc_to_text"],
        metric=metric,
        max_gen_tokens=int(gen["max_gen_toks"]),
        chat=dataset not in NO_CHAT,
        longbench=dataset,
        until=tuple(gen.get("until") or ()),
    )

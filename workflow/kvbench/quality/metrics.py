"""process_results functions for kvbench's lm-eval tasks: lm-eval's own LongBench metrics.

Each returns {"score": ..., "<metric>_score": ...} as lm-eval's LongBench tasks do. LongBench
scores only the first line of its few-shot answers (trec, triviaqa, samsum, lsht): the
`*_first_line` variants apply that rule before the metric.
"""

from __future__ import annotations

import warnings
from typing import Any

with warnings.catch_warnings():  # fuzzywuzzy warns that python-Levenshtein is missing (code tasks only)
    warnings.simplefilter("ignore")
    from lm_eval.tasks.longbench import metrics as longbench

FIRST_LINE_DATASETS = ("trec", "triviaqa", "samsum", "lsht")


def first_line(prediction: str) -> str:
    """LongBench's rule for few-shot tasks: the first line, after leading newlines."""
    return prediction.lstrip("\n").split("\n")[0]


def qa_f1(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    return longbench.get_qa_f1_with_score(doc, results)


def rouge(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    return longbench.get_rouge_with_score(doc, results)


def classification(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    return longbench.get_classification_with_score(doc, results)


def retrieval(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    return longbench.get_retrieval_with_score(doc, results)


def count(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    return longbench.get_count_with_score(doc, results)


def code_sim(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    return longbench.get_code_sim_with_score(doc, results)


def qa_f1_first_line(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    return qa_f1(doc, [first_line(results[0])])


def rouge_first_line(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    return rouge(doc, [first_line(results[0])])


def classification_first_line(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    return classification(doc, [first_line(results[0])])


__all__ = [
    "qa_f1",
    "rouge",
    "classification",
    "retrieval",
    "count",
    "code_sim",
    "qa_f1_first_line",
    "rouge_first_line",
    "classification_first_line",
]

"""Summarization: one document; the reference summary is written from the facts of its fact
sheet that the document states (LongBench's gov_report prompt with "report by a government agency"
→ "document", ROUGE-L F, 512 tokens)."""

from __future__ import annotations

import random
from typing import Any

from kvbench.corpus.factsheets import vocabulary
from kvbench.quality.tasks.base import Sources, TaskSpec, contains, prompt_overhead, simple_task

SPEC = TaskSpec(
    category="summarization", metric="rouge", max_gen_tokens=512, chat=True, longbench="gov_report",
    template="You are given a document. Write a one-page summary of the document.\n\nDocument:\n{{context}}\n\n"
             "Now, write a one-page summary of the document.\n\nSummary:",
)


def reference_summary(doc: Any, facts: dict[str, str], context: str) -> str:
    labels = vocabulary(doc.domain)["facts"]
    stated = [f"The {labels[key]['label'].lower()} is {value}." for key, value in facts.items() if contains(context, value)]
    return " ".join([f"This {doc.doc_type.replace('_', ' ')} is a {doc.title}."] + stated)


def make(sources: Sources, target: int, n: int, rng: random.Random, settings: dict[str, Any]) -> list[dict[str, Any]]:
    import json

    docs = list(sources.docs.itertuples(index=False))
    rng.shuffle(docs)
    samples = []
    for doc in docs[:n]:
        context = sources.trim(doc.text, target - prompt_overhead(sources, SPEC))
        summary = reference_summary(doc, json.loads(doc.fact_sheet), context)
        samples.append({"context": context, "question": "", "answers": [summary], "doc_ids": [doc.doc_id], "fact": None})
    return samples


simple_task("summarization", SPEC, make)

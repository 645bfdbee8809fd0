"""Summarization: one document; the reference summary is written from the located, unambiguous
facts of its fact sheet whose span survives the cut (LongBench's gov_report prompt with "report by a
government agency" → "document", ROUGE-L F, 512 tokens)."""

from __future__ import annotations

import random
from typing import Any

from kvbench.corpus.factsheets import vocabulary
from kvbench.quality.tasks.base import Sources, TaskSpec, prompt_overhead, simple_task

SPEC = TaskSpec(
    category="summarization",
    metric="rouge",
    max_gen_tokens=512,
    chat=True,
    longbench="gov_report",
    template="You are given a document. Write a one-page summary of the document.\n\nDocument:\n{{context}}\n\n"
    "Now, write a one-page summary of the document.\n\nSummary:",
)


def reference_summary(sources: Sources, doc: Any, kept: list[tuple[int, int]]) -> str:
    """The document's type and title, then each located, unambiguous fact whose span the cut kept."""
    labels = vocabulary(doc.domain)["facts"]
    stated = [
        f"The {labels[f.fact]['label'].lower()} is {f.value}."
        for f in sources.doc_facts(doc.doc_id)
        if sources.survives(doc, f, kept)
    ]
    return " ".join([f"This {doc.doc_type.replace('_', ' ')} is a {doc.title}."] + stated)


def make(sources: Sources, target: int, n: int, rng: random.Random, settings: dict[str, Any]) -> list[dict[str, Any]]:
    docs = list(sources.docs.itertuples(index=False))
    rng.shuffle(docs)
    samples = []
    for doc in docs[:n]:
        context, kept = sources.trim_kept(doc.text, target - prompt_overhead(sources, SPEC))
        samples.append(
            {
                "context": context,
                "question": "",
                "answers": [reference_summary(sources, doc, kept)],
                "doc_ids": [doc.doc_id],
                "fact": None,
            }
        )
    return samples


simple_task("summarization", SPEC, make)

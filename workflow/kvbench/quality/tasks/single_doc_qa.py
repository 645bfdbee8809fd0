"""Single-document QA: one document and a question whose answer is one of its unambiguous facts, the
only value of its kind that the context states (LongBench's multifieldqa_en: its prompt verbatim,
qa_f1, 64 tokens)."""

from __future__ import annotations

import random
from typing import Any

from kvbench.quality.tasks.base import Sources, TaskSpec, prompt_overhead, second_answer, simple_task

SPEC = TaskSpec(
    category="single_doc_qa",
    metric="qa_f1",
    max_gen_tokens=64,
    chat=True,
    longbench="multifieldqa_en",
    template="Read the following text and answer briefly.\n\n{{context}}\n\nNow, answer the following question based "
    "on the above text, only give me the answer and do not output any other words.\n\nQuestion: "
    "{{question}}\nAnswer:",
)


def facts_in_order(sources: Sources, doc_id: str, rng: random.Random) -> list[Any]:
    """A document's facts in a seeded order: header facts and facts written in the prose alike."""
    mine = sources.doc_facts(doc_id)
    rng.shuffle(mine)
    return mine


def make(sources: Sources, target: int, n: int, rng: random.Random, settings: dict[str, Any]) -> list[dict[str, Any]]:
    docs = list(sources.docs.itertuples(index=False))
    rng.shuffle(docs)
    samples = []
    for doc in docs:
        for fact in facts_in_order(sources, doc.doc_id, rng):
            budget = target - prompt_overhead(sources, SPEC, question=fact.question)
            context, kept = sources.trim_kept(doc.text, budget)
            # the presence check (no sample whose located answer is cut) and the uniqueness check
            if sources.survives(doc, fact, kept) and second_answer(doc.domain, fact.fact, fact.value, context) is None:
                samples.append(
                    {
                        "context": context,
                        "question": fact.question,
                        "answers": [fact.value],
                        "doc_ids": [doc.doc_id],
                        "fact": fact.fact,
                    }
                )
                break
        if len(samples) == n:
            break
    return samples


simple_task("single_doc_qa", SPEC, make)

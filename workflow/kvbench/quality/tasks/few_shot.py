"""Few-shot classification: labelled excerpts (excerpt -> document type), then an excerpt of
another document to label (LongBench's trec prompt with "question" -> "document excerpt", its
classification score over the first line, 64 tokens, no chat template)."""

from __future__ import annotations

import random
from typing import Any

from kvbench.quality.tasks.base import Sources, TaskSpec, doc_label, prompt_overhead, section_bodies, simple_task

SPEC = TaskSpec(
    category="few_shot",
    metric="classification_first_line",
    max_gen_tokens=64,
    chat=False,
    longbench="trec",
    template="Please determine the type of the document excerpt below. Here are some examples of document "
    "excerpts.\n\n{{context}}\n{{question}}",
    until=("\n",),
)


def excerpt(sources: Sources, doc: Any, tokens: int, rng: random.Random) -> str:
    """A window of about `tokens` tokens from one of the document's section bodies, on one line."""
    ids = sources.ids(rng.choice(section_bodies(doc)))
    start = rng.randrange(max(1, len(ids) - tokens))
    return " ".join(sources.decode(ids[start : start + tokens]).split())


def make(sources: Sources, target: int, n: int, rng: random.Random, settings: dict[str, Any]) -> list[dict[str, Any]]:
    tokens = int(settings.get("excerpt_tokens", 48))
    docs = [d for d in sources.docs.itertuples(index=False) if section_bodies(d)]
    classes = sorted({doc_label(d.doc_type) for d in docs})
    rng.shuffle(docs)
    samples = []
    for query in docs[:n]:
        label = doc_label(query.doc_type)
        question = f"Excerpt: {excerpt(sources, query, tokens, rng)}\nType:"
        budget = target - prompt_overhead(sources, SPEC, question=question)
        by_label = {c: [d for d in docs if doc_label(d.doc_type) == c and d.doc_id != query.doc_id] for c in classes}
        if not by_label[label]:
            continue  # the presence check: no other document carries the query's label
        order = [c for c in rng.sample(classes, len(classes)) if by_label[c]]

        def shot(i: int, c: str) -> tuple[str, str]:
            doc = by_label[c][i // len(order) % len(by_label[c])]
            return f"Excerpt: {excerpt(sources, doc, tokens, rng)}\nType: {c}", doc.doc_id

        shots: list[tuple[str, str]] = []
        while sources.count("\n".join(s for s, _ in shots)) <= budget:  # classes in turn, until the budget
            shots.append(shot(len(shots), order[len(shots) % len(order)]))
        shots.pop()
        if shots and not any(s.endswith(f"Type: {label}") for s, _ in shots):
            at = rng.randrange(len(shots))  # every class cannot fit: make sure the query's does
            shots[at] = shot(0, label)
            while len(shots) > 1 and sources.count("\n".join(s for s, _ in shots)) > budget:
                shots.pop(-1 if at < len(shots) - 1 else -2)
        if any(s.endswith(f"Type: {label}") for s, _ in shots):
            samples.append(
                {
                    "context": "\n".join(s for s, _ in shots),
                    "question": question,
                    "answers": [label],
                    "all_classes": classes,
                    "doc_ids": [query.doc_id] + [d for _, d in shots],
                    "fact": None,
                }
            )
    return samples


simple_task("few_shot", SPEC, make)

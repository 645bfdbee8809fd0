"""Passage retrieval: numbered paragraphs from different documents and one sentence copied from
one of them; the answer is that paragraph's number (LongBench's passage_retrieval_en prompt with
"30 paragraphs from Wikipedia" -> "N paragraphs from documents" and "abstract" -> "sentence", its
retrieval score, 32 tokens)."""

from __future__ import annotations

import random
import re
from typing import Any

from kvbench.quality.tasks.base import Sources, TaskSpec, contains, prompt_overhead, section_bodies, simple_task

SPEC = TaskSpec(
    category="retrieval",
    metric="retrieval",
    max_gen_tokens=32,
    chat=True,
    longbench="passage_retrieval_en",
    template="Here are {{paragraphs}} paragraphs from documents, along with a sentence. Please determine which "
    "paragraph the sentence is from.\n\n{{context}}\n\nThe following is a sentence.\n\n{{question}}\n\n"
    "Please enter the number of the paragraph that the sentence is from. The answer format must be like "
    '"Paragraph 1", "Paragraph 2", etc.\n\nThe answer is: ',
)


def sentences(text: str, min_words: int = 8) -> list[str]:
    parts = re.split(r"(?<=[.!?])\s+", " ".join(text.split()))
    return [s for s in parts if len(s.split()) >= min_words and s[-1:] in ".!?"]


def paragraph(sources: Sources, body: str, tokens: int) -> str:
    """The head of a section body, at most `tokens` tokens, ending at a sentence end, on one line."""
    head = " ".join(sources.decode(sources.ids(body)[:tokens]).split())
    cut = max(head.rfind(". "), head.rfind("? "), head.rfind("! "))
    return head if head[-1:] in ".!?" or cut < 0 else head[: cut + 1]


def make(sources: Sources, target: int, n: int, rng: random.Random, settings: dict[str, Any]) -> list[dict[str, Any]]:
    tokens = int(settings.get("paragraph_tokens", 160))
    docs = [d for d in sources.docs.itertuples(index=False) if section_bodies(d)]
    samples = []
    for _ in range(n * 4):  # a few more draws than samples: a draw without a usable sentence is skipped
        if len(samples) == n:
            break
        rng.shuffle(docs)
        budget = target - prompt_overhead(sources, SPEC, question="x " * 40, paragraphs="10")
        paragraphs: list[str] = []
        for doc in docs:  # one paragraph per document, until the context is full
            text = paragraph(sources, rng.choice(section_bodies(doc)), tokens)
            numbered = "\n\n".join(f"Paragraph {i}: {p}" for i, p in enumerate(paragraphs + [text], start=1))
            if sources.count(numbered) > budget:
                break
            paragraphs.append(text)
        if len(paragraphs) < 2:
            continue
        k = rng.randrange(len(paragraphs))
        unique = [
            s for s in sentences(paragraphs[k]) if not any(contains(p, s) for j, p in enumerate(paragraphs) if j != k)
        ]
        if not unique:
            continue
        context = "\n\n".join(f"Paragraph {i}: {p}" for i, p in enumerate(paragraphs, start=1))
        samples.append(
            {
                "context": context,
                "question": rng.choice(unique),
                "answers": [f"Paragraph {k + 1}"],
                "paragraphs": len(paragraphs),
                "doc_ids": [docs[k].doc_id] + [d.doc_id for j, d in enumerate(docs[: len(paragraphs)]) if j != k],
                "fact": None,
            }
        )
    return samples


simple_task("retrieval", SPEC, make)

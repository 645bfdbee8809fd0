"""Multi-document QA: several documents of one domain as passages; the question names a fact of
one document (its anchor, e.g. the patient or a party) and asks for another of the same document,
so the model must find the right passage (LongBench's hotpotqa: its prompt verbatim, qa_f1, 32
tokens). Neither the answer nor the anchor appears in the distractor passages."""

from __future__ import annotations

import random
from typing import Any

from kvbench.quality.tasks.base import Sources, TaskSpec, contains, prompt_overhead, second_answer, simple_task

SPEC = TaskSpec(
    category="multi_doc_qa",
    metric="qa_f1",
    max_gen_tokens=32,
    chat=True,
    longbench="hotpotqa",
    template="Answer the question based on the given passages. Only give me the answer and do not output any other "
    "words.\n\nThe following are given passages.\n{{context}}\n\nAnswer the question based on the given "
    "passages. Only give me the answer and do not output any other words.\n\nQuestion: {{question}}\nAnswer:",
)
# Facts that name a document's people, parties or case: what a reader would use to pick it out.
ANCHORS = ("patient_name", "case_number", "party_a", "party_b", "witness", "mrn", "attending", "judge")


def question_about(anchor: str, question: str) -> str:
    return f"In the document that mentions {anchor}, {question[0].lower()}{question[1:]}"


def make(sources: Sources, target: int, n: int, rng: random.Random, settings: dict[str, Any]) -> list[dict[str, Any]]:
    k = int(settings.get("documents", 3))
    docs = list(sources.docs.itertuples(index=False))
    rng.shuffle(docs)
    samples = []
    for doc in docs:
        facts = sources.doc_facts(doc.doc_id)
        anchors = [f for f in facts if f.fact in ANCHORS]
        answers = [f for f in facts if f.fact not in ANCHORS]
        others = [d for d in docs if d.domain == doc.domain and d.doc_id != doc.doc_id]
        if not anchors or not answers or len(others) < k - 1:
            continue
        rng.shuffle(answers)
        anchor = min(anchors, key=lambda f: ANCHORS.index(f.fact))
        distractors = rng.sample(others, k - 1)
        slot = rng.randrange(k)
        for fact in answers:
            question = question_about(anchor.value, fact.question)
            share = (target - prompt_overhead(sources, SPEC, question=question)) // k - 4  # "Passage i:\n"
            passages = [sources.trim(d.text, share) for d in distractors]
            mine, kept = sources.trim_kept(doc.text, share)
            passages.insert(slot, mine)
            # the located answer and anchor survive the cut of their passage, which states no second answer
            # of the kind (the distractors hold other documents' values by design: the anchor picks the
            # passage); no distractor names either
            if (
                sources.survives(doc, fact, kept)
                and sources.survives(doc, anchor, kept)
                and second_answer(doc.domain, fact.fact, fact.value, mine) is None
                and not any(
                    contains(p, v) for j, p in enumerate(passages) if j != slot for v in (fact.value, anchor.value)
                )
            ):
                context = "\n".join(f"Passage {i}:\n{p}" for i, p in enumerate(passages, start=1))
                samples.append(
                    {
                        "context": context,
                        "question": question,
                        "answers": [fact.value],
                        "doc_ids": [doc.doc_id] + [d.doc_id for d in distractors],  # the answer's first
                        "fact": fact.fact,
                    }
                )
                break
        if len(samples) == n:
            break
    return samples


simple_task("multi_doc_qa", SPEC, make)

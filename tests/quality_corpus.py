"""A tiny realistic-shaped corpus for the quality tests, built without a server: seeded fact sheets
(the real ones), headers as the corpus stage writes them, section bodies made of filler sentences
that state some facts, and facts located by the real locator."""

from __future__ import annotations

import json
import random

import pandas as pd

from kvbench.corpus.factsheets import plan_documents, vocabulary
from kvbench.corpus.realistic import GeneratedDoc, Section, header_text, locate_facts

FILLER = [
    "The team reviewed the record in detail before the next step was taken.",
    "Several questions about the timeline were raised and answered during the meeting.",
    "Each point was discussed with the people involved and written down for the file.",
    "Later that week the schedule changed, and the notes were updated accordingly.",
    "No further concerns were raised at that time, and the plan remained unchanged.",
    "A second review confirmed the earlier observations without new findings.",
    "The summary below lists what was decided and who will follow up on it.",
    "Everyone agreed that the wording should stay close to the original request.",
]


def tiny_corpus(
    seed: int = 7, docs_per_type: int = 2, sentences: int = 6, drop: str | None = None
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Documents and their located facts; `drop` names a fact left out of every text (never present)."""
    docs, facts = [], []
    for plan in plan_documents(["medical", "legal"], docs_per_type, seed):
        rng = random.Random(plan.seed)
        labels = vocabulary(plan.domain)["facts"]
        text = header_text(plan)
        header_end, sections = len(text), []
        stated = [(k, v) for k, v in plan.prompt_facts().items() if k != drop]
        for index, name in enumerate(plan.sections[:3]):
            lines = rng.sample(FILLER, sentences)
            for key, value in stated[index::3]:
                unit = labels[key].get("unit")
                lines.insert(
                    rng.randrange(len(lines)),
                    f"The {labels[key]['label'].lower()} was {value}{' ' + unit + 's' if unit else ''}.",
                )
            start = len(text) + 2
            text += f"\n\n{name.upper()}\n" + " ".join(lines)
            sections.append(Section(name, start, len(text), 0))
        if drop in plan.header_keys:
            text = text.replace(plan.facts[drop], "(withheld)")
        kept, _ = locate_facts(GeneratedDoc(plan, text, header_end, sections, 0))
        facts += kept
        docs.append(
            {
                "doc_id": plan.doc_id,
                "corpus": "realistic",
                "domain": plan.domain,
                "doc_type": plan.doc_type,
                "title": plan.title,
                "text": text,
                "sections": json.dumps([[s.name, s.start, s.end] for s in sections]),
                "fact_sheet": json.dumps(plan.facts),
            }
        )
    return pd.DataFrame(docs), pd.DataFrame(facts)

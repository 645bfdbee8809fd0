"""The task registry: a builder turns the corpus into the samples of one LongBench-style task.

A task is one builder module that registers under its name (listed in kvbench/quality/kinds.py)
and one `quality.tasks` config entry. Samples are LongBench records (`context`, `question`,
`answers`, `all_classes`, `length`) plus kvbench's bookkeeping, so lm-eval's own LongBench
metric functions score them unchanged.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import pandas as pd

from kvbench.corpus.factsheets import vocabulary
from kvbench.corpus.realistic import NAME_NEIGHBOURS, mention_spans
from kvbench.prompts import middle_truncate
from kvbench.quality.kinds import TASK_SETTINGS

SURROUNDING_CHARS = 12  # about two words either side of an answer that a truncation must keep


@dataclass(frozen=True)
class TaskSpec:
    """How lm-eval runs a task: the prompt, metric and generation length of its LongBench dataset."""

    category: str
    template: str  # lm-eval (jinja) template over the sample's fields: {{context}}, {{question}}, ...
    metric: str  # a process_results function of kvbench.quality.metrics
    max_gen_tokens: int  # LongBench's maximum generation length (each run caps it: quality.max_gen_cap)
    chat: bool  # LongBench applies the chat template, except for its few-shot and code tasks
    longbench: str  # the LongBench dataset whose prompt, metric and length this task follows
    until: tuple[str, ...] = ()


@dataclass
class TaskFile:
    name: str  # the lm-eval task name
    spec: TaskSpec
    samples: list[dict[str, Any]] = field(default_factory=list)
    requested: int = 0  # samples asked for; fewer are built when too few answers survive the checks


@dataclass(frozen=True)
class Sources:
    """What builders draw from: realistic documents, their unambiguous facts, imported documents."""

    docs: pd.DataFrame
    facts: pd.DataFrame
    imported: pd.DataFrame | None
    tokenizer: Any  # a `tokenizers.Tokenizer`: counting needs neither torch nor transformers

    def ids(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids))

    def count(self, text: str) -> int:
        return len(self.ids(text))

    def trim(self, text: str, tokens: int) -> str:
        """`text` cut in the middle to at most `tokens` tokens, as LongBench truncates prompts."""
        return self.trim_kept(text, tokens)[0]

    def trim_kept(self, text: str, tokens: int) -> tuple[str, list[tuple[int, int]]]:
        """`trim`, and the character ranges of `text` that the cut keeps (a token's characters are
        kept only if the token is)."""
        encoding = self.tokenizer.encode(text, add_special_tokens=False)
        ids, offsets = list(encoding.ids), list(encoding.offsets)
        if len(ids) <= tokens:
            return text, [(0, len(text))]
        kept = middle_truncate(ids, max(tokens, 0))
        head = max(tokens, 0) // 2
        tail = len(kept) - head
        ranges = [(0, offsets[head - 1][1])] if head else []
        if tail:
            ranges.append((offsets[len(ids) - tail][0], len(text)))
        return self.decode(kept), ranges

    def evidence(self, doc: Any, fact: Any) -> list[tuple[int, int]]:
        """Where in `doc.text` the located fact stands for itself, with its unit or label
        (kvbench.corpus.realistic.mention_spans): the spans a truncation must keep."""
        info = vocabulary(doc.domain)["facts"][fact.fact]
        return [
            (start, end) for _, start, end in mention_spans(doc.text, fact.value, str(info["label"]), info.get("unit"))
        ]

    def survives(self, doc: Any, fact: Any, kept: list[tuple[int, int]]) -> bool:
        """The presence check after a cut: one of the fact's located spans, with SURROUNDING_CHARS on
        each side (so the cut splices no other sentence onto it: "Case number| was March 30"), lies
        wholly in a kept range. A whole-word match elsewhere ("24 hours" for an age of 24) does not count."""
        size = len(doc.text)
        return any(
            a <= max(0, start - SURROUNDING_CHARS) and min(size, end + SURROUNDING_CHARS) <= b
            for start, end in self.evidence(doc, fact)
            for a, b in kept
        )

    def doc_facts(self, doc_id: str) -> list[Any]:
        """A document's located, unambiguous facts, in the facts table's order."""
        return [f for f in self.facts.itertuples(index=False) if f.doc_id == doc_id]


Builder = Callable[[Sources, dict[str, Any], int], list[TaskFile]]
TASKS: dict[str, Builder] = {}


def register(name: str) -> Callable[[Builder], Builder]:
    def wrap(builder: Builder) -> Builder:
        if name not in TASK_SETTINGS or name in TASKS:
            raise ValueError(f"task {name!r} is not listed in TASK_SETTINGS or registered twice")
        TASKS[name] = builder
        return builder

    return wrap


SampleMaker = Callable[[Sources, int, int, random.Random, dict[str, Any]], list[dict[str, Any]]]


def simple_task(name: str, spec: TaskSpec, make: SampleMaker) -> Builder:
    """A builder for one lm-eval task: `make(sources, target_tokens, n, rng, settings)` per context length."""

    @register(name)
    def build(sources: Sources, settings: dict[str, Any], seed: int) -> list[TaskFile]:
        task = TaskFile(
            f"kvbench_{name}", replace(spec, max_gen_tokens=settings.get("max_gen_tokens", spec.max_gen_tokens))
        )
        for target in settings["context_tokens"]:
            rng = random.Random(f"{seed}/{name}/{target}")
            made = make(sources, target, settings["samples"], rng, settings)
            task.requested += settings["samples"]
            for i, sample in enumerate(made):
                task.samples.append(
                    {
                        "_id": f"{name}-{target}-{i:03d}",
                        "dataset": name,
                        "category": spec.category,
                        "target_tokens": target,
                        "all_classes": None,
                        **sample,
                        "length": len(sample["context"].split()),
                    }
                )
        return [task]

    return build


def contains(text: str, answer: str) -> bool:
    """Whole-word, case-insensitive: an absence check (no distractor mentions the answer), and the
    presence check of imported answers, which have no located span."""
    return re.search(rf"(?<!\w){re.escape(answer)}(?!\w)", text, re.IGNORECASE) is not None


# The uniqueness check: an answer's context must state no second plausible answer of its kind (the
# LLM writes around the fact sheet and may add "hypertension and obesity" to a comorbidity of
# hypertension). Kinds whose vocabulary (kvbench/data/<domain>.yaml) lists every value the fact
# sheets draw: any other listed value counts (kind: list, field of its entries).
LISTED_KINDS: dict[str, tuple[str, str | None]] = {
    "hospital": ("hospitals", None),
    "symptom": ("symptoms", None),
    "comorbidity": ("comorbidities", None),
    **{kind: ("conditions", kind) for kind in ("diagnosis", "drug", "dose", "test", "finding")},
    "contract_kind": ("contract_kinds", "kind"),
    "subject": ("contract_kinds", "subject"),
    "clause": ("clauses", None),
    "claim": ("case_kinds", "claim"),
    "remedy": ("case_kinds", "remedy"),
    "court": ("courts", None),
    "governing_state": ("governing_states", None),
}
# People asked for by a role that a title marks: any other person with that title counts.
_WORD = r"[A-Z](?:\.|[a-z'’]*(?:-?[A-Z][a-z'’]+)*\b)"  # J., Mcmillan, McMillan, O'Brien, Parrish-Ayala; not "MD"
_NAME = rf"{_WORD}(?: {_WORD}){{0,2}}"
ROLE_NAMES: dict[str, re.Pattern[str]] = {
    "attending": re.compile(rf"\b(?:Dr\.?|Doctor) ({_NAME})"),
    "judge": re.compile(rf"\b(?:Judge|Justice) ({_NAME})"),
    "attorney": re.compile(rf"({_NAME}),? Esq\b"),
}
# Not checked: kinds whose question singles out one of several values of one type that a document
# holds by design (admission vs discharge date, effective vs deposition date, first vs second party;
# the age, record number, amount or term among other numbers), and names or places that no title or
# list marks (patient, witness, city, sex): any other person or place would count.


def _name_words(name: str) -> set[str]:
    return {w for w in re.findall(r"[a-z'’-]+", name.lower()) if w not in NAME_NEIGHBOURS and len(w) > 1}


def listed_rival(text: str, answer: str, values: list[str]) -> str | None:
    """The first of `values` other than `answer` that `text` states (whole words, case-insensitive),
    not counting a match inside one of the answer's ("chronic kidney disease" inside "chronic kidney
    disease stage 3"); a longer value that contains the answer does count."""
    own = [m.span() for m in re.finditer(rf"(?<!\w){re.escape(answer)}(?!\w)", text, re.IGNORECASE)]
    for value in values:
        if value.lower() != answer.lower():
            for m in re.finditer(rf"(?<!\w){re.escape(value)}(?!\w)", text, re.IGNORECASE):
                if not any(a <= m.start() and m.end() <= b for a, b in own):
                    return value
    return None


def second_answer(domain: str, kind: str, answer: str, text: str) -> str | None:
    """A second plausible answer of `kind` that `text` (a sample's context as cut) states, or None."""
    if kind in LISTED_KINDS:
        name, key = LISTED_KINDS[kind]
        values = [str(entry[key] if key else entry) for entry in vocabulary(domain)[name]]
        return listed_rival(text, answer, values)
    if kind in ROLE_NAMES:
        mine = _name_words(answer)
        for m in ROLE_NAMES[kind].finditer(text):
            if not _name_words(m.group(1)) <= mine:  # "Dr. Oliver" is Dr. William Oliver
                return m.group(0)
    return None


def prompt_overhead(sources: Sources, spec: TaskSpec, **fields: str) -> int:
    """Tokens the template and the other fields take around an empty context."""
    text = spec.template
    for key, value in {"context": "", **fields}.items():
        text = text.replace("{{" + key + "}}", value)
    return sources.count(text)


def section_bodies(doc: Any) -> list[str]:
    """A realistic document's generated section texts, without their headings."""
    import json

    bodies = []
    for _, start, end in json.loads(doc.sections):
        heading_end = doc.text.find("\n", start, end)
        body = doc.text[heading_end + 1 : end].strip() if heading_end >= 0 else ""
        if body:
            bodies.append(body)
    return bodies


def doc_label(doc_type: str) -> str:
    return doc_type.replace("_", " ")

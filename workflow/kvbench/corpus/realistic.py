"""Realistic long documents written section by section by a served LLM from seeded fact sheets."""

from __future__ import annotations

import random
import re
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from kvbench.corpus.factsheets import DocPlan, vocabulary


class ChatClient(Protocol):
    def chat(self, messages: list[dict[str, str]], **params: Any) -> dict[str, Any]: ...


@dataclass(frozen=True)
class GenerationSettings:
    target_tokens: int
    section_tokens: int
    min_section_tokens: int
    temperature: float
    top_p: float
    repetition_penalty: float
    concurrency: int
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class Section:
    name: str
    start: int
    end: int
    completion_tokens: int


@dataclass
class GeneratedDoc:
    plan: DocPlan
    text: str
    header_end: int
    sections: list[Section]
    tokens: int


def fact_label(domain: str, key: str) -> str:
    return str(vocabulary(domain)["facts"][key]["label"])


def header_text(plan: DocPlan) -> str:
    lines = [plan.title.upper(), ""]
    lines += [f"{fact_label(plan.domain, k)}: {plan.facts[k]}" for k in plan.header_keys]
    return "\n".join(lines)


def section_messages(plan: DocPlan, section: str) -> list[dict[str, str]]:
    facts = "\n".join(f"- {fact_label(plan.domain, k)}: {v}" for k, v in plan.prompt_facts().items())
    kind = "clinical" if plan.domain == "medical" else "legal"
    prompt = (
        f'Write the section "{section}" of a {plan.title} ({kind} document). '
        f"Use these facts, copied exactly as written:\n{facts}\n"
        f"Write several paragraphs of professional {kind} prose. Do not repeat the section title."
    )
    return [{"role": "user", "content": prompt}]


# A chat model wraps prose in "Sure, here is the section:" and "I hope this helps!": not document
# text. Only short lines of that shape go (at most OPENER_WORDS words): a paragraph that happens to
# start with "Certainly, the defendant breached..." or discharge advice "If you have chest pain,
# return..." is document text.
OPENER_WORDS = 15
_OPENER = r"(?:sure|certainly|of course|absolutely|okay|ok|here(?:'s| is| are)|below (?:is|are))\b"
# "Sure!" / "Certainly." alone, or with the chat model's pleasantry after it
OPENER_EXCLAIM = re.compile(r"^(?:sure|certainly|of course|absolutely|okay|ok)[!.,]\s*", re.IGNORECASE)
PLEASANTRY = re.compile(
    r"^(?:i'?d be (?:happy|glad)|i would be (?:happy|glad)|(?:happy|glad) to help)\b[^\n]*?[!.:]\**[ \t]*",
    re.IGNORECASE,
)
# "Sure, here is the Plan section:" (the rest of the line, if any, is the text): up to the colon
OPENER_TO_COLON = re.compile(
    rf"^\**{_OPENER}[^\n:]*?\b(?:section|summary|note|text|document|draft|paragraphs?|"
    rf"content|version|report|following|requested|rewrite|continuation)\b[^\n:]*:\**[ \t]*",
    re.IGNORECASE,
)
CHAT_CLOSER = re.compile(
    r"^(?:i hope (?:this|that|it|these)\b|(?:please )?let me know\b|feel free to (?:ask|reach|let)\b|"
    r"is there anything else\b)",
    re.IGNORECASE,
)


def _short(text: str) -> bool:
    return len(text.split()) < OPENER_WORDS


def _strip_opener(body: str) -> str | None:
    """`body` without one leading chat opener, or None if it does not start with one."""
    line = body.split("\n", 1)[0]
    if (match := OPENER_TO_COLON.match(body)) and _short(match.group(0)):
        return body[match.end() :]
    if (match := OPENER_EXCLAIM.match(body)) and _short(line):
        return body[match.end() :]
    if (match := PLEASANTRY.match(body)) and _short(match.group(0)):
        return body[match.end() :]
    return None


def strip_chat_wrapping(body: str) -> str:
    """A section reply without the model's chat openers (short first lines, or a short lead-in up to
    its colon) and sign-offs (short last lines: "I hope this helps", "Let me know ...")."""
    body = body.strip()
    while (rest := _strip_opener(body)) is not None and rest.strip() != body:
        body = rest.strip()
    while body:
        head, _, last = body.rpartition("\n")
        if not (CHAT_CLOSER.match(last.strip()) and _short(last)):
            break
        body = head.rstrip()
    return body


def request_seed(plan: DocPlan, index: int) -> int:
    return random.Random(f"{plan.seed}/section/{index}").randrange(2**31)


class Progress:
    """Thread-safe progress lines for the rule's log."""

    def __init__(self, n_docs: int, target: int) -> None:
        self.n_docs, self.target = n_docs, target
        self.done = 0
        self.start = time.monotonic()
        self.lock = threading.Lock()

    def section(self, doc_id: str, name: str, tokens: int, finished: bool) -> None:
        with self.lock:
            self.done += finished
            print(
                f"[corpus] {time.monotonic() - self.start:6.0f} s  {doc_id}: {name!r} -> "
                f"{tokens}/{self.target} tokens  ({self.done}/{self.n_docs} docs done)",
                file=sys.stderr,
                flush=True,
            )


def write_document(
    plan: DocPlan,
    client: ChatClient,
    count_tokens: Callable[[str], int],
    settings: GenerationSettings,
    progress: Progress,
) -> GeneratedDoc:
    text = header_text(plan)
    header_end = len(text)
    sections: list[Section] = []
    tokens = count_tokens(text)
    # Every request adds at least min_section_tokens, so this bound is never the normal exit.
    max_requests = len(plan.sections) + settings.target_tokens // settings.min_section_tokens + 1
    index = 0
    while tokens < settings.target_tokens and index < max_requests:
        base = plan.sections[index % len(plan.sections)]
        name = base if index < len(plan.sections) else f"{base} (continued)"
        budget = max(settings.min_section_tokens, min(settings.section_tokens, settings.target_tokens - tokens))
        reply = client.chat(
            section_messages(plan, base),
            max_tokens=budget,
            min_tokens=settings.min_section_tokens,
            temperature=settings.temperature,
            top_p=settings.top_p,
            repetition_penalty=settings.repetition_penalty,
            seed=request_seed(plan, index),
            **({"chat_template_kwargs": settings.chat_template_kwargs} if settings.chat_template_kwargs else {}),
        )
        body = strip_chat_wrapping(reply["choices"][0]["message"]["content"])
        start = len(text) + 2
        text += f"\n\n{name.upper()}\n{body}"
        sections.append(Section(name, start, len(text), int(reply["usage"]["completion_tokens"])))
        tokens = count_tokens(text)
        index += 1
        progress.section(plan.doc_id, name, tokens, finished=tokens >= settings.target_tokens)
    return GeneratedDoc(plan, text, header_end, sections, tokens)


def generate_corpus(
    plans: list[DocPlan],
    client: ChatClient,
    count_tokens: Callable[[str], int],
    settings: GenerationSettings,
) -> list[GeneratedDoc]:
    """Write all documents; concurrent requests let the server batch across documents."""
    progress = Progress(len(plans), settings.target_tokens)
    with ThreadPoolExecutor(max_workers=settings.concurrency) as pool:
        futures = [pool.submit(write_document, p, client, count_tokens, settings, progress) for p in plans]
        return [f.result() for f in futures]


# A name preceded or followed by one of these is still the same name ("Dr. Ana Ruiz", "The Smith Group").
NAME_NEIGHBOURS = frozenset(
    """
mr mrs ms mx miss dr doctor judge justice hon honorable attorney counsel esq prof professor nurse patient
witness plaintiff defendant petitioner respondent appellant appellee party parties company client
the a an this that these its their his her our at in on of to by for from with and or but as per under
between against v vs
""".split()
)


def mention_spans(text: str, value: str, label: str, unit: str | None) -> list[tuple[int, int, int]]:
    """The places where `value` stands for itself, as (value start, evidence start, evidence end):
    whole words (age "70" is not in "1970"), not a piece of a longer number ("$12,500" is not in
    "$12,500,000"), and for a bare number with a `unit`, only where the unit follows
    ("24-year-old") or its label precedes ("Age: 24") — "24 hours" or a header date's "24" are
    other numbers. The evidence is the value with that unit or label: what a reader needs to see
    (and a truncation must keep) for the value to answer the question."""
    pattern = re.compile(rf"(?<!\w){re.escape(value)}(?!\w)", re.IGNORECASE)
    unit_after = re.compile(rf"\)?[- ]{re.escape(unit)}s?\b", re.IGNORECASE) if unit else None
    label_before = re.compile(rf"{re.escape(label)}:\s*$", re.IGNORECASE)
    spans = []
    for match in pattern.finditer(text):
        before, after = text[max(0, match.start() - 80) : match.start()], text[match.end() : match.end() + 40]
        if (value[-1].isdigit() and re.match(r"[.,]\d", after)) or (
            value[0].isdigit() and re.search(r"\d[.,]$", before)
        ):
            continue
        start, end = match.start(), match.end()
        if unit_after:
            unit, labelled = unit_after.match(after), label_before.search(before)
            if not (unit or labelled):
                continue
            if unit:
                end += unit.end()
            else:
                start -= len(before) - labelled.start()
        spans.append((match.start(), start, end))
    return spans


def _mentions(text: str, value: str, label: str, unit: str | None) -> list[int]:
    """Starts of the places where `value` stands for itself (see `mention_spans`)."""
    return [at for at, _, _ in mention_spans(text, value, label, unit)]


def _longer_name(text: str, start: int, end: int) -> str | None:
    """The longer name a capitalised value sits in ("Jackson Parrish-Ayala" for "Parrish-Ayala"), if any."""
    before = re.search(r"([A-Z][\w'.]*)[ -]$", text[max(0, start - 40) : start])
    after = re.match(r"[ -]([A-Z][\w']*)", text[end : end + 40])
    for word in (before, after):
        if word and word.group(1).rstrip(".").lower() not in NAME_NEIGHBOURS:
            return text[start - len(word.group(0)) : end] if word is before else text[start : end + len(word.group(0))]
    return None


def locate_facts(doc: GeneratedDoc) -> tuple[list[dict[str, Any]], list[str]]:
    """Facts the text verifiably contains (case-insensitive mentions, see `_mentions`), and those it lacks.

    A fact the model wrote in a section is located there (source 'generated'); a header fact
    that the model never repeated is located in the header (source 'header'). A kept fact is
    `unambiguous` (fit to be an answer) unless one of its mentions lies inside another fact's
    mention (a patient's name inside the attending's) or inside a longer name ("Parrish-Ayala"
    in "Jackson Parrish-Ayala"); `ambiguity` says why.
    """
    questions = vocabulary(doc.plan.domain)["facts"]
    found: dict[str, list[int]] = {}
    dropped = []
    for key, value in doc.plan.facts.items():
        starts = _mentions(doc.text, value, str(questions[key]["label"]), questions[key].get("unit"))
        if starts:
            found[key] = starts
        else:
            dropped.append(key)
    spans = [(key, at, at + len(doc.plan.facts[key])) for key, starts in found.items() for at in starts]
    kept = []
    for key, starts in found.items():
        value = doc.plan.facts[key]
        ambiguity = None
        for at in starts:
            outer = next(
                (
                    other
                    for other, s, e in spans
                    if other != key and s <= at and at + len(value) <= e and e - s > len(value)
                ),
                None,
            )
            if outer:
                ambiguity = f"inside {outer} ({doc.plan.facts[outer]!r})"
                break
            if doc.text[at : at + 1].isupper() and not any(ch.isdigit() for ch in value):
                longer = _longer_name(doc.text, at, at + len(value))
                if longer:
                    ambiguity = f"inside the longer name {longer!r}"
                    break
        body_at = next((h for h in starts if h >= doc.header_end), -1)
        at = body_at if body_at >= 0 else starts[0]
        section = next((s.name for s in doc.sections if s.start <= at < s.end), "header")
        kept.append(
            {
                "doc_id": doc.plan.doc_id,
                "fact": key,
                "value": value,
                "question": questions[key]["question"],
                "char_start": at,
                "char_end": at + len(value),
                "section": section,
                "source": "generated" if body_at >= 0 else "header",
                "occurrences": len(starts),
                "unambiguous": ambiguity is None,
                "ambiguity": ambiguity,
            }
        )
    return kept, dropped

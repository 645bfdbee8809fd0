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
                file=sys.stderr, flush=True,
            )


def write_document(
    plan: DocPlan, client: ChatClient, count_tokens: Callable[[str], int],
    settings: GenerationSettings, progress: Progress,
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
            section_messages(plan, base), max_tokens=budget, min_tokens=settings.min_section_tokens,
            temperature=settings.temperature, top_p=settings.top_p,
            repetition_penalty=settings.repetition_penalty, seed=request_seed(plan, index),
            **({"chat_template_kwargs": settings.chat_template_kwargs} if settings.chat_template_kwargs else {}),
        )
        body = reply["choices"][0]["message"]["content"].strip()
        start = len(text) + 2
        text += f"\n\n{name.upper()}\n{body}"
        sections.append(Section(name, start, len(text), int(reply["usage"]["completion_tokens"])))
        tokens = count_tokens(text)
        index += 1
        progress.section(plan.doc_id, name, tokens, finished=tokens >= settings.target_tokens)
    return GeneratedDoc(plan, text, header_end, sections, tokens)


def generate_corpus(
    plans: list[DocPlan], client: ChatClient, count_tokens: Callable[[str], int],
    settings: GenerationSettings,
) -> list[GeneratedDoc]:
    """Write all documents; concurrent requests let the server batch across documents."""
    progress = Progress(len(plans), settings.target_tokens)
    with ThreadPoolExecutor(max_workers=settings.concurrency) as pool:
        futures = [pool.submit(write_document, p, client, count_tokens, settings, progress) for p in plans]
        return [f.result() for f in futures]


def locate_facts(doc: GeneratedDoc) -> tuple[list[dict[str, Any]], list[str]]:
    """Facts the text verifiably contains (case-insensitive whole-word match), and those it lacks.

    A fact the model wrote in a section is located there (source 'generated'); a header fact
    that the model never repeated is located in the header (source 'header').
    """
    questions = vocabulary(doc.plan.domain)["facts"]
    kept, dropped = [], []
    for key, value in doc.plan.facts.items():
        # Whole words only: age "70" must not match inside "1970".
        pattern = re.compile(rf"(?<!\w){re.escape(value)}(?!\w)", re.IGNORECASE)
        hits = [m.start() for m in pattern.finditer(doc.text)]
        if not hits:
            dropped.append(key)
            continue
        body_at = next((h for h in hits if h >= doc.header_end), -1)
        at = body_at if body_at >= 0 else hits[0]
        section = next((s.name for s in doc.sections if s.start <= at < s.end), "header")
        kept.append({
            "doc_id": doc.plan.doc_id, "fact": key, "value": value,
            "question": questions[key]["question"], "char_start": at, "char_end": at + len(value),
            "section": section, "source": "generated" if body_at >= 0 else "header",
            "occurrences": len(hits),
        })
    return kept, dropped

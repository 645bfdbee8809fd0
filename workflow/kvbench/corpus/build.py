"""Corpus stage entry points: each builds one table from plain config values and paths."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import pandas as pd

from kvbench.corpus import imported, stats
from kvbench.corpus.factsheets import plan_documents
from kvbench.corpus.realistic import GenerationSettings, generate_corpus, locate_facts
from kvbench.corpus.synthetic import synthetic_corpus
from kvbench.vllm_server import vllm_server

DOC_COLUMNS = ["doc_id", "corpus", "domain", "doc_type", "title", "text", "chars"]


def build_synthetic(n_docs: int, words: int) -> pd.DataFrame:
    texts = synthetic_corpus(n_docs, words)
    return pd.DataFrame(
        {
            "doc_id": [f"synthetic-{i:04d}" for i in range(n_docs)],
            "corpus": "synthetic",
            "domain": "synthetic",
            "doc_type": "hi-hi-hi",
            "title": "",
            "text": texts,
            "chars": [len(t) for t in texts],
            "words": words,
        }
    )


def build_realistic(
    cfg: Mapping[str, Any],
    model_dir: str | Path,
    vllm_settings: Mapping[str, Any],
    seed: int,
    count_tokens: Callable[[str], int],
    vllm_log: str | Path,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Plan fact sheets, write every document through a real vLLM server, locate the facts."""
    plans = plan_documents(list(cfg["domains"]), int(cfg["docs_per_type"]), seed)
    settings = GenerationSettings(
        target_tokens=cfg["target_tokens"],
        section_tokens=cfg["section_tokens"],
        min_section_tokens=cfg["min_section_tokens"],
        temperature=cfg["temperature"],
        top_p=cfg["top_p"],
        repetition_penalty=cfg["repetition_penalty"],
        concurrency=cfg["concurrency"],
        chat_template_kwargs=dict(cfg["chat_template_kwargs"]),
    )
    start = time.monotonic()
    with vllm_server(model_dir, vllm_settings, seed, vllm_log) as client:
        docs = generate_corpus(plans, client, count_tokens, settings)
    print(f"[corpus] generated {len(docs)} documents in {time.monotonic() - start:.0f} s (incl. server start)")
    doc_rows, fact_rows = [], []
    for doc in docs:
        kept, dropped = locate_facts(doc)
        fact_rows += kept
        doc_rows.append(
            {
                "doc_id": doc.plan.doc_id,
                "corpus": "realistic",
                "domain": doc.plan.domain,
                "doc_type": doc.plan.doc_type,
                "title": doc.plan.title,
                "text": doc.text,
                "chars": len(doc.text),
                "target_tokens": settings.target_tokens,
                "generated_sections": len(doc.sections),
                "completion_tokens": sum(s.completion_tokens for s in doc.sections),
                "sections": json.dumps([[s.name, s.start, s.end] for s in doc.sections]),
                "fact_sheet": json.dumps(doc.plan.facts),
                "facts_planned": len(doc.plan.facts),
                "facts_kept": len(kept),
                "facts_dropped": json.dumps(dropped),
                "doc_seed": doc.plan.seed,
            }
        )
        print(f"[corpus] {doc.plan.doc_id}: {doc.tokens} tokens, facts kept {len(kept)}/{len(doc.plan.facts)}")
    facts = pd.DataFrame(
        fact_rows,
        columns=[
            "doc_id",
            "fact",
            "value",
            "question",
            "char_start",
            "char_end",
            "section",
            "source",
            "occurrences",
            "unambiguous",
            "ambiguity",
        ],
    )
    return pd.DataFrame(doc_rows), facts


def build_imported(path: str, domain: str) -> pd.DataFrame:
    frame = imported.read_folder(path, domain)
    frame["corpus"] = "imported"
    frame["title"] = ""
    frame["chars"] = frame["text"].str.len()
    return frame


def build_stats(
    doc_tables: list[pd.DataFrame], encode: Callable[[str], list[int]]
) -> tuple[pd.DataFrame, pd.DataFrame]:
    return stats.corpus_stats(pd.concat([t[DOC_COLUMNS] for t in doc_tables], ignore_index=True), encode)

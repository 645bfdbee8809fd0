"""Prompts shared by the system and quality stages: a document plus a question with a known answer.

Realistic documents ask about a fact the text verifiably contains (preferring one the model
wrote); synthetic documents ask for their leading number, the only fact they hold. Documents are
truncated in the middle to fit the context (as LongBench does), keeping the question intact.
"""

from __future__ import annotations

from typing import Any, Callable

import pandas as pd

SYNTHETIC_QUESTION = "What number does the document begin with?"


def middle_truncate(ids: list[int], budget: int) -> list[int]:
    if len(ids) <= budget:
        return ids
    head = budget // 2
    return ids[:head] + ids[len(ids) - (budget - head) :]


def chat_ids(tokenizer: Any, content: str) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def question_for(doc: Any, facts: pd.DataFrame | None) -> tuple[str, str]:
    if doc.corpus == "synthetic":
        return SYNTHETIC_QUESTION, doc.text.split(" ", 1)[0]
    mine = facts[facts.doc_id == doc.doc_id] if facts is not None else pd.DataFrame()
    if mine.empty:
        raise ValueError(f"document {doc.doc_id} has no verified fact to ask about")
    fact = mine.sort_values(["source", "char_start"]).iloc[0]  # "generated" sorts before "header"
    return str(fact.question), str(fact.value)


def build_prompts(
    docs: pd.DataFrame,
    facts: pd.DataFrame | None,
    tokenizer: Any,
    n_docs: int,
    context_tokens: int,
    pick: Callable[[pd.DataFrame, int], pd.DataFrame],
) -> list[dict[str, Any]]:
    """Up to `n_docs` prompts of at most `context_tokens` tokens (chat template applied)."""
    prompts = []
    for doc in pick(docs, n_docs).itertuples(index=False):
        question, answer = question_for(doc, facts)
        suffix = f"\n\nQuestion: {question}\nAnswer in a few words."
        doc_ids = tokenizer(doc.text, add_special_tokens=False).input_ids
        budget = context_tokens - len(chat_ids(tokenizer, suffix))
        # Re-tokenizing a decoded cut can shift a few tokens: shrink until the prompt fits.
        while True:
            ids = chat_ids(tokenizer, tokenizer.decode(middle_truncate(doc_ids, budget)) + suffix)
            if len(ids) <= context_tokens or budget <= 0:
                break
            budget -= len(ids) - context_tokens
        prompts.append(
            {
                "prompt_id": f"{doc.doc_id}@{context_tokens}",
                "corpus": doc.corpus,
                "domain": doc.domain,
                "doc_id": doc.doc_id,
                "question": question,
                "answer": answer,
                "target_context": context_tokens,
                "input_ids": ids,
            }
        )
    return prompts

"""Documents of one token length for every corpus: realistic ones joined or truncated to it,
synthetic ones ("hi hi hi") truncated, so the corpora differ in content only."""

from __future__ import annotations

from typing import Callable

import pandas as pd

from kvbench.kv.study import pick_documents


def exact_length(text: str, tokens: int, encode: Callable[[str], list[int]], decode: Callable[[list[int]], str]) -> str:
    """`text` cut to a prefix that encodes to exactly `tokens` tokens (decoding a token prefix can
    re-encode to a different count, so adjust until it does not), or a slightly shorter prefix
    ended by a separator where no prefix has that length."""
    ids = encode(text)
    if len(ids) < tokens:
        raise ValueError(f"text has {len(ids)} tokens, fewer than {tokens}")
    cut = tokens
    for _ in range(16):
        out = decode(ids[:cut])
        n = len(encode(out))
        if n == tokens:
            return out
        cut += tokens - n
    # two tokens at the cut that re-encode as one leave no prefix of that length: end a shorter
    # prefix with a separator instead
    for cut in range(tokens - 1, max(0, tokens - 8), -1):
        for end in ("\n", " ", ".", "\n\n"):
            out = decode(ids[:cut]) + end
            if len(encode(out)) == tokens:
                return out
    raise ValueError(f"no prefix of the text encodes to exactly {tokens} tokens")


def serve_documents(
    docs: pd.DataFrame, n: int, tokens: int, encode: Callable[[str], list[int]], decode: Callable[[list[int]], str]
) -> dict[str, str]:
    """`n` documents of exactly `tokens` tokens, picked round-robin over domains and doc types;
    a document that is too short is joined with the next ones (in doc_id order, cyclically)."""
    ordered = docs.sort_values("doc_id").reset_index(drop=True)
    total = sum(len(encode(t)) for t in ordered.text)
    if total < tokens:
        raise ValueError(f"corpus {docs.corpus.iloc[0]!r} has {total} tokens in all; serve.doc_tokens is {tokens}")
    chosen = pick_documents(docs, n)
    if len(chosen) < n:
        raise ValueError(f"corpus {docs.corpus.iloc[0]!r} has {len(chosen)} documents; serve.docs_per_corpus is {n}")
    out = {}
    for doc in chosen.itertuples(index=False):
        start = int(ordered.index[ordered.doc_id == doc.doc_id][0])
        text, i = doc.text, start
        while len(encode(text)) < tokens:
            i = (i + 1) % len(ordered)
            text += "\n\n" + ordered.text[i]
        out[doc.doc_id] = exact_length(text, tokens, encode, decode)
    return out


def serve_prompts(
    doc_tables: dict[str, pd.DataFrame],
    n: int,
    tokens: int,
    question: str,
    encode: Callable[[str], list[int]],
    decode: Callable[[list[int]], str],
) -> dict[str, dict[str, str]]:
    """Per corpus, `n` prompts: a document of exactly `tokens` tokens followed by the question."""
    return {
        corpus: {doc: text + question for doc, text in serve_documents(docs, n, tokens, encode, decode).items()}
        for corpus, docs in doc_tables.items()
    }

"""Realistic and synthetic documents served at exactly one token length."""

import pandas as pd
import pytest

from kvbench.corpus.synthetic import synthetic_corpus
from kvbench.serve.documents import exact_length, serve_documents


def docs(texts, corpus):
    return pd.DataFrame(
        {
            "doc_id": [f"{corpus}-{i}" for i in range(len(texts))],
            "corpus": corpus,
            "domain": "d",
            "doc_type": "t",
            "text": texts,
        }
    )


def test_documents_have_exactly_the_target_length(tokenizer):
    encode = lambda t: tokenizer(t, add_special_tokens=False).input_ids  # noqa: E731
    decode = lambda ids: tokenizer.decode(ids)  # noqa: E731
    realistic = docs(
        [
            "The patient, a 54-year-old woman, was admitted with chest pain. " * 3,
            "This agreement is made between Acme Corp. and the Licensee, effective 1 March. " * 20,
        ],
        "realistic",
    )
    synthetic = docs(synthetic_corpus(2, 300), "synthetic")
    for table in (realistic, synthetic):
        out = serve_documents(table, 2, 200, encode, decode)
        assert len(out) == 2
        assert all(len(encode(text)) == 200 for text in out.values())
    # the short first document was joined with the next one
    short = serve_documents(realistic, 2, 200, encode, decode)["realistic-0"]
    assert short.startswith("The patient") and "Acme" in short


def test_a_corpus_too_small_is_a_clear_error(tokenizer):
    encode = lambda t: tokenizer(t).input_ids  # noqa: E731
    with pytest.raises(ValueError, match="has .* tokens in all; serve.doc_tokens is 5000"):
        serve_documents(docs(["short text"], "realistic"), 1, 5000, encode, tokenizer.decode)
    with pytest.raises(ValueError, match="has 1 documents; serve.docs_per_corpus is 2"):
        serve_documents(docs(["word " * 50], "realistic"), 2, 10, encode, tokenizer.decode)


def test_a_cut_between_tokens_that_merge_still_gets_the_exact_length(tokenizer):
    """In context "\\n" "\\n" are two tokens; a prefix ending between them re-encodes as one "\\n\\n":
    no prefix of the text has that length, so a shorter one ends with a separator instead."""
    encode = lambda t: tokenizer(t, add_special_tokens=False).input_ids  # noqa: E731
    text = "The parties can create a non-disclosure agreement.\n\nThe purpose of this agreement is"
    ids = encode(text)
    pieces = [tokenizer.decode([i]) for i in ids]
    target = pieces.index("\n") + 2  # through the second "\n"
    assert pieces[target - 1] == "\n" and len(encode(tokenizer.decode(ids[:target]))) != target
    out = exact_length(text, target, encode, tokenizer.decode)
    assert len(encode(out)) == target and out.startswith("The parties can create a non-disclosure agreement.")

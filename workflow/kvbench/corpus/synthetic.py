"""The control corpus: LMCache's / vLLM's long-document benchmark formula, byte for byte."""

from __future__ import annotations


def synthetic_document(i: int, words: int) -> str:
    return str(i) + " " + " ".join(["hi"] * words)


def synthetic_corpus(n_docs: int, words: int) -> list[str]:
    return [synthetic_document(i, words) for i in range(n_docs)]

"""Importing this module registers every task builder (one module per task)."""

from kvbench.quality.tasks import few_shot, longbench, multi_doc_qa, retrieval, single_doc_qa, summarization  # noqa: F401

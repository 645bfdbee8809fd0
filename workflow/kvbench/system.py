"""Stage `system`: every method through the one harness on the same prompts."""

from __future__ import annotations

import sys
import time
from typing import Any

import pandas as pd
import torch

from kvbench.harness import run_row
from kvbench.kv.study import pick_documents
from kvbench.prompts import build_prompts


def system_prompts(
    doc_tables: dict[str, pd.DataFrame], facts: pd.DataFrame | None, tokenizer: Any, cfg: dict[str, Any],
) -> list[dict[str, Any]]:
    prompts = []
    for corpus, n_docs in cfg["prompts_per_corpus"].items():
        for context in cfg["context_tokens"]:
            prompts += build_prompts(doc_tables[corpus], facts, tokenizer, n_docs, context, pick_documents)
    return prompts


def run_method(
    model: torch.nn.Module, method: str, spec: dict[str, Any], prompts: list[dict[str, Any]],
    cfg: dict[str, Any], seed: int,
) -> pd.DataFrame:
    rows = []
    max_context = int(model.config.max_position_embeddings)
    for i, prompt in enumerate(prompts, start=1):
        start = time.monotonic()
        row = run_row(model, method, spec, prompt["input_ids"], cfg["max_new_tokens"], cfg["repeats"], seed,
                      max_context)
        row |= {k: prompt[k] for k in ("prompt_id", "corpus", "domain", "doc_id", "question", "answer", "target_context")}
        rows.append(row)
        status = row["error"] or f"TTFT {row['ttft_s']:.2f} s, ratio {row['ratio_end']:.2f}x"
        print(f"[system] {method} {i}/{len(prompts)} {prompt['prompt_id']}: {status} "
              f"({time.monotonic() - start:.0f} s)", file=sys.stderr, flush=True)
    return pd.DataFrame(rows)

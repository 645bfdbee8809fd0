"""Stage `system`: every method through the one harness on the same prompts, timed in one process.

A job runs its methods interleaved: each round visits every prompt, and for each prompt every
method in turn, the order rotated from one visit to the next, so slow drift of the machine (thermal,
other load) lands on every method alike and cancels in a method's ratio to the baseline measured
next to it (`runs`: one row per run; pairs share model, prompt and repeat). One excluded warm-up per
method and prompt length precedes the timed rounds. A method that raises on a prompt records that
run with its error; the others go on.
"""

from __future__ import annotations

import gc
import sys
import time
import traceback
from typing import Any, Mapping

import pandas as pd
import torch

from kvbench.harness import TIMINGS, context_bucket, generate, median_and_std, peak_memory_mb, reset_peak_memory
from kvbench.kv.study import pick_documents
from kvbench.prompts import build_prompts

PROMPT_COLUMNS = ("prompt_id", "corpus", "domain", "doc_id", "question", "answer", "target_context")
MEASURED = (
    "new_tokens",
    "kv_bytes_prefill",
    "kv_bytes_end",
    "full16_bytes_prefill",
    "full16_bytes_end",
    "ratio_prefill",
    "ratio_end",
)


def system_prompts(
    doc_tables: dict[str, pd.DataFrame],
    facts: pd.DataFrame | None,
    tokenizer: Any,
    cfg: Mapping[str, Any],
) -> list[dict[str, Any]]:
    prompts = []
    for corpus, n_docs in cfg["prompts_per_corpus"].items():
        for context in cfg["context_tokens"]:
            prompts += build_prompts(doc_tables[corpus], facts, tokenizer, n_docs, context, pick_documents)
    return prompts


def schedule(methods: list[str], prompts: int, repeats: int) -> list[tuple[int, int, str]]:
    """(repeat, prompt, method) in run order: rounds over prompts, all methods per prompt, the
    method order rotated by one at every visit (so no method is always first or last)."""
    order, visit = [], 0
    for repeat in range(repeats):
        for prompt in range(prompts):
            shift = visit % len(methods)
            order += [(repeat, prompt, m) for m in methods[shift:] + methods[:shift]]
            visit += 1
    return order


def run_job(
    model: torch.nn.Module,
    specs: Mapping[str, dict[str, Any]],
    prompts: list[dict[str, Any]],
    cfg: Mapping[str, Any],
    seed: int,
) -> pd.DataFrame:
    """One row per (repeat, prompt, method) run, in the order they ran."""
    device = next(model.parameters()).device
    max_context = int(model.config.max_position_embeddings)
    warmed: set[tuple[str, int]] = set()
    rows = []
    for index, (repeat, p, method) in enumerate(schedule(list(specs), len(prompts), int(cfg["repeats"]))):
        prompt, spec = prompts[p], specs[method]
        ids = prompt["input_ids"]
        row: dict[str, Any] = {
            "method": method,
            "kind": spec["kind"],
            "params": str(sorted(spec.items())),
            "repeat": repeat,
            "order": index,
            "context_tokens": len(ids),
            "bucket": context_bucket(len(ids), max_context),
            "error": None,
            **{k: prompt[k] for k in PROMPT_COLUMNS},
        }
        start = time.monotonic()
        try:
            if (method, len(ids)) not in warmed:  # excluded; long enough to pass the quantizers' windows
                generate(model, spec, ids[:256], 2, seed)
                warmed.add((method, len(ids)))
            gc.collect()
            baseline = reset_peak_memory(device)
            result = generate(model, spec, ids, int(cfg["max_new_tokens"]), seed)
            row |= {k: result[k] for k in (*MEASURED, *TIMINGS)} | {"output_ids": result["tokens"]}
            row["peak_memory_mb"] = peak_memory_mb(device)
            row["memory_increase_mb"] = row["peak_memory_mb"] - baseline if baseline is not None else None
        except Exception as err:  # an OOM or a method bug on this prompt: a row with the error
            traceback.print_exc()
            row["error"] = f"{type(err).__name__}: {err}"
            gc.collect()
        rows.append(row)
        status = row["error"] or f"TTFT {row['ttft_s']:.2f} s, TPOT {row['tpot_s'] or float('nan'):.3f} s"
        print(
            f"[system] run {index + 1} (repeat {repeat + 1}) {method} on {prompt['prompt_id']}: {status} "
            f"({time.monotonic() - start:.0f} s)",
            file=sys.stderr,
            flush=True,
        )
    return pd.DataFrame(rows)


def per_prompt(runs: pd.DataFrame) -> pd.DataFrame:
    """One row per model × method × prompt: the true median of each timing over its repeats and
    its sample standard deviation (`*_std`), the measured bytes (the same every repeat), the peak
    memory; a method that failed on any repeat keeps the first error."""
    rows = []
    keys = ["model", "method", "prompt_id"]
    for _, group in runs.groupby(keys, sort=False):
        first = group.iloc[0]
        row = {
            c: first[c]
            for c in runs.columns
            if c not in (*TIMINGS, "repeat", "order", "output_ids", "error", "peak_memory_mb", "memory_increase_mb")
        }
        ok = group[group.error.isna()]
        errors = group.error.dropna()
        row["error"] = errors.iloc[0] if len(errors) else None
        row["repeats"] = len(ok)
        if len(ok) and row["error"] is None:
            row["output_ids"] = ok.iloc[0]["output_ids"]
            for key in TIMINGS:
                values = [float(v) for v in ok[key] if v is not None and not pd.isna(v)]
                row[key], row[f"{key}_std"] = median_and_std(values) if values else (None, None)
            row["peak_memory_mb"] = float(ok["peak_memory_mb"].max())
            row["memory_increase_mb"] = float(ok["memory_increase_mb"].median())
        else:
            for key in (*MEASURED, "output_ids"):
                row[key] = None
        rows.append(row)
    return pd.DataFrame(rows)


def paired_ratios(runs: pd.DataFrame, baseline: str) -> pd.DataFrame:
    """Each run's TTFT and TPOT over the baseline's in the same round of the same process (model,
    job, prompt, repeat): every job runs its own baseline."""
    ok = runs[runs.error.isna()]
    ok = ok if "job" in ok else ok.assign(job="all")
    pair = ["model", "job", "prompt_id", "repeat"]
    base = ok[ok.method == baseline].set_index(pair)[["ttft_s", "tpot_s"]]
    paired = ok.join(base, on=pair, rsuffix="_baseline", how="inner")
    for key in ("ttft_s", "tpot_s"):
        paired[f"{key}_ratio"] = paired[key].astype(float) / paired[f"{key}_baseline"].astype(float)
    return paired[
        [
            "model",
            "job",
            "method",
            "kind",
            "prompt_id",
            "corpus",
            "repeat",
            "order",
            "ttft_s",
            "ttft_s_baseline",
            "ttft_s_ratio",
            "tpot_s",
            "tpot_s_baseline",
            "tpot_s_ratio",
        ]
    ].reset_index(drop=True)

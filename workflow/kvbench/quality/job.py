"""One quality job: load the model once, run several methods one after another over the task
folder, write one table. The job that starts with the reference method also stores the full
cache's references, which the methods after it (and every other job) are compared with.
Shared by the Snakemake rules and the CLI."""

from __future__ import annotations

import gc
import resource
import time
import traceback
from pathlib import Path
from typing import Any, Mapping, Sequence

import pandas as pd
import psutil
import torch

from kvbench.config import model_dir
from kvbench.harness import generate
from kvbench.models import load_model, load_tokenizer
from kvbench.provenance import provenance, write_table
from kvbench.quality.fidelity import load_references, save_references
from kvbench.quality.run import evaluate_method, max_prompt_tokens
from kvbench.quality.taskfiles import read_samples


def prime(model: Any, tokenizer: Any, samples: list[dict[str, Any]], cfg: Mapping[str, Any]) -> None:
    """One untimed full-cache pass over the longest prompt before any method: the first method
    (the reference) would otherwise be the only one timed in a process that never saw that length
    (allocator growth, one-off initialisations)."""
    if samples:
        longest = max((tokenizer(s["context"]).input_ids for s in samples), key=len)
        generate(model, {"kind": "full"}, longest[:max_prompt_tokens(cfg, model)], 2)


def failed_rows(method: str, spec: Mapping[str, Any], samples: list[dict[str, Any]], error: str) -> pd.DataFrame:
    """A row per built sample for a method that failed before its samples ran (lm-eval's own tasks
    have no manifest: they get no rows, and the job log has the traceback)."""
    return pd.DataFrame([{"method": method, "kind": spec["kind"], "params": str(sorted(spec.items())),
                          "task": s["task"], "longbench": s["longbench"], "category": s["category"],
                          "metric": s["metric"], "sample_id": s["sample_id"], "score": None, "error": error}
                         for s in samples])


def run_job(
    config: Mapping[str, Any], cfg: Mapping[str, Any], model_name: str, methods: Sequence[str],
    tasks_dir: str | Path, table_path: str | Path, references_in: str | Path | None = None,
    references_out: str | Path | None = None, threads: int | None = None,
) -> None:
    """`config`: the whole config (models, methods, seed, provenance); `cfg`: the quality settings.
    With `references_out`, the first method's continuations become the references (written there,
    then read back, so the methods after it compare with exactly what other jobs read)."""
    seed = int(config["seed"])
    if threads:
        torch.set_num_threads(threads)
    folder = model_dir(config, model_name)
    start = time.monotonic()
    tokenizer = load_tokenizer(folder)
    model = load_model(folder, "real", seed, getattr(torch, cfg["compute_dtype"]), cfg["device"])
    print(f"[quality] {model_name} loaded in {time.monotonic() - start:.1f} s")
    references = load_references(references_in) if references_in else None
    samples = read_samples(tasks_dir)
    prime(model, tokenizer, samples, cfg)
    tables = []
    for i, method in enumerate(methods, start=1):
        print(f"[quality] method {i}/{len(methods)}: {method}", flush=True)
        keep = references_out is not None and i == 1
        spec = config["methods"][method]
        began = time.monotonic()
        try:
            table, lm = evaluate_method(model, tokenizer, method, spec, tasks_dir, cfg, seed,
                                        references=None if keep else references, keep_references=keep)
        except Exception as err:  # the method as a whole failed: a row per sample, the job goes on
            if keep:
                raise  # without references no other method has fidelity: fail the job loudly
            traceback.print_exc()
            table, lm = failed_rows(method, spec, samples, f"{type(err).__name__}: {err}"), None
        if keep:
            save_references(lm.new_references, references_out)
            references = load_references(references_out)
        table["method_wall_s"] = time.monotonic() - began
        tables.append(table)
        del lm
        gc.collect()
    table = pd.concat(tables, ignore_index=True)
    # The whole job, from process start (imports included), against its forward passes.
    table["job_methods"] = ",".join(methods)
    table["job_wall_s"] = time.time() - psutil.Process().create_time()
    table["job_forward_s"] = float(table["forward_s"].fillna(0).sum()) if "forward_s" in table else 0.0
    usage = resource.getrusage(resource.RUSAGE_SELF)  # CPU seconds: what the job costs whatever else runs
    table["job_cpu_s"] = usage.ru_utime + usage.ru_stime
    failed = table["error"].notna().sum()
    print(f"[quality] {len(methods)} methods: {len(table)} rows, {failed} with an error; forward passes "
          f"{table['job_forward_s'].iloc[0]:.0f} s of {table['job_wall_s'].iloc[0]:.0f} s")
    write_table(table, table_path, provenance(config, model=model_name))

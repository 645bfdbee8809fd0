"""One quality job: load the model, run one method over the task folder, write its table (and, for
the reference method, the full cache's references). Shared by the Snakemake rule and the CLI."""

from __future__ import annotations

import resource
import time
from pathlib import Path
from typing import Any, Mapping

import psutil
import torch

from kvbench.config import model_dir
from kvbench.models import load_model, load_tokenizer
from kvbench.provenance import provenance, write_table
from kvbench.quality.fidelity import load_references, save_references
from kvbench.quality.run import evaluate_method


def run_job(
    config: Mapping[str, Any], cfg: Mapping[str, Any], model_name: str, method: str, tasks_dir: str | Path,
    table_path: str | Path, references_in: str | Path | None = None, references_out: str | Path | None = None,
    threads: int | None = None,
) -> None:
    """`config`: the whole config (models, methods, seed, provenance); `cfg`: the quality settings."""
    seed = int(config["seed"])
    if threads:
        torch.set_num_threads(threads)
    folder = model_dir(config, model_name)
    start = time.monotonic()
    tokenizer = load_tokenizer(folder)
    model = load_model(folder, "real", seed, getattr(torch, cfg["compute_dtype"]), cfg["device"])
    print(f"[quality] {model_name} loaded in {time.monotonic() - start:.1f} s")
    references = load_references(references_in) if references_in else None
    table, lm = evaluate_method(model, tokenizer, method, config["methods"][method], tasks_dir, cfg, seed,
                                references=references, keep_references=references_out is not None)
    if references_out is not None:
        save_references(lm.new_references, references_out)
    # The whole job, from process start (imports included), against its forward passes.
    table["job_wall_s"] = time.time() - psutil.Process().create_time()
    table["job_forward_s"] = float(table["forward_s"].fillna(0).sum()) if "forward_s" in table else 0.0
    usage = resource.getrusage(resource.RUSAGE_SELF)  # CPU seconds: what the job costs whatever else runs
    table["job_cpu_s"] = usage.ru_utime + usage.ru_stime
    failed = table["error"].notna().sum()
    print(f"[quality] {method}: {len(table)} rows, {failed} with an error; forward passes "
          f"{table['job_forward_s'].iloc[0]:.0f} s of {table['job_wall_s'].iloc[0]:.0f} s")
    write_table(table, table_path, provenance(config, model=model_name))

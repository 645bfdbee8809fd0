"""One quality job: load the model once, run its methods over the task folder under every protocol
(one shared prefill per sample), write one table. The job that runs the reference method also
stores the full cache's references, which every other job reads back. Shared by the Snakemake rules
and the CLI."""

from __future__ import annotations

import resource
import time
from pathlib import Path
from typing import Any, Mapping

import psutil
import torch

from kvbench.fidelity import load_references, save_references
from kvbench.models import load_model, load_tokenizer
from kvbench.provenance import write_table
from kvbench.quality.run import evaluate


def run_job(
    model_dir: str | Path,
    specs: Mapping[str, dict[str, Any]],
    cfg: Mapping[str, Any],
    seed: int,
    tasks_dir: str | Path,
    table_path: str | Path,
    provenance: Mapping[str, Any],
    *,
    reference: str | None = None,
    references_in: str | Path | None = None,
    references_out: str | Path | None = None,
    threads: int | None = None,
) -> None:
    """`specs`: this job's methods (name -> settings), the reference first where this job makes the
    references (`reference` names it; they are written to `references_out`); `cfg`: the quality
    settings; other jobs compare with `references_in`."""
    if threads:
        torch.set_num_threads(threads)
    start = time.monotonic()
    tokenizer = load_tokenizer(model_dir)
    model = load_model(model_dir, "real", seed, getattr(torch, cfg["compute_dtype"]), cfg["device"])
    print(f"[quality] {model_dir} loaded in {time.monotonic() - start:.1f} s", flush=True)
    references = load_references(references_in) if references_in else None
    table, lm = evaluate(
        model,
        tokenizer,
        specs,
        tasks_dir,
        cfg,
        seed,
        protocols=tuple(cfg["protocols"]),
        reference=reference if references_out else None,
        references=references,
    )
    if references_out is not None:
        if not lm.new_references:  # without references no other method has fidelity: fail loudly
            raise RuntimeError(f"the reference method {reference} failed on every sample (see the log)")
        save_references(lm.new_references, references_out)
    # The whole job, from process start (imports included), against its forward passes.
    table["job_methods"] = ",".join(specs)
    table["job_wall_s"] = time.time() - psutil.Process().create_time()
    table["job_forward_s"] = lm.cost.forward_s
    table["job_fork_s"] = lm.cost.fork_s
    table["job_decode_steps"], table["job_decode_row_steps"] = lm.cost.decode.steps, lm.cost.decode.row_steps
    usage = resource.getrusage(resource.RUSAGE_SELF)  # CPU seconds: what the job costs whatever else runs
    table["job_cpu_s"] = usage.ru_utime + usage.ru_stime
    failed = table["error"].notna().sum()
    print(
        f"[quality] {len(specs)} methods x {len(cfg['protocols'])} protocols: {len(table)} rows, {failed} with an "
        f"error; forward passes {lm.cost.forward_s:.0f} s of {table['job_wall_s'].iloc[0]:.0f} s",
        flush=True,
    )
    write_table(table, table_path, provenance)

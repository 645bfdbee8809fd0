"""Puts this checkout's library (`workflow/`) first on sys.path; every script imports it first.

Snakemake runs a script with its folder on sys.path but strips PYTHONPATH from jobs that use
`--use-conda`, and an installed kvbench may belong to another checkout: this makes the scripts
import the library they ship with, in any environment, with no install."""

import os
import sys
from pathlib import Path

# The job's parent (snakemake, or the jobstep), read before the heavy imports: if it dies while
# they run, kvbench.jobs.job_log still sees the change and ends the job (an orphan would race the
# rerun for its outputs).
os.environ["KVBENCH_JOB_PARENT"] = f"{os.getpid()}:{os.getppid()}"  # for this process only, not its children

LIBRARY = str(Path(__file__).resolve().parents[1])
if sys.path[:1] != [LIBRARY]:
    sys.path.insert(0, LIBRARY)

# Before torch, huggingface_hub, datasets and lm-eval are imported (they read these once): the hub
# cache, offline (kvbench.jobs.job_log sets the same and checks the cache), and the GPUs a job that
# asks for them (resources gpu) may use when no scheduler chose them (kvbench.gpu_env.assign_gpus).
_job = getattr(sys.modules["__main__"], "snakemake", None)
if _job is not None:
    from kvbench.gpu_env import assign_gpus
    from kvbench.hub import hub_env

    os.environ.update(hub_env(_job.config))
    assign_gpus(int(_job.resources.get("gpu", 0)), os.environ)

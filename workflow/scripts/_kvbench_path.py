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

# Point huggingface_hub, datasets and lm-eval at the hub cache and keep them offline before they
# are imported (they read these once); kvbench.jobs.job_log sets the same and checks the cache.
_job = getattr(sys.modules["__main__"], "snakemake", None)
if _job is not None:
    from kvbench.hub import hub_env

    os.environ.update(hub_env(_job.config))

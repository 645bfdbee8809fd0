"""Imported first by every workflow script: notes the job's parent before the heavy imports.

The job's parent is snakemake (or the SLURM jobstep). If it dies while torch and pandas still
import, kvbench.jobs.job_log must still see the change and end the job (an orphan would race the
rerun for its outputs): it compares against the parent noted here, at the job's first line."""

import os

# For this process only: a child that inherits the variable sees another pid and ignores it.
os.environ["KVBENCH_JOB_PARENT"] = f"{os.getpid()}:{os.getppid()}"

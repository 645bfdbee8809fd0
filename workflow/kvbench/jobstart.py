"""Imported first by every workflow script: notes the job's parent, the hub environment and the
job's GPUs before the heavy imports; a GPU job also drops a login node's CUDA toolkit from its
environment (re-executing itself when LD_LIBRARY_PATH changes: the loader read it at start) and
puts the compile caches on node-local scratch.

The job's parent is snakemake (or the SLURM jobstep). If it dies while torch and pandas still
import, kvbench.jobs.job_log must still see the change and end the job (an orphan would race the
rerun for its outputs): it compares against the parent noted here, at the job's first line."""

import os
import sys

# For this process only: a child that inherits the variable sees another pid and ignores it.
os.environ["KVBENCH_JOB_PARENT"] = f"{os.getpid()}:{os.getppid()}"

# Before torch, huggingface_hub, datasets and lm-eval are imported (they read these once): the hub
# cache, offline (kvbench.jobs.job_log sets the same and checks the cache), and the GPUs a job that
# asks for them (resources gpu) may use when no scheduler chose them (kvbench.gpu_env.assign_gpus).
_job = getattr(sys.modules["__main__"], "snakemake", None)
if _job is not None:
    from kvbench.gpu_env import assign_gpus
    from kvbench.hub import hub_env

    os.environ.update(hub_env(_job.config))
    # Jobs never download (the prefetch did): no hub token reaches them or the servers they start.
    for _secret in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        os.environ.pop(_secret, None)
    assign_gpus(int(_job.resources.get("gpu", 0)), os.environ)
    if int(_job.resources.get("gpu", 0)):
        from kvbench.gpu_env import node_local_caches, strip_login_cuda

        _env = dict(os.environ)
        _removed = strip_login_cuda(_env)
        _env.update(node_local_caches(_env))
        if _removed:  # job_log writes it into the rule's log
            _env["KVBENCH_STRIPPED_CUDA_ENV"] = "; ".join(_removed)
        _relink = _env.get("LD_LIBRARY_PATH") != os.environ.get("LD_LIBRARY_PATH")
        os.environ.clear()
        os.environ.update(_env)
        if _relink:  # same pid (the parent noted above still holds), a clean loader path
            os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])

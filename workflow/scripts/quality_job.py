import kvbench.jobstart  # noqa: F401 (first: notes the job's parent before the heavy imports)

from kvbench.jobs import job_log
from kvbench.quality.job import run_job

with job_log(snakemake.log[0], snakemake.config):
    references_out = snakemake.output.references if "references" in snakemake.output.keys() else None
    references_in = snakemake.input.references if "references" in snakemake.input.keys() else None
    run_job(snakemake.config, snakemake.params.cfg, snakemake.wildcards.model, snakemake.params.methods,
            snakemake.input.tasks, snakemake.output.table, references_in, references_out, snakemake.threads)

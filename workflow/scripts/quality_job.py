import kvbench.jobstart  # noqa: F401 (first: notes the job's parent before the heavy imports)

# isort: split
from kvbench.jobs import job_log
from kvbench.provenance import provenance
from kvbench.quality.job import run_job

with job_log(snakemake.log[0], snakemake.config):
    makes_references = "references" in snakemake.output.keys()
    run_job(
        snakemake.input.model,
        snakemake.params.specs,
        snakemake.params.cfg,
        snakemake.params.seed,
        snakemake.input.tasks,
        snakemake.output.table,
        provenance(snakemake.config, model=snakemake.wildcards.model),
        reference=snakemake.params.reference if makes_references else None,
        references_in=None if makes_references else snakemake.input.references,
        references_out=snakemake.output.references if makes_references else None,
        threads=snakemake.threads,
    )

import kvbench.jobstart  # noqa: F401 (first: notes the job's parent before the heavy imports)

# isort: split
from kvbench.jobs import job_log
from kvbench.provenance import provenance
from kvbench.quality.served import run_job
from kvbench.vllm_server import runtime_settings

with job_log(snakemake.log.main, snakemake.config):
    run_job(
        snakemake.input.model,
        snakemake.params.quality,
        {**snakemake.params.vllm, **runtime_settings(snakemake.config)},
        snakemake.input.tasks,
        snakemake.params.seed,
        {name: path for name, path in snakemake.log.items() if name != "main"},
        snakemake.output[0],
        provenance(snakemake.config, model=snakemake.wildcards.model),
    )

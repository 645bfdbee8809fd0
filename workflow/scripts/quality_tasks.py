import kvbench.jobstart  # noqa: F401 (first: notes the job's parent before the heavy imports)

# isort: split
import pandas as pd

from kvbench.jobs import job_log
from kvbench.quality.taskfiles import build_tasks, load_sources, text_tokenizer, write_tasks

with job_log(snakemake.log[0], snakemake.config):
    if not snakemake.params.tasks:  # lm-eval's own tasks only
        write_tasks([], snakemake.output[0])
    else:
        imported = pd.read_parquet(snakemake.input.imported) if "imported" in snakemake.input.keys() else None
        sources = load_sources(
            pd.read_parquet(snakemake.input.docs),
            pd.read_parquet(snakemake.input.facts),
            imported,
            text_tokenizer(snakemake.input.tokenizer),
        )
        write_tasks(build_tasks(snakemake.params.tasks, sources, snakemake.params.seed), snakemake.output[0])

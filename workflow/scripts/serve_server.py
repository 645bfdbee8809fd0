import kvbench.jobstart  # noqa: F401 (first: notes the job's parent before the heavy imports)

# isort: split
import pandas as pd

from kvbench.jobs import job_log
from kvbench.provenance import provenance, write_table
from kvbench.serve.stage import ServeSettings, serve_job
from kvbench.vllm_server import runtime_settings

with job_log(snakemake.log.main, snakemake.config):
    config, cfg = snakemake.config, snakemake.params.cfg
    settings = ServeSettings.of(cfg)
    docs = {corpus: pd.read_parquet(path) for corpus, path in zip(settings.corpora, snakemake.input.docs)}
    tables = serve_job(
        snakemake.wildcards.server,
        settings,
        docs,
        snakemake.params.methods,
        {**snakemake.params.vllm, **runtime_settings(config)},
        snakemake.input.model,
        snakemake.params.seed,
        {"vllm": snakemake.log.vllm, "valkey": snakemake.log.valkey},
    )
    prov = provenance(config, model=cfg["model"])
    for table, path in zip(tables, (snakemake.output.requests, snakemake.output.metrics, snakemake.output.transfers)):
        write_table(table, path, prov)

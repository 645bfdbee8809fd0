import kvbench.jobstart  # noqa: F401 (first: notes the job's parent before the heavy imports)

# isort: split
import pandas as pd
import torch

from kvbench.jobs import job_log
from kvbench.kv.study import kv_settings, run_study
from kvbench.models import load_model, load_tokenizer
from kvbench.provenance import provenance, write_table

with job_log(snakemake.log[0], snakemake.config):
    cfg, weights = snakemake.params.cfg, snakemake.wildcards.weights
    torch.set_num_threads(snakemake.threads)
    settings = kv_settings(cfg)
    # The seed param is None for real weights, which do not use it.
    model = load_model(
        snakemake.input.model, weights, snakemake.params.seed or 0, getattr(torch, cfg["compute_dtype"]), cfg["device"]
    )
    tokenizer = load_tokenizer(snakemake.input.model)
    tables = run_study(
        model, lambda text: tokenizer(text).input_ids, pd.read_parquet(snakemake.input.docs), settings, weights
    )
    prov = provenance(snakemake.config, model=cfg["model"])
    for table, path in zip(tables, (snakemake.output.whole, snakemake.output.layers, snakemake.output.chunks)):
        write_table(table, path, prov)

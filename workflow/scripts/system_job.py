import kvbench.jobstart  # noqa: F401 (first: notes the job's parent before the heavy imports)

# isort: split
import pandas as pd
import torch

from kvbench.jobs import job_log
from kvbench.models import load_model, load_tokenizer
from kvbench.provenance import provenance, write_table
from kvbench.system import run_job, system_prompts

with job_log(snakemake.log[0], snakemake.config):
    cfg, seed = snakemake.params.cfg, snakemake.params.seed
    torch.set_num_threads(snakemake.threads)
    tokenizer = load_tokenizer(snakemake.input.model)
    docs = {p.split("/")[-2]: pd.read_parquet(p) for p in snakemake.input.docs}
    prompts = system_prompts(docs, pd.read_parquet(snakemake.input.facts), tokenizer, cfg)
    model = load_model(snakemake.input.model, "real", seed, getattr(torch, cfg["compute_dtype"]), cfg["device"])
    table = run_job(model, snakemake.params.specs, prompts, cfg, seed)
    table.insert(0, "job", snakemake.wildcards.job)  # pairs runs with the baseline of the same process
    table["output_text"] = [tokenizer.decode(ids) if isinstance(ids, list) else None for ids in table["output_ids"]]
    write_table(table, snakemake.output[0], provenance(snakemake.config, model=snakemake.wildcards.model))

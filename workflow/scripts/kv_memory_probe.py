import kvbench.jobstart  # noqa: F401 (first: notes the job's parent before the heavy imports)

# isort: split
import pandas as pd
import torch

from kvbench.harness import peak_rss_mb
from kvbench.jobs import job_log
from kvbench.kv.study import kv_settings, long_document, run_study
from kvbench.models import load_model, load_tokenizer
from kvbench.provenance import provenance, write_table

with job_log(snakemake.log[0], snakemake.config):
    cfg, tokens = snakemake.params.cfg, snakemake.params.tokens
    torch.set_num_threads(snakemake.threads)
    tokenizer = load_tokenizer(snakemake.input.model)
    encode = lambda text: tokenizer(text).input_ids  # noqa: E731
    doc = long_document(pd.read_parquet(snakemake.input.docs), encode, tokens)
    model = load_model(
        snakemake.input.model, "real", snakemake.params.seed, getattr(torch, cfg["compute_dtype"]), cfg["device"]
    )
    settings = kv_settings(cfg, context_tokens=tokens, docs_per_corpus=1)
    whole, _, _ = run_study(model, encode, doc, settings, "real")
    whole["peak_rss_mb"] = peak_rss_mb()
    print(f"{int(whole.tokens.iloc[0])} tokens, peak RSS {whole.peak_rss_mb.iloc[0]:.0f} MB")
    write_table(whole, snakemake.output[0], provenance(snakemake.config, model=cfg["model"]))

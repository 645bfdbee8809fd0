import tempfile
from pathlib import Path

import pandas as pd

from kvbench.jobs import job_log
from kvbench.models import load_tokenizer
from kvbench.provenance import provenance, write_table
from kvbench.serve.documents import serve_prompts
from kvbench.serve.stage import ServeSettings, run_server

with job_log(snakemake.log.main, snakemake.config):
    config, cfg = snakemake.config, snakemake.params.cfg
    settings = ServeSettings.of(cfg)
    tokenizer = load_tokenizer(snakemake.input.model)
    docs = {corpus: pd.read_parquet(path) for corpus, path in zip(settings.corpora, snakemake.input.docs)}
    n = max(settings.docs_per_corpus, settings.reference_docs_per_corpus)
    prompts = serve_prompts(docs, n, settings.doc_tokens, settings.question,
                            lambda text: tokenizer(text, add_special_tokens=False).input_ids, tokenizer.decode)
    with tempfile.TemporaryDirectory(prefix="kvbench-serve-") as work:
        tables = run_server(snakemake.wildcards.server, settings, prompts, config["methods"], snakemake.params.vllm,
                            snakemake.input.model, config["seed"], Path(work),
                            {"vllm": snakemake.log.vllm, "valkey": snakemake.log.valkey})
    prov = provenance(config, model=cfg["model"])
    for table, path in zip(tables, (snakemake.output.requests, snakemake.output.metrics, snakemake.output.transfers)):
        write_table(table, path, prov)

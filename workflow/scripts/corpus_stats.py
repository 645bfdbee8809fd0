import kvbench.jobstart  # noqa: F401 (first: notes the job's parent before the heavy imports)

# isort: split
import pandas as pd

from kvbench.corpus.build import build_stats
from kvbench.jobs import job_log
from kvbench.models import load_tokenizer
from kvbench.plots import diversity_figure
from kvbench.provenance import provenance, write_table

with job_log(snakemake.log[0], snakemake.config):
    tokenizer = load_tokenizer(snakemake.input.tokenizer)
    per_doc, summary = build_stats(
        [pd.read_parquet(p) for p in snakemake.input.docs],
        lambda text: tokenizer(text, add_special_tokens=False).input_ids,
    )
    print(summary.drop(columns="reference_note").to_string(index=False))
    prov = provenance(snakemake.config, model=snakemake.params.tokenizer_model)
    write_table(per_doc, snakemake.output.stats, prov)
    write_table(summary, snakemake.output.summary, prov)
    diversity_figure(per_doc, summary, snakemake.output.figure)

import kvbench.jobstart  # noqa: F401 (first: notes the job's parent before the heavy imports)

# isort: split
from kvbench.corpus.build import build_imported
from kvbench.jobs import job_log
from kvbench.provenance import provenance, write_table

with job_log(snakemake.log[0], snakemake.config):
    cfg = snakemake.params.cfg
    docs = build_imported(cfg["path"], cfg["domain"])
    print(f"imported {len(docs)} documents from {cfg['path']}")
    write_table(docs, snakemake.output.docs, provenance(snakemake.config, model="none"))

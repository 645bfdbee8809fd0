import kvbench.jobstart  # noqa: F401 (first: notes the job's parent before the heavy imports)

# isort: split
from kvbench.corpus.build import build_synthetic
from kvbench.jobs import job_log
from kvbench.provenance import provenance, write_table

with job_log(snakemake.log[0], snakemake.config):
    cfg = snakemake.params.cfg
    docs = build_synthetic(cfg["n_docs"], cfg["words"])
    print(f"{len(docs)} synthetic documents of {cfg['words']} words")
    write_table(docs, snakemake.output.docs, provenance(snakemake.config, model="none"))

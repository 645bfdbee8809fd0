import kvbench.jobstart  # noqa: F401 (first: notes the job's parent before the heavy imports)

# isort: split
from kvbench.jobs import job_log
from kvbench.plots import quality_fidelity_figure, quality_ratio_figure, quality_score_figure
from kvbench.provenance import provenance, read_tables, write_table
from kvbench.quality.summary import summarize

with job_log(snakemake.log[0], snakemake.config):
    tables = summarize(read_tables(snakemake.input), snakemake.params.reference)
    prov = provenance(snakemake.config, model=snakemake.wildcards.model)
    for name in ("scores", "fidelity", "summary", "jobs"):
        write_table(tables[name], snakemake.output[name], prov)
    quality_score_figure(tables["summary"], snakemake.params.reference, snakemake.output.score_figure)
    quality_fidelity_figure(tables["summary"], snakemake.output.fidelity_figure)
    quality_ratio_figure(tables["summary"], snakemake.params.reference, snakemake.output.ratio_figure)

import kvbench.jobstart  # noqa: F401 (first: notes the job's parent before the heavy imports)

# isort: split
import os

from kvbench.atomic import atomic_path
from kvbench.jobs import job_log
from kvbench.provenance import provenance, write_table
from kvbench.report import build as rb
from kvbench.report.contracts import CONTRACTS, load_tables
from kvbench.report.costs import pipeline_cost, read_benchmarks
from kvbench.report.figures import correlation_figure, frontier_figure, tradeoff_figure


def write(table, path, prov):
    write_table(table, path, rb.table_provenance(table, prov))


def write_text(path, text):
    with atomic_path(path) as tmp:
        tmp.write_text(text)


with job_log(snakemake.log[0], snakemake.config):
    cfg, out = snakemake.params.cfg, snakemake.output
    tables = load_tables({name: snakemake.input.get(name) for name in CONTRACTS})
    report = rb.build(tables, cfg, snakemake.params.methods, snakemake.params.seed, snakemake.params.harness)
    costs = pipeline_cost(read_benchmarks(os.getcwd(), snakemake.params.benchmarks))
    print(report.stages.to_string(index=False))
    print(report.claims[["claim_id", "model", "protocol", "verdict", "ours"]].to_string(index=False))
    print(
        report.recommendations[["scenario", "model", "protocol", "category", "bucket", "best", "why"]].to_string(
            index=False
        )
    )
    prov = provenance(snakemake.config, model=",".join(sorted(set(report.methods.model))) or "-")
    for name in rb.TABLES:
        write(getattr(report, name), out[name], prov)
    write(costs, out.costs, prov)
    write_text(out.overview_html, rb.overview_page(report))
    write_text(out.claims_html, rb.claims_page(report))
    write_text(out.recommendations_html, rb.recommendations_page(report, cfg["baseline"]))
    write_text(out.correlations_html, rb.correlations_page(report))
    write_text(out.differences_html, rb.differences_page(report))
    write_text(out.power_html, rb.power_page(report))
    write_text(out.engine_html, rb.engine_page(report))
    write_text(out.costs_html, rb.costs_page(costs))
    correlation_figure(report.correlations, out.correlation_png, out.correlation_svg)
    tradeoff_figure(report.methods, cfg["baseline"], out.tradeoff_png, out.tradeoff_svg, snakemake.params.methods)
    frontier_figure(report.differences, snakemake.params.methods, out.frontier_png, out.frontier_svg)

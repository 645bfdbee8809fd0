import kvbench.jobstart  # noqa: F401 (first: notes the job's parent before the heavy imports)

# isort: split
from kvbench.jobs import job_log
from kvbench.plots import system_figure
from kvbench.provenance import provenance, read_tables, write_table
from kvbench.system import paired_ratios, per_prompt

with job_log(snakemake.log[0], snakemake.config):
    runs = read_tables(snakemake.input, keep=("model",))  # one job per model (x group of methods)
    metrics = per_prompt(runs)
    paired = paired_ratios(runs, snakemake.params.baseline)
    columns = ["ttft_s", "tpot_s", "kv_bytes_end", "ratio_end", "memory_increase_mb"]
    ok = metrics[metrics.error.isna()]
    print(ok.groupby(["model", "method", "bucket"])[columns].median().to_string(float_format="%.3f"))
    print(paired.groupby(["model", "method"])[["ttft_s_ratio", "tpot_s_ratio"]].median().to_string(float_format="%.3f"))
    failed = runs[runs.error.notna()]
    print(
        f"{len(failed)} failed runs"
        + (":\n" + failed[["model", "method", "prompt_id", "error"]].to_string() if len(failed) else "")
    )
    prov = provenance(snakemake.config, model=None)
    write_table(metrics, snakemake.output.metrics, prov)
    write_table(runs, snakemake.output.runs, prov)
    write_table(paired, snakemake.output.paired, prov)
    system_figure(metrics, snakemake.output.figure)

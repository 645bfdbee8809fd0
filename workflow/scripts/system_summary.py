import kvbench.jobstart  # noqa: F401 (first: notes the job's parent before the heavy imports)

from kvbench.jobs import job_log
from kvbench.plots import system_figure
from kvbench.provenance import provenance, read_tables, write_table

with job_log(snakemake.log[0], snakemake.config):
    table = read_tables(snakemake.input, keep=("model",))  # one job per model x method
    columns = ["ttft_s", "tpot_s", "kv_bytes_end", "ratio_end", "memory_increase_mb"]
    ok = table[table.error.isna()]
    print(ok.groupby(["model", "method", "bucket"])[columns].median().to_string(float_format="%.3f"))
    failed = table[table.error.notna()]
    print(f"{len(failed)} failed rows" + (":\n" + failed[["model", "method", "prompt_id", "error"]].to_string() if len(failed) else ""))
    write_table(table, snakemake.output.metrics, provenance(snakemake.config, model=None))
    system_figure(table, snakemake.output.figure)

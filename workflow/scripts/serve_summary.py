import kvbench.jobstart  # noqa: F401 (first: notes the job's parent before the heavy imports)

# isort: split
import pandas as pd

from kvbench.jobs import job_log
from kvbench.provenance import provenance, read_tables, write_table
from kvbench.serve.figures import hit_path_figure, ttft_figure, wire_figure
from kvbench.serve.recommend import recommend
from kvbench.serve.summary import compare_outputs, engine_table, join_transfers, load_table, offload_table, summary_text

with job_log(snakemake.log[0], snakemake.config):
    config, cfg, inputs, out = snakemake.config, snakemake.params.cfg, snakemake.input, snakemake.output
    seed = snakemake.params.seed
    transfers = read_tables(inputs.transfers)
    metrics = read_tables(inputs.metrics)
    requests = compare_outputs(join_transfers(read_tables(inputs.requests), transfers))
    kv = pd.read_parquet(inputs.kv)
    offload = offload_table(requests, transfers, metrics, kv, seed, cfg["overhead_budget"])
    load = load_table(requests, metrics, seed)
    engine = engine_table(offload, requests, transfers, kv, seed)
    recommendations, candidates = recommend(
        requests, offload, snakemake.params.scenarios, cfg["load"]["corpora"], cfg["block_size"], seed, engine
    )
    print(summary_text(offload, metrics))
    print(recommendations[["scenario", "concurrency", "rate_rps", "best", "why"]].to_string())
    prov = provenance(config, model=cfg["model"])
    for table, path in (
        (requests, out.requests),
        (offload, out.offload),
        (metrics, out.metrics),
        (transfers, out.transfers),
        (load, out.load),
        (engine, out.engine),
        (recommendations, out.recommendations),
        (candidates, out.candidates),
    ):
        write_table(table, path, prov)
    real = offload[offload.weights == "real"]  # the figures: real weights (dummy's are in engine.parquet)
    ttft_figure(real, out.ttft_figure)
    wire_figure(real, out.wire_figure)
    hit_path_figure(real, out.hit_path_figure)

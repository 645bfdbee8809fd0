import kvbench.jobstart  # noqa: F401 (first: notes the job's parent before the heavy imports)

# isort: split
from kvbench.jobs import job_log
from kvbench.kv.summary import claim_text, inflation_factors, pooled_ratios
from kvbench.plots import kv_chunk_figure, kv_layer_figure, kv_ratio_figure
from kvbench.provenance import provenance, read_tables, write_table

with job_log(snakemake.log[0], snakemake.config):
    cfg = snakemake.params.cfg
    inputs = snakemake.input
    whole, layers, chunks = read_tables(inputs.whole), read_tables(inputs.layers), read_tables(inputs.chunks)
    factors = inflation_factors(whole, layers)
    failed = whole[whole.error.notna()]
    print(f"{len(whole)} rows, {len(failed)} with an error")
    for dtype in cfg["dtypes"]:
        print(claim_text(factors, dtype, cfg["figure_codec"]))
    prov = provenance(snakemake.config, model=cfg["model"])
    for table, path in (
        (whole, snakemake.output.whole),
        (layers, snakemake.output.layers),
        (chunks, snakemake.output.chunks),
        (factors, snakemake.output.summary),
    ):
        write_table(table, path, prov)
    detail_dtype, codec = cfg["detail_dtypes"][0], cfg["detail_codecs"][0]
    kv_ratio_figure(pooled_ratios(whole), cfg["figure_codec"], snakemake.output.ratio_figure)
    kv_layer_figure(layers, detail_dtype, codec, snakemake.output.layer_figure)
    kv_chunk_figure(chunks, detail_dtype, codec, snakemake.output.chunk_figure)

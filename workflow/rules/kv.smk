# What a capture's tables depend on: not the corpus and weights lists (wildcards) nor the summary's figure codec.
KV_RUN = {k: v for k, v in config["kv"].items() if k not in ("corpora", "weights", "figure_codec")}


rule kv_capture:
    input:
        docs="results/corpus/{corpus}/docs.parquet",
        model=model_dir(config["kv"]["model"]),
    output:
        whole="results/kv/{corpus}/{weights}/compressibility.parquet",
        layers="results/kv/{corpus}/{weights}/layers.parquet",
        chunks="results/kv/{corpus}/{weights}/chunks.parquet",
    params:
        cfg=KV_RUN,
        # Real weights ignore the seed: changing it reruns only the random and dummy variants.
        seed=lambda wc: None if wc.weights == "real" else config["seed"],
        code=library_code("kv_capture.py"),
    threads: 1
    resources:
        **device_resources("kv_capture"),
    log:
        "logs/kv/{corpus}.{weights}.log",
    benchmark:
        "benchmarks/kv/{corpus}.{weights}.tsv"
    conda:
        CONDA_ENV
    script:
        "../scripts/kv_capture.py"


rule kv_summary:
    input:
        whole=kv_parts("compressibility"),
        layers=kv_parts("layers"),
        chunks=kv_parts("chunks"),
    output:
        whole=report(
            "results/kv/compressibility.parquet",
            caption="../report/kv_tables.rst",
            category="KV compressibility",
        ),
        layers="results/kv/layers.parquet",
        chunks="results/kv/chunks.parquet",
        summary=report(
            "results/kv/summary.parquet",
            caption="../report/kv_summary.rst",
            category="KV compressibility",
        ),
        ratio_figure=report(
            "results/kv/ratio_by_corpus_weights.png",
            caption="../report/kv_ratio.rst",
            category="KV compressibility",
        ),
        layer_figure=report(
            "results/kv/layer_ratios.png",
            caption="../report/kv_layers.rst",
            category="KV compressibility",
        ),
        chunk_figure=report(
            "results/kv/chunk_ratios.png",
            caption="../report/kv_chunks.rst",
            category="KV compressibility",
        ),
    params:
        cfg=config["kv"],
        code=library_code("kv_summary.py"),
    log:
        "logs/kv/summary.log",
    benchmark:
        "benchmarks/kv/summary.tsv"
    conda:
        CONDA_ENV
    script:
        "../scripts/kv_summary.py"


# Not part of `all`: the memory bound for one long document (`make bench-core`, bench/README.md).
rule kv_memory_probe:
    input:
        docs="results/corpus/realistic/docs.parquet",
        model=model_dir(config["kv"]["model"]),
    output:
        "results/kv/memory_probe.parquet",
    params:
        cfg=KV_RUN,
        tokens=8192,
        seed=config["seed"],
        code=library_code("kv_memory_probe.py"),
    resources:
        **device_resources("kv_memory_probe"),
    log:
        "logs/kv/memory_probe.log",
    benchmark:
        "benchmarks/kv/memory_probe.tsv"
    conda:
        CONDA_ENV
    script:
        "../scripts/kv_memory_probe.py"

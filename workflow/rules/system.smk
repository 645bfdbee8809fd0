rule system_method:
    input:
        docs=expand("results/corpus/{corpus}/docs.parquet", corpus=list(config["system"]["prompts_per_corpus"])),
        facts="results/corpus/realistic/facts.parquet",
        model=model_dir(config["system"]["model"]),
    output:
        "results/system/methods/{method}.parquet",
    params:
        cfg=config["system"],
        spec=lambda wc: config["methods"][wc.method],
    # The whole machine per job: timings of different methods are taken under the same load.
    threads: MACHINE_THREADS
    log:
        "logs/system/{method}.log",
    benchmark:
        "benchmarks/system/{method}.tsv"
    conda:
        CONDA_ENV
    script:
        "../scripts/system_method.py"


rule system_summary:
    input:
        expand("results/system/methods/{method}.parquet", method=SYSTEM_METHODS),
    output:
        metrics=report(
            "results/system/metrics.parquet",
            caption="../report/system_metrics.rst",
            category="System",
        ),
        figure=report(
            "results/system/methods.png",
            caption="../report/system_figure.rst",
            category="System",
        ),
    log:
        "logs/system/summary.log",
    benchmark:
        "benchmarks/system/summary.tsv"
    conda:
        CONDA_ENV
    script:
        "../scripts/system_summary.py"

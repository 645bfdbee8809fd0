rule system_method:
    input:
        docs=expand("results/corpus/{corpus}/docs.parquet", corpus=list(config["system"]["prompts_per_corpus"])),
        facts="results/corpus/realistic/facts.parquet",
        model=lambda wc: model_dir(wc.model),
    output:
        "results/system/{model}/{method}.parquet",
    params:
        # What a method's rows depend on: not the lists of methods and models (adding one reruns no other).
        cfg={k: v for k, v in config["system"].items() if k not in ("methods", "models")},
        spec=lambda wc: config["methods"][wc.method],
        seed=config["seed"],
        code=library_code("system_method.py"),
    # The whole machine per job: timings of different methods are taken under the same load.
    threads: MACHINE_THREADS
    resources:
        gpu=GPUS["system"],
    log:
        "logs/system/{model}/{method}.log",
    benchmark:
        "benchmarks/system/{model}/{method}.tsv"
    conda:
        CONDA_ENV
    script:
        "../scripts/system_method.py"


rule system_summary:
    input:
        system_parts(),
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
    params:
        code=library_code("system_summary.py"),
    log:
        "logs/system/summary.log",
    benchmark:
        "benchmarks/system/summary.tsv"
    conda:
        CONDA_ENV
    script:
        "../scripts/system_summary.py"

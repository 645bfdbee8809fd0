rule corpus_synthetic:
    output:
        docs="results/corpus/synthetic/docs.parquet",
    params:
        cfg=config["corpus"]["synthetic"],
        code=library_code("corpus_synthetic.py"),
    log:
        "logs/corpus/synthetic.log",
    benchmark:
        "benchmarks/corpus/synthetic.tsv"
    conda:
        CONDA_ENV
    script:
        "../scripts/corpus_synthetic.py"


rule corpus_realistic:
    input:
        model=model_dir(config["corpus"]["generator"]),
    output:
        docs="results/corpus/realistic/docs.parquet",
        facts="results/corpus/realistic/facts.parquet",
    params:
        cfg=config["corpus"]["realistic"],
        generator=config["corpus"]["generator"],
        vllm=VLLM_RUN,  # with the runtime settings (port, timeouts) the script reads from the config
        seed=config["seed"],
        code=library_code("corpus_realistic.py"),
    # one scheduled core: its server idles a core through startup and between batches, so a kv job
    # runs beside it (nothing here is timed; the kv jobs' codec speeds then share the machine)
    threads: 1
    resources:
        **device_resources("corpus_realistic"),
    log:
        main="logs/corpus/realistic.log",
        vllm="logs/corpus/realistic.vllm.log",
    benchmark:
        "benchmarks/corpus/realistic.tsv"
    conda:
        CONDA_ENV
    script:
        "../scripts/corpus_realistic.py"


rule corpus_imported:
    input:
        imported_files,
    output:
        docs="results/corpus/imported/docs.parquet",
    params:
        cfg=config["corpus"]["imported"],
        code=library_code("corpus_imported.py"),
    log:
        "logs/corpus/imported.log",
    benchmark:
        "benchmarks/corpus/imported.tsv"
    conda:
        CONDA_ENV
    script:
        "../scripts/corpus_imported.py"


rule corpus_stats:
    input:
        docs=corpus_docs(),
        tokenizer=model_dir(tokenizer_model(config)),
    output:
        stats=report(
            "results/corpus/stats.parquet",
            caption="../report/corpus_stats.rst",
            category="Corpus",
        ),
        summary=report(
            "results/corpus/stats_summary.parquet",
            caption="../report/corpus_stats.rst",
            category="Corpus",
        ),
        figure=report(
            "results/corpus/diversity.png",
            caption="../report/diversity.rst",
            category="Corpus",
        ),
    params:
        tokenizer_model=tokenizer_model(config),
        code=library_code("corpus_stats.py"),
    log:
        "logs/corpus/stats.log",
    benchmark:
        "benchmarks/corpus/stats.tsv"
    conda:
        CONDA_ENV
    script:
        "../scripts/corpus_stats.py"

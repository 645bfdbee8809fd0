rule model_prepare:
    output:
        directory("resources/models/{model}"),
    params:
        source=lambda wc: config["models"][wc.model],
        code=library_code("model_prepare.py"),
    wildcard_constraints:
        model="|".join(map(re.escape, PREPARED_MODELS)) or "^$",
    log:
        "logs/models/{model}.log",
    benchmark:
        "benchmarks/models/{model}.tsv"
    conda:
        CONDA_ENV
    script:
        "../scripts/model_prepare.py"

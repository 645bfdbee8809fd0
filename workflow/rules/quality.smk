QUALITY = config["quality"]
QUALITY_REFERENCE = QUALITY["reference"]
# The reference runs first (its continuations are the others' fidelity targets), whether listed or not.
QUALITY_METHODS = [QUALITY_REFERENCE] + [m for m in QUALITY["methods"] if m != QUALITY_REFERENCE]

# What a method job's results depend on besides its method and the task files (so that adding a
# method or a model does not rerun the others).
QUALITY_RUN = {key: QUALITY[key] for key in (
    "device", "compute_dtype", "max_gen_cap", "max_prompt_tokens", "reference_top_k", "lm_eval_tasks", "lm_eval_limit")}
# Imported LongBench lines are an input only when a longbench task is configured.
QUALITY_IMPORTED = {"imported": "results/corpus/imported/docs.parquet"} if "longbench" in QUALITY["tasks"] else {}


rule quality_tasks:
    input:
        docs="results/corpus/realistic/docs.parquet",
        facts="results/corpus/realistic/facts.parquet",
        tokenizer=model_dir(tokenizer_model(config)),
        **QUALITY_IMPORTED,
    output:
        directory("results/quality/tasks"),
    params:
        tasks=QUALITY["tasks"],
        seed=config["seed"],
        code=library_code("quality_tasks.py"),
    log:
        "logs/quality/tasks.log",
    benchmark:
        "benchmarks/quality/tasks.tsv"
    conda:
        CONDA_ENV
    script:
        "../scripts/quality_tasks.py"


rule quality_reference:
    input:
        tasks="results/quality/tasks",
        model=lambda wc: model_dir(wc.model),
    output:
        table=f"results/quality/{{model}}/methods/{QUALITY_REFERENCE}.parquet",
        references="results/quality/{model}/reference.safetensors",
    params:
        cfg=QUALITY_RUN,
        method=QUALITY_REFERENCE,
        spec=config["methods"][QUALITY_REFERENCE],
        seed=config["seed"],
        code=library_code("quality_method.py"),
    wildcard_constraints:
        model="|".join(map(re.escape, QUALITY["models"])),
    # The whole machine per job, as the system stage: every method timed under the same load.
    threads: MACHINE_THREADS
    log:
        "logs/quality/{model}/reference.log",
    benchmark:
        "benchmarks/quality/{model}/reference.tsv"
    conda:
        CONDA_ENV
    script:
        "../scripts/quality_method.py"


rule quality_method:
    input:
        tasks="results/quality/tasks",
        references="results/quality/{model}/reference.safetensors",
        model=lambda wc: model_dir(wc.model),
    output:
        table="results/quality/{model}/methods/{method}.parquet",
    params:
        cfg=QUALITY_RUN,
        method=lambda wc: wc.method,
        spec=lambda wc: config["methods"][wc.method],
        seed=config["seed"],
        code=library_code("quality_method.py"),
    wildcard_constraints:
        model="|".join(map(re.escape, QUALITY["models"])),
        method="|".join(map(re.escape, QUALITY_METHODS[1:])) or "^$",
    threads: MACHINE_THREADS
    log:
        "logs/quality/{model}/{method}.log",
    benchmark:
        "benchmarks/quality/{model}/{method}.tsv"
    conda:
        CONDA_ENV
    script:
        "../scripts/quality_method.py"


rule quality_summary:
    input:
        expand("results/quality/{{model}}/methods/{method}.parquet", method=QUALITY_METHODS),
    output:
        scores=report(
            "results/quality/{model}/scores.parquet",
            caption="../report/quality_tables.rst",
            category="Quality",
            subcategory="{model}",
        ),
        fidelity=report(
            "results/quality/{model}/fidelity.parquet",
            caption="../report/quality_tables.rst",
            category="Quality",
            subcategory="{model}",
        ),
        summary=report(
            "results/quality/{model}/summary.parquet",
            caption="../report/quality_tables.rst",
            category="Quality",
            subcategory="{model}",
        ),
        jobs="results/quality/{model}/jobs.parquet",
        score_figure=report(
            "results/quality/{model}/scores.png",
            caption="../report/quality_scores.rst",
            category="Quality",
            subcategory="{model}",
        ),
        fidelity_figure=report(
            "results/quality/{model}/fidelity.png",
            caption="../report/quality_fidelity.rst",
            category="Quality",
            subcategory="{model}",
        ),
        ratio_figure=report(
            "results/quality/{model}/score_vs_ratio.png",
            caption="../report/quality_ratio.rst",
            category="Quality",
            subcategory="{model}",
        ),
    params:
        reference=QUALITY_REFERENCE,
        code=library_code("quality_summary.py"),
    wildcard_constraints:
        model="|".join(map(re.escape, QUALITY["models"])),
    log:
        "logs/quality/{model}/summary.log",
    benchmark:
        "benchmarks/quality/{model}/summary.tsv"
    conda:
        CONDA_ENV
    script:
        "../scripts/quality_summary.py"

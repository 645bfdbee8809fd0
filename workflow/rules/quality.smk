QUALITY = config["quality"]
QUALITY_REFERENCE = QUALITY["reference"]
# Methods per job (quality.methods_per_job): the reference first, in job 1, whether listed or not;
# jobs 2.. read its references.
QUALITY_JOBS = {str(i): methods for i, methods in enumerate(
    quality_batches(QUALITY["methods"], QUALITY_REFERENCE, QUALITY["methods_per_job"]), start=1)}

# What a job's results depend on besides its methods and the task files (so that adding a model
# does not rerun the others).
QUALITY_RUN = {key: QUALITY[key] for key in (
    "device", "compute_dtype", "max_gen_cap", "max_prompt_tokens", "reference_top_k", "lm_eval_tasks", "lm_eval_limit",
    "protocols", "fidelity_positions", "prompts_per_batch", "max_rows")}
# The realistic corpus is an input only when kvbench builds tasks (lm-eval's own tasks read the hub
# cache), imported LongBench lines only when a longbench task is configured.
QUALITY_CORPUS = {"docs": "results/corpus/realistic/docs.parquet", "facts": "results/corpus/realistic/facts.parquet"} \
    if QUALITY["tasks"] else {}
QUALITY_IMPORTED = {"imported": "results/corpus/imported/docs.parquet"} if "longbench" in QUALITY["tasks"] else {}
QUALITY_SPECS = {job: {m: config["methods"][m] for m in methods} for job, methods in QUALITY_JOBS.items()}


# Per model: context lengths are counted with the tokenizer of the model that runs them.
rule quality_tasks:
    input:
        **QUALITY_CORPUS,
        tokenizer=lambda wc: model_dir(wc.model),
        **QUALITY_IMPORTED,
    output:
        directory("results/quality/{model}/tasks"),
    params:
        tasks=QUALITY["tasks"],
        seed=config["seed"],
        code=library_code("quality_tasks.py"),
    wildcard_constraints:
        model="|".join(map(re.escape, QUALITY["models"])),
    log:
        "logs/quality/{model}/tasks.log",
    benchmark:
        "benchmarks/quality/{model}/tasks.tsv"
    conda:
        CONDA_ENV
    script:
        "../scripts/quality_tasks.py"


rule quality_reference:
    input:
        tasks="results/quality/{model}/tasks",
        model=lambda wc: model_dir(wc.model),
    output:
        table="results/quality/{model}/jobs/1.parquet",
        references="results/quality/{model}/reference.safetensors",
    params:
        cfg=QUALITY_RUN,
        specs=QUALITY_SPECS["1"],
        reference=QUALITY_REFERENCE,
        seed=config["seed"],
        code=library_code("quality_job.py"),
    wildcard_constraints:
        model="|".join(map(re.escape, QUALITY["models"])),
    # The whole machine per job, as the system stage: every method timed under the same load.
    threads: MACHINE_THREADS
    resources:
        **device_resources("quality_reference"),
    log:
        "logs/quality/{model}/job1.log",
    benchmark:
        "benchmarks/quality/{model}/job1.tsv"
    conda:
        CONDA_ENV
    script:
        "../scripts/quality_job.py"


rule quality_methods:
    input:
        tasks="results/quality/{model}/tasks",
        # Job 1 rewrites the references whenever any of its methods changes; these jobs follow
        # the reference's own spec (a param) instead of the file's time.
        references=ancient("results/quality/{model}/reference.safetensors"),
        model=lambda wc: model_dir(wc.model),
    output:
        table="results/quality/{model}/jobs/{job}.parquet",
    params:
        cfg=QUALITY_RUN,
        reference_spec=config["methods"][QUALITY_REFERENCE],
        specs=lambda wc: QUALITY_SPECS[wc.job],
        seed=config["seed"],
        code=library_code("quality_job.py"),
    wildcard_constraints:
        model="|".join(map(re.escape, QUALITY["models"])),
        job="|".join(list(QUALITY_JOBS)[1:]) or "^$",
    threads: MACHINE_THREADS
    resources:
        **device_resources("quality_methods"),
    log:
        "logs/quality/{model}/job{job}.log",
    benchmark:
        "benchmarks/quality/{model}/job{job}.tsv"
    conda:
        CONDA_ENV
    script:
        "../scripts/quality_job.py"


rule quality_summary:
    input:
        expand("results/quality/{{model}}/jobs/{job}.parquet", job=QUALITY_JOBS),
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


# vLLM's own quantized KV caches on the same tasks, through lm-eval's API models against each
# server, with fidelity to the 16-bit server (kvbench.quality.served; docs/quality.md).
rule quality_served:
    input:
        tasks="results/quality/{model}/tasks",
        model=lambda wc: model_dir(wc.model),
    output:
        report(
            "results/quality/{model}/served.parquet",
            caption="../report/quality_served.rst",
            category="Quality",
            subcategory="{model}",
        ),
    params:
        quality={key: QUALITY[key] for key in ("served", "max_gen_cap", "fidelity_positions", "lm_eval_tasks", "lm_eval_limit")},
        vllm=VLLM_RUN,
        seed=config["seed"],
        code=library_code("quality_served.py"),
    wildcard_constraints:
        model="|".join(map(re.escape, QUALITY["models"])),
    threads: MACHINE_THREADS
    resources:
        **device_resources("quality_served"),
    log:
        main="logs/quality/{model}/served.log",
        # each vLLM server's own log
        **{server: f"logs/quality/{{model}}/served-{server}.log" for server in ["reference", *QUALITY["served"]["servers"]]},
    benchmark:
        "benchmarks/quality/{model}/served.tsv"
    conda:
        CONDA_ENV
    script:
        "../scripts/quality_served.py"

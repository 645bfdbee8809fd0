SYSTEM = config["system"]
SYSTEM_BASELINE = config["report"]["baseline"]
# Methods per job (system.methods_per_job): each job led by the baseline, so every method's timings
# pair with a baseline measured in the same process, runs interleaved. A job is named by its other
# methods ("all": one job for every method), so dropping one method renames no other job.
SYSTEM_JOBS = {("all" if SYSTEM["methods_per_job"] is None else "+".join(methods[1:]) or methods[0]): methods
               for methods in paired_batches(SYSTEM_METHODS, SYSTEM_BASELINE, SYSTEM["methods_per_job"])}


rule system_job:
    input:
        docs=expand("results/corpus/{corpus}/docs.parquet", corpus=list(SYSTEM["prompts_per_corpus"])),
        facts="results/corpus/realistic/facts.parquet",
        model=lambda wc: model_dir(wc.model),
    output:
        "results/system/{model}/jobs/{job}.parquet",
    params:
        # What a job's rows depend on: its methods' settings, not the lists of methods and models.
        cfg={k: v for k, v in SYSTEM.items() if k not in ("methods", "models", "methods_per_job")},
        specs=lambda wc: {m: config["methods"][m] for m in SYSTEM_JOBS[wc.job]},
        seed=config["seed"],
        code=library_code("system_job.py"),
    wildcard_constraints:
        job="|".join(map(re.escape, SYSTEM_JOBS)),
    # The whole machine per job: every run is timed under the same load.
    threads: MACHINE_THREADS
    resources:
        **device_resources("system_job"),
    log:
        "logs/system/{model}/job{job}.log",
    benchmark:
        "benchmarks/system/{model}/job{job}.tsv"
    conda:
        CONDA_ENV
    script:
        "../scripts/system_job.py"


rule system_summary:
    input:
        system_parts(),
    output:
        metrics=report(
            "results/system/metrics.parquet",
            caption="../report/system_metrics.rst",
            category="System",
        ),
        runs=report(
            "results/system/runs.parquet",
            caption="../report/system_runs.rst",
            category="System",
        ),
        paired=report(
            "results/system/paired.parquet",
            caption="../report/system_runs.rst",
            category="System",
        ),
        figure=report(
            "results/system/methods.png",
            caption="../report/system_figure.rst",
            category="System",
        ),
    params:
        baseline=SYSTEM_BASELINE,
        code=library_code("system_summary.py"),
    log:
        "logs/system/summary.log",
    benchmark:
        "benchmarks/system/summary.tsv"
    conda:
        CONDA_ENV
    script:
        "../scripts/system_summary.py"

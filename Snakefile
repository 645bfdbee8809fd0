# kvbench: KV-cache optimizations benchmarked on realistic workloads.
from snakemake.utils import min_version

min_version("9.0")


# A --configfile is a whole config (config/gpu.yaml, config/gpu-smoke.yaml): the default is not
# merged under it, so none of the CPU default's sections leak into a cluster run. An overlay names
# the default first: --configfile config/config.yaml config/evidence.yaml
if not workflow.overwrite_configfiles:

    configfile: "config/config.yaml"


report: "workflow/report/workflow.rst"


include: "workflow/rules/common.smk"
include: "workflow/rules/models.smk"
include: "workflow/rules/corpus.smk"
include: "workflow/rules/kv.smk"
include: "workflow/rules/system.smk"
include: "workflow/rules/serve.smk"
include: "workflow/rules/quality.smk"
include: "workflow/rules/report.smk"


# Light jobs (report_tables: seconds, and it reads benchmarks/ of the submitting host; model_prepare:
# links a prefetched snapshot or converts the small shipped GGUF) run on the submit host under a
# cluster executor (no queue wait, no allocation).
localrules:
    all,
    model_prepare,
    corpus_synthetic,
    corpus_imported,
    corpus_stats,
    kv_summary,
    system_summary,
    serve_summary,
    quality_tasks,
    quality_summary,
    report_tables,


rule all:
    input:
        all_targets(),
    default_target: True

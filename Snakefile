# kvbench: KV-cache optimizations benchmarked on realistic workloads.
from snakemake.utils import min_version

min_version("9.0")


configfile: "config/config.yaml"


report: "workflow/report/workflow.rst"


include: "workflow/rules/common.smk"
include: "workflow/rules/models.smk"
include: "workflow/rules/corpus.smk"
include: "workflow/rules/kv.smk"
include: "workflow/rules/system.smk"
include: "workflow/rules/report.smk"


rule all:
    input:
        all_targets(),
    default_target: True

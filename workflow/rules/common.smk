import os

from snakemake.utils import validate

from kvbench.config import check_config, check_schema, model_dir as _model_dir, tokenizer_model
from kvbench.report.contracts import CONTRACTS

# One line per problem, naming the key; then snakemake's validate fills in the defaults.
check_schema(config, workflow.source_path("../schemas/config.schema.yaml"))
validate(config, schema="../schemas/config.schema.yaml")

check_config(config)

PREPARED_MODELS = [m for m, src in config["models"].items() if "path" not in src]
SYSTEM_METHODS = config["system"].get("methods") or list(config["methods"])
# Jobs that want the whole machine (a server, timed runs). Snakemake scales threads down to
# --cores locally; cluster profiles set them per rule (set-threads). Never workflow.cores, as it
# needs a global core count, which `--unlock` and the SLURM executor do not give.
MACHINE_THREADS = os.cpu_count() or 1
CORPORA = ["synthetic", "realistic"] + (["imported"] if config["corpus"]["imported"]["path"] else [])


wildcard_constraints:
    model="|".join(PREPARED_MODELS) or "^$",
    corpus="|".join(CORPORA),
    weights="real|random|dummy",
    method="|".join(SYSTEM_METHODS),


def model_dir(name):
    return _model_dir(config, name)


def corpus_docs(corpora=CORPORA):
    return expand("results/corpus/{corpus}/docs.parquet", corpus=corpora)


def kv_parts(table):
    kv = config["kv"]
    return expand(f"results/kv/{{corpus}}/{{weights}}/{table}.parquet", corpus=kv["corpora"], weights=kv["weights"])


def all_targets():
    return [
        *corpus_docs(),
        "results/corpus/realistic/facts.parquet",
        "results/corpus/stats.parquet",
        "results/corpus/stats_summary.parquet",
        "results/corpus/diversity.png",
        "results/kv/compressibility.parquet",
        "results/kv/summary.parquet",
        "results/kv/ratio_by_corpus_weights.png",
        "results/system/metrics.parquet",
        "results/system/methods.png",
        "results/report/claims.parquet",
    ]


# Only used with --use-conda (clusters); `make setup` builds .venv from envs/cpu.txt here.
CONDA_ENV = "../../envs/gpu.yaml" if config["vllm"]["device"] == "cuda" else "../../envs/cpu.yaml"


# Stage report: what it reads, and its report() entries.
def report_inputs(wildcards):
    """Every stage table this workflow makes (a per-model table once per model that has one); a stage
    that makes none is reported as not run."""
    found = {name: [p for p in c.expand(config["models"]) if any(r.is_producer(p) for r in workflow.rules)]
             for name, c in CONTRACTS.items()}
    return {name: paths for name, paths in found.items() if paths}


def benchmark_patterns(wildcards):
    """rule -> benchmark path pattern, so the cost table can name the rule behind each TSV."""
    return {r.name: str(r.benchmark) for r in workflow.rules if r.benchmark}


def report_figure(name, fmt):
    return report(
        f"results/report/{name}.{fmt.lower()}",
        caption=f"../report/report_{name}.rst",
        category="Report",
        subcategory="Figures",
        labels={"figure": name, "format": fmt},
    )


def report_page(name, subcategory):
    return report(f"results/report/{name}.html", caption=f"../report/report_{name}.rst", category="Report",
                  subcategory=subcategory)

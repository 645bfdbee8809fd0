import os
import re
import sys
from pathlib import Path

from snakemake.exceptions import WorkflowError

# The library is imported one way, here and in every job's script: the editable install of this
# checkout (`make setup`; `--use-conda` envs install it in their post-deploy scripts, which find
# the checkout through KVBENCH_CHECKOUT). An install of another checkout stops the parse.
os.environ.update(KVBENCH_CHECKOUT=str(Path(workflow.basedir).resolve()))  # set for the post-deploy scripts, not read here
try:
    from kvbench.checkout import check_checkout
except ImportError as err:
    raise WorkflowError(f"kvbench is not installed in {sys.executable}: run `make setup`, or "
                        f"`pip install --no-deps -e {workflow.basedir}` in this environment") from err
check_checkout(workflow.basedir)

from kvbench.codehash import code_hash
from kvbench.checks import check_config
from kvbench.config import model_dir as _model_dir, system_models, tokenizer_model
from kvbench.corpus.imported import document_files
from kvbench.hub import note_configfiles, require_prefetched
from kvbench.jobs import usable_cpus
from kvbench.batches import batches as quality_batches, paired_batches
from kvbench.serve.backends import CONNECTOR_MODULE, server_backends, servers as serve_servers
from kvbench.report.contracts import CONTRACTS
from kvbench.resources import RULE_STAGE, rule_resources
from kvbench.site import require_site, sinfo_partitions
from kvbench.vllm_server import RUNTIME_SETTINGS as VLLM_RUNTIME

# Schema (types, ranges, defaults), method settings per kind, lengths against each model's context
# and the documents, subsets, references, files: one line per problem, naming the key.
check_config(config, workflow.source_path("../schemas/config.schema.yaml"))

# The config files of this run, for the prefetch command a job names when the hub cache lacks a file.
CONFIGFILES = note_configfiles([str(f) for f in workflow.overwrite_configfiles] or ["config/config.yaml"])


# Before any job (not in a dry run): everything the config reads from the hub must be in the hub
# cache (`make prefetch`); jobs never download, and each checks again on its node (kvbench.jobs).
# Through the SLURM executor, the resources of the jobs it will submit against the site (kvbench.site): a
# placeholder left in the profile, a partition or GPU type sinfo does not list, memory above the
# partition's nodes stop the run here, before anything is submitted.
onstart:
    if getattr(workflow.executor_plugin, "name", None) == "slurm":
        require_site([(job.rule.name, dict(job.resources)) for job in workflow.dag.needrun_jobs() if not job.is_local],
                     sinfo_partitions())
    require_prefetched(config, CONFIGFILES)


PREPARED_MODELS = [m for m, src in config["models"].items() if "path" not in src]
SYSTEM_MODELS = system_models(config)
SYSTEM_METHODS = config["system"].get("methods") or list(config["methods"])
# Jobs that want the whole machine (a server, timed runs). Snakemake scales threads down to
# --cores locally, and the SLURM profile sets them per rule. A global core count (workflow.cores)
# would break `--unlock` and the SLURM executor, which do not give one.
MACHINE_THREADS = len(usable_cpus())
SERVE_SERVERS = serve_servers(config["serve"]["backends"], config["serve"]["weights"])
# GPUs a job of each stage takes (resources gpu): a run on one node with `--resources gpu=N` (the
# default profile says 1) never holds more GPU jobs than GPUs; each gets its own (kvbench.gpu_env).
GPUS = {stage: int(config[stage]["device"] == "cuda") for stage in ("vllm", "kv", "system", "quality")}
# What a GPU rule asks a scheduler for, from the formula applied to this run's config (CUDA stages
# only; on CPU the profile's defaults): a model the formula cannot size stops the parse, named.
try:
    JOB_RESOURCES = rule_resources(config)
except KeyError as err:
    raise WorkflowError(f"cluster resources: {err.args[0]}") from err


def device_resources(rule):
    """The resources of a job that loads a model or starts a server: its GPU count and, on CUDA,
    the formula's gpu_mem_mb, mem_mb and runtime (kvbench.resources.rule_resources)."""
    return {"gpu": GPUS[RULE_STAGE[rule]], **JOB_RESOURCES.get(rule, {})}


# The vLLM settings a server's output depends on: the port and the timeouts are read from the
# config by the scripts (kvbench.vllm_server.runtime_settings), and changing them reruns nothing.
# Scripts take everything else from their rule (input, params); the whole config only for
# provenance and these runtime settings (and hf_offline, read by kvbench.jobs.job_log).
VLLM_RUN = {k: v for k, v in config["vllm"].items() if k not in VLLM_RUNTIME}
CORPORA = ["synthetic", "realistic"] + (["imported"] if config["corpus"]["imported"]["path"] else [])


wildcard_constraints:
    model="|".join(map(re.escape, config["models"])),
    corpus="|".join(CORPORA),
    weights="real|random|dummy",
    server="|".join(map(re.escape, SERVE_SERVERS)),


def model_dir(name):
    return _model_dir(config, name)


def library_code(script, extra=()):
    """Hash of the library modules a script imports (and of `extra` modules, which another program
    imports by name): a param, so a library change reruns its jobs."""
    return code_hash(Path(workflow.basedir) / "workflow" / "scripts" / script, extra)


def serve_run(server):
    """The serve settings, with only this server's backends: adding or dropping another server's
    backend does not rerun it."""
    return {**config["serve"], "backends": server_backends(server, config["serve"]["backends"])}


def serve_methods(server):
    """Method settings of the lossy wire formats, for the servers whose connector uses them."""
    if "valkey" not in server_backends(server, config["serve"]["backends"]):
        return {}
    return {name: config["methods"][name] for name in config["serve"]["codecs"] if name in config["methods"]}


def imported_files(wildcards):
    """The imported folder's documents are inputs: adding, removing or editing one reruns the import."""
    return [str(p) for p in document_files(config["corpus"]["imported"]["path"])]


def corpus_docs(corpora=CORPORA):
    return expand("results/corpus/{corpus}/docs.parquet", corpus=corpora)


def kv_parts(table):
    kv = config["kv"]
    return expand(f"results/kv/{{corpus}}/{{weights}}/{table}.parquet", corpus=kv["corpora"], weights=kv["weights"])


def system_parts():
    return expand("results/system/{model}/jobs/{job}.parquet", model=SYSTEM_MODELS, job=SYSTEM_JOBS)


def serve_parts(table):
    return expand(f"results/serve/servers/{{server}}/{table}.parquet", server=SERVE_SERVERS)


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
        "results/serve/requests.parquet",
        "results/serve/offload.parquet",
        "results/serve/load.parquet",
        "results/serve/engine.parquet",
        "results/serve/recommendations.parquet",
        "results/serve/ttft_hit_miss.png",
        "results/serve/wire_bytes.png",
        *expand(
            "results/quality/{model}/{output}",
            model=config["quality"]["models"],
            output=["summary.parquet", "scores.png", "fidelity.png", "score_vs_ratio.png"],
        ),
        *(expand("results/quality/{model}/served.parquet", model=config["quality"]["models"])
          if config["quality"]["served"]["servers"] else []),
        "results/report/claims.parquet",
    ]


# Only used with --use-conda (clusters); `make setup` builds .venv from envs/cpu.txt here.
CONDA_ENV = "../../envs/gpu.yaml" if config["vllm"]["device"] == "cuda" else "../../envs/cpu.yaml"


# Stage report: what it reads, and its report() entries.
def report_inputs(wildcards):
    """Every stage table this workflow makes (a per-model table once per model that has one); a stage
    that makes none is reported as not run."""
    off = set() if config["quality"]["served"]["servers"] else {"quality_served"}  # its rule is not run
    found = {name: [p for p in c.expand(config["models"]) if any(r.is_producer(p) for r in workflow.rules)]
             for name, c in CONTRACTS.items() if name not in off}
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

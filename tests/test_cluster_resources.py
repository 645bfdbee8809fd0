"""Cluster resources: the formula (kvbench.resources), the SLURM profile derived from it, the GPU
hours table in docs/cluster.md, and GPUs on one node (resources gpu, kvbench.gpu_env leases)."""

from __future__ import annotations

import json
import math
import re
import signal
import subprocess
import sys

import pytest
import yaml

from kvbench import gpu_env, resources
from kvbench.resources import GIB, KNOWN_SHAPES, Shape, Work, gpu_bytes, model_shape, profile_resources
from kvbench.tinyrun import REPO, snakemake

GPU_CONFIG = yaml.safe_load((REPO / "config" / "gpu.yaml").read_text())
PROFILE = yaml.safe_load((REPO / "workflow" / "profiles" / "slurm" / "config.yaml").read_text())
LLAMA = Shape(**KNOWN_SHAPES["meta-llama/Llama-3.1-8B-Instruct"])
A100_GIB = 80


@pytest.mark.parametrize("name", ["gpu", "gpu-smoke"])
def test_each_gpu_config_asks_the_scheduler_for_its_own_formula(name, tmp_path):
    """The smoke config's jobs ask for the smoke config's needs, not config/gpu.yaml's (its serve job
    asked ~365 GiB and 386 min when the profile held gpu.yaml's figures): the dry run through the
    SLURM profile plans every GPU job with rule_resources of the config it runs, and the profile
    holds none of these figures, so none can be stale."""
    from test_cluster_profile import planned_jobs

    from kvbench.tinyrun import slurm_args

    config = yaml.safe_load((REPO / "config" / f"{name}.yaml").read_text())
    result = snakemake(
        tmp_path, None, "-n", *slurm_args(tmp_path), "--configfile", str(REPO / "config" / f"{name}.yaml")
    )
    assert result.returncode == 0, result.stderr[-3000:]
    derived = resources.rule_resources(config)
    planned = [job for job in planned_jobs(result.stdout) if job["rule"] in resources.RULE_STAGE]
    assert {job["rule"] for job in planned} <= set(derived)  # every stage of both configs runs on CUDA
    assert {job["rule"] for job in planned} >= {"corpus_realistic", "kv_capture", "serve_server", "system_job"}
    for job in planned:
        need = derived[job["rule"]]
        assert {k: int(job[k]) for k in need} == need, job["_text"]
    for held in PROFILE["set-resources"].values():
        assert not {"mem_mb", "runtime", "gpu_mem_mb"} & set(held)
    if name == "gpu-smoke":
        big = resources.rule_resources(GPU_CONFIG)["serve_server"]
        assert (
            derived["serve_server"]["mem_mb"] < big["mem_mb"] / 10
            and derived["serve_server"]["runtime"] < big["runtime"]
        )


def test_cpu_configs_ask_for_no_derived_resources():
    from kvbench.tinyrun import default_config

    assert resources.rule_resources(default_config()) == {}


def test_the_formula_byte_for_byte_on_llama():
    assert LLAMA.weight_bytes == pytest.approx(8.03e9 * 2)  # bf16 throughout
    assert LLAMA.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2
    work = Work("system_job", "llama", 10, "harness", 10_000, 0, 0, copies=2)
    expected = 2 * GIB + 8.03e9 * 2 + 131072 * 10_000 * 2 + 10_000 * (4 * 4096 + 3 * 14336) * 2
    assert gpu_bytes(work, LLAMA, 32768) == pytest.approx(expected)
    served = Work("serve_server", "llama", 4, "vllm", 32768, 0, 0)
    assert gpu_bytes(served, LLAMA, 32768) == pytest.approx(8.03e9 * 2 + 131072 * 32768 + 2 * GIB)


def test_fp8_weights_count_one_byte_except_the_embeddings():
    qwen = Shape(**KNOWN_SHAPES["Qwen/Qwen3-8B-FP8"])
    embeddings = 151936 * 4096 * 2
    assert qwen.weight_bytes == pytest.approx(8.19e9 - embeddings + 2 * embeddings)
    assert 8.19e9 < qwen.weight_bytes < 2 * 8.19e9


def test_longer_contexts_need_more_memory_and_time():
    short = Work("quality_reference", "llama", 1, "harness", 4096, 1e5, 1e3, copies=2)
    long = Work("quality_reference", "llama", 1, "harness", 32768, 1e6, 1e3, copies=2)
    assert gpu_bytes(long, LLAMA, 0) > gpu_bytes(short, LLAMA, 0)
    assert resources.job_seconds(long, LLAMA) > resources.job_seconds(short, LLAMA)
    assert resources.runtime_minutes(short, LLAMA) >= resources.MIN_RUNTIME_MIN


def test_every_gpu_job_of_the_gpu_config_fits_the_profiles_gpu():
    # vLLM servers take --gpu-memory-utilization of the GPU: weights and a max_model_len KV pool must fit.
    extra = GPU_CONFIG["vllm"]["extra_args"]
    util = float(extra[extra.index("--gpu-memory-utilization") + 1])
    for rule, need in profile_resources(GPU_CONFIG).items():
        limit = util * A100_GIB if rule in ("corpus_realistic", "serve_server") else A100_GIB
        assert need["gpu_mem_mb"] * 2**20 <= limit * GIB, (rule, need)


def test_a_longer_vllm_context_than_the_gpu_holds_shows_in_the_formula():
    bigger = {**GPU_CONFIG, "vllm": {**GPU_CONFIG["vllm"], "max_model_len": 600_000}}
    assert profile_resources(bigger)["serve_server"]["gpu_mem_mb"] * 2**20 > A100_GIB * GIB


def test_shape_from_a_model_folder(model_dir, tmp_path):
    for name in ("config.json",):
        (tmp_path / name).write_text((model_dir / name).read_text())
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 2 * 134_515_008}}))
    config = {"models": {"smol": {"path": str(tmp_path)}}}
    shape = model_shape(config, "smol", tmp_path)
    assert (shape.layers, shape.kv_heads, shape.head_dim, shape.params) == (30, 3, 64, 134_515_008)
    with pytest.raises(KeyError, match="models.smol: no shape known"):
        model_shape(config, "smol")


def test_the_cost_table_in_the_docs_is_the_formulas():
    text = (REPO / "docs" / "cluster.md").read_text()
    block = re.search(r"<!-- generated:gpu-cost -->\n(.*?)<!-- end generated:gpu-cost -->", text, flags=re.S).group(1)
    rows = [line.split("|")[1:-1] for line in block.strip().splitlines()[2:]]
    table = resources.cost_table(GPU_CONFIG)
    assert [[c.strip() for c in row] for row in rows[:-1]] == [
        [r["rule"], r["model"], str(r["jobs"]), f"{r['gpu_hours']:.2f}"] for r in table
    ]
    assert rows[-1][3].strip() == f"{sum(r['gpu_hours'] for r in table):.1f}"
    assert "estimate" in text[text.index("<!-- generated:gpu-cost -->") - 600 :].lower()


def release_leases():
    for handle in gpu_env._LEASES:
        handle.close()
    gpu_env._LEASES.clear()


def test_gpu_leases_hand_out_distinct_gpus_and_refuse_one_too_many(tmp_path):
    try:
        assert gpu_env.lease_gpus(1, 2, tmp_path) == [0]
        assert gpu_env.lease_gpus(1, 2, tmp_path) == [1]
        with pytest.raises(gpu_env.GPUEnvironmentError, match="needs 1 GPU\\(s\\), but 2 of this node's 2 are held"):
            gpu_env.lease_gpus(1, 2, tmp_path)
    finally:
        release_leases()
    assert gpu_env.lease_gpus(2, 2, tmp_path) == [0, 1]  # released with their holder
    release_leases()
    with pytest.raises(gpu_env.GPUEnvironmentError, match="needs 1 GPU\\(s\\); nvidia-smi lists 0 on this node"):
        gpu_env.lease_gpus(1, 0, tmp_path)


def test_a_killed_jobs_gpu_is_free_again(tmp_path):
    code = (
        "import sys, time; from kvbench.gpu_env import lease_gpus; "
        f"print(lease_gpus(1, 1, {str(tmp_path)!r}), flush=True); time.sleep(60)"
    )
    with subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) as child:
        assert child.stdout.readline().strip() == "[0]"
        try:
            with pytest.raises(gpu_env.GPUEnvironmentError):
                gpu_env.lease_gpus(1, 1, tmp_path)
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait()
    try:
        assert gpu_env.lease_gpus(1, 1, tmp_path) == [0]
    finally:
        release_leases()


def test_assign_gpus_only_where_no_scheduler_chose(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_env, "nvidia_smi", lambda: [{"name": "H200", "driver": "580.95.05"}] * 2)
    try:
        env: dict[str, str] = {}
        gpu_env.assign_gpus(1, env, tmp_path)
        assert env == {"CUDA_VISIBLE_DEVICES": "0"}
        for given in ({"SLURM_JOB_ID": "7"}, {"CUDA_VISIBLE_DEVICES": "3"}):
            env = dict(given)
            gpu_env.assign_gpus(1, env, tmp_path)
            assert env == given
        env = {}
        gpu_env.assign_gpus(0, env, tmp_path)  # a CPU job
        assert env == {}
    finally:
        release_leases()


def test_a_plain_local_run_counts_one_gpu_per_device_job(tmp_path):
    """The default profile allows gpu=1 at a time: a GPU config's device jobs each take one, so a plain
    `snakemake --cores all` on a GPU node runs them one after another (--resources gpu=N for N GPUs).
    (CPU configs take none: tests/test_config.py's dry run of the default config.)"""
    result = snakemake(tmp_path, None, "-n", "--configfile", str(REPO / "config" / "gpu.yaml"))
    assert result.returncode == 0, result.stderr[-3000:]
    jobs = re.findall(r"^rule (\w+):\n(?:.*\n)*?\s+resources: (.*)$", result.stdout, flags=re.M)
    device = {
        "corpus_realistic",
        "kv_capture",
        "system_job",
        "serve_server",
        "quality_reference",
        "quality_methods",
        "quality_served",
    }
    taken = {rule: re.search(r"gpu=(\d+)", res).group(1) if "gpu=" in res else None for rule, res in jobs}
    assert {taken[r] for r in device & set(taken)} == {"1"} and device <= set(taken)
    assert {taken[r] for r in set(taken) - device} <= {None, "0"}
    assert yaml.safe_load((REPO / "profiles" / "default" / "config.yaml").read_text())["resources"] == ["gpu=1"]


def test_a_serve_job_asks_host_memory_for_the_valkey_it_starts_and_its_store_queue():
    from kvbench.config import with_schema_defaults
    from kvbench.serve.stage import ServeSettings, store_bound_mb

    serve = GPU_CONFIG["serve"]
    own = profile_resources(GPU_CONFIG)["serve_server"]["mem_mb"]
    elsewhere = {**GPU_CONFIG, "serve": {**serve, "valkey": {**serve["valkey"], "url": "valkey://store:6379"}}}
    freed = own - profile_resources(elsewhere)["serve_server"]["mem_mb"]
    # maxmemory_mb 0: the stage's own bound for the run, here for the largest model's 256-token chunks
    shape = resources.model_shape(GPU_CONFIG, serve["model"])
    bound = store_bound_mb(
        ServeSettings.of(with_schema_defaults({"serve": serve})["serve"]),
        shape.kv_bytes_per_token * serve["block_size"],
    )
    assert freed == bound and freed > 64 * 1024  # what the run stores does not fit the old 64 GB cap
    capped = {**GPU_CONFIG, "serve": {**serve, "valkey": {**serve["valkey"], "maxmemory_mb": 1000}}}
    assert (
        profile_resources(capped)["serve_server"]["mem_mb"] - profile_resources(elsewhere)["serve_server"]["mem_mb"]
        == 1000
    )
    lmcache = resources.LMCACHE_CPU_BUFFER_MB if "lmcache" in serve["backends"] else 0
    request = serve["doc_tokens"] * shape.kv_bytes_per_token  # a 10K-token document's KV, ~1.5 GB
    transient = math.ceil((2 * serve["store"]["threads"] + 4) * request / 2**20)  # stores' and a load's buffers
    assert (
        own - freed == math.ceil(resources.host_bytes(shape) / 2**20) + serve["store"]["queue_mb"] + transient + lmcache
    )
    assert profile_resources(elsewhere)["system_job"] == profile_resources(GPU_CONFIG)["system_job"]


def test_a_job_that_starts_servers_one_after_another_pays_each_startup():
    one = Work("quality_served", "llama", 1, "vllm", 32768, 1e5, 1e3)
    six = Work("quality_served", "llama", 1, "vllm", 32768, 1e5, 1e3, starts=6)
    startup = resources.GPU_COST["vllm_startup_s"] + LLAMA.weight_bytes / resources.GPU_COST["load_bytes_per_s"]
    startup += resources.GPU_COST["vllm_compile_s"]
    assert resources.job_seconds(six, LLAMA) - resources.job_seconds(one, LLAMA) == pytest.approx(5 * startup)
    served = [w for w in resources.workloads(GPU_CONFIG) if w.rule == "quality_served"]
    assert served and {w.starts for w in served} == {1 + len(GPU_CONFIG["quality"]["served"]["servers"])}

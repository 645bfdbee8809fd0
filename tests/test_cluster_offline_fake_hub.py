"""The cluster sequence of docs/cluster.md end to end with a FAKE hub (tests/fake_hub: a local folder
served on 127.0.0.1; there is no internet here) and the FAKE SLURM (tests/fake_slurm):

1. `make prefetch CONFIG=...` on the "login node": the hub model and lm-eval's LongBench subset
   go into the config's hub_cache (a gated model is refused with the licence to accept, then
   fetched with HF_TOKEN);
2. the workflow through the SLURM profile, offline: model_prepare links the prefetched snapshot,
   one quality job (a fake SLURM job on the GPU partition) runs lm-eval's own `longbench_qasper`
   task from the cache on seeded random samples; the hub sees no request.

Without the prefetch the run stops before any job with the command to run; a job whose node
does not see a prefetched file (removed while the job waited in the queue) fails with the same
message. Only the rules that matter run (no corpus, kv, system or serve stage): ~1-2 min.

The LongBench rows served here are made up (FAKE data under lm-eval's repo id, so lm-eval's task
file runs unchanged); the model is the test's SmolLM2 under a fake repo id.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from kvbench.tinyrun import (
    FAKE_SLURM,
    REPO,
    SNAKEMAKE,
    cancel_fake_slurm_jobs,
    default_config,
    slurm_args,
    snakemake,
    write_config,
)

sys.path.insert(0, str(REPO / "tests" / "fake_hub"))
import fake_hub  # noqa: E402

pytestmark = pytest.mark.integration

MODEL_REPO = "fake-hub/smollm2-135m"
GATED_REPO = "fake-hub/gated-model"
ACCEPTED_TOKEN = "hf_fake_accepted_licence"
QASPER_ROWS = 9
LIMIT = 3
TARGETS = ("results/quality/smol/jobs/1.parquet",)


def make_hub(root: Path, model_dir: Path) -> None:
    model = root / "models" / MODEL_REPO
    model.mkdir(parents=True)
    for path in model_dir.iterdir():
        (model / path.name).symlink_to(path)
    gated = root / "models" / GATED_REPO
    gated.mkdir(parents=True)
    (gated / "config.json").write_text(json.dumps({"model_type": "llama"}))
    meta = {"gated": "manual", "license": "llama3.1", "tokens": [ACCEPTED_TOKEN]}
    (gated / fake_hub.META).write_text(json.dumps(meta))
    longbench = root / "datasets" / "Xnhyacinth" / "LongBench"
    (longbench / "qasper").mkdir(parents=True)
    (longbench / "README.md").write_text(
        "---\nconfigs:\n- config_name: qasper\n  data_files:\n  - split: test\n    path: qasper/test-*\n"
        "---\nFAKE rows\n"
    )
    contract = (REPO / "tests" / "data" / "legal-contract-00.txt").read_text()
    rows = [
        {
            "question": f"Which clause number is {i}?",
            "context": contract[300 * i : 300 * i + 600],
            "answers": [f"clause {i}"],
            "length": 120,
            "dataset": "qasper",
            "language": "en",
            "all_classes": None,
            "_id": f"fake-{i}",
        }
        for i in range(QASPER_ROWS)
    ]
    pd.DataFrame(rows).to_parquet(longbench / "qasper" / "test-00000-of-00001.parquet")


def offline_config(workdir: Path, models: dict) -> dict:
    config = default_config()
    config["models"] = models
    config["hub_cache"] = str(workdir / "shared" / "hub")
    config["corpus"].update(generator="smol", tokenizer="smol")
    config["kv"]["model"] = config["serve"]["model"] = "smol"
    config["system"]["models"] = ["smol"]
    config["quality"].update(
        models=["smol"],
        methods=["full", "snapkv"],
        tasks={},
        max_gen_cap=4,
        lm_eval_tasks=["longbench_qasper"],
        lm_eval_limit=LIMIT,
    )
    return config


@pytest.fixture(scope="module")
def hub(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("fake-hub")
    make_hub(root, model_dir)
    server = fake_hub.serve(root)
    yield root, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def prefetch(config_path: Path, endpoint: str, token: str | None = None) -> subprocess.CompletedProcess:
    """The documented login-node command, in this environment (`python` on PATH is the venv's)."""
    hidden = ("HF_TOKEN", "HF_HOME", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    env = {k: v for k, v in os.environ.items() if k not in hidden}
    env |= {"HF_ENDPOINT": endpoint, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"}
    if token:
        env["HF_TOKEN"] = token
    return subprocess.run(
        ["make", "-s", "-C", str(REPO), "prefetch", f"CONFIG={config_path}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def fake_slurm_jobs(workdir: Path) -> list[dict]:
    folder = workdir / ".fake_slurm" / "jobs"
    return [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))] if folder.is_dir() else []


@pytest.fixture(scope="module")
def cluster(hub, tmp_path_factory):
    """Submitted before the prefetch (refused), then the documented sequence."""
    root, endpoint = hub
    workdir = tmp_path_factory.mktemp("cluster")
    config = offline_config(workdir, {"smol": {"hub": MODEL_REPO, "max_context": 8192}})
    config_path = write_config(workdir, config)
    os.environ.pop("HF_ENDPOINT", None)
    # Targets first: --configfile (and --forcerun) take every word up to the next option.
    refused = snakemake(workdir, None, *TARGETS, "--configfile", str(config_path), slurm=True, timeout=600)
    refused_jobs = fake_slurm_jobs(workdir)
    refused_made_model = (workdir / "resources" / "models" / "smol").exists()
    fetched = prefetch(config_path, endpoint)
    requests_after_prefetch = (root / "requests.log").read_text()
    # The jobs get the endpoint too: any request they made would reach the fake hub's log.
    os.environ["HF_ENDPOINT"] = endpoint
    try:
        ran = snakemake(workdir, None, *TARGETS, "--configfile", str(config_path), slurm=True, timeout=1200)
    finally:
        os.environ.pop("HF_ENDPOINT")
    return {
        "workdir": workdir,
        "config": config,
        "config_path": config_path,
        "refused": refused,
        "refused_jobs": refused_jobs,
        "refused_made_model": refused_made_model,
        "prefetch": fetched,
        "ran": ran,
        "hub_requests_during_run": (root / "requests.log").read_text()[len(requests_after_prefetch) :],
    }


def test_without_a_prefetch_the_run_stops_before_any_job_naming_the_command(cluster):
    refused = cluster["refused"]
    assert refused.returncode != 0
    assert cluster["refused_jobs"] == []  # nothing submitted
    assert not cluster["refused_made_model"]
    err = refused.stderr
    assert f"make prefetch CONFIG={cluster['config_path']}" in err, err[-3000:]
    assert f"models.smol: model {MODEL_REPO} was never prefetched" in err
    assert "quality.lm_eval_tasks: longbench_qasper: dataset Xnhyacinth/LongBench/qasper was never prefetched" in err


def test_prefetch_fills_the_hub_cache_and_its_manifest(cluster):
    fetched = cluster["prefetch"]
    assert fetched.returncode == 0, fetched.stdout[-3000:] + fetched.stderr[-3000:]
    cache = Path(cluster["config"]["hub_cache"])
    manifest = json.loads((cache / "kvbench-prefetch.json").read_text())
    assert manifest["datasets"]["Xnhyacinth/LongBench/qasper"]["splits"] == {"test": QASPER_ROWS}
    files = manifest["models"][MODEL_REPO]["files"]
    assert {Path(f).name for f in files} >= {"config.json", "model.safetensors", "tokenizer.json"}
    assert all((cache / f).stat().st_size == size for f, size in files.items())


def test_the_run_is_offline_and_reads_the_prefetched_model_and_dataset(cluster):
    ran, workdir = cluster["ran"], cluster["workdir"]
    assert ran.returncode == 0, ran.stdout[-5000:] + ran.stderr[-5000:]
    assert cluster["hub_requests_during_run"] == ""  # no job asked the hub for anything
    jobs = fake_slurm_jobs(workdir)
    assert [(j["state"], j["partition"], bool(j["gpus"])) for j in jobs] == [("COMPLETED", "gpu", True)]
    assert "quality_reference" in jobs[0]["comment"]
    model = workdir / "resources" / "models" / "smol"  # model_prepare ran locally: links, no copy
    cache = Path(cluster["config"]["hub_cache"]).resolve()
    assert (model / "model.safetensors").is_symlink()
    assert (model / "model.safetensors").resolve().is_relative_to(cache)
    table = pd.read_parquet(workdir / "results" / "quality" / "smol" / "jobs" / "1.parquet")
    assert set(table.method) == {"full", "snapkv"} and set(table.task) == {"longbench_qasper"}
    assert table.error.isna().all(), table[["method", "error"]]
    # Seeded random samples, the same for both methods: not lm-eval's first LIMIT.
    from kvbench.quality.run import sample_ids

    expected = sample_ids("longbench_qasper", QASPER_ROWS, LIMIT, cluster["config"]["seed"])
    assert expected != list(range(LIMIT))
    for (method, protocol), rows in table.groupby(["method", "protocol"]):
        rows = rows.sort_values("lm_eval_doc_id")
        assert list(rows.lm_eval_doc_id) == expected
        assert list(rows.sample_id) == [f"fake-{i}" for i in expected]


def test_a_job_whose_node_lacks_a_prefetched_file_fails_naming_the_command(cluster):
    """The cache is complete when the run starts (onstart passes), then a file disappears while the
    job waits in the queue (a scratch purge; a node that does not mount the cache looks the same):
    the job itself refuses to run and says what to do."""
    workdir, config = cluster["workdir"], cluster["config"]
    assert cluster["ran"].returncode == 0
    cache = Path(config["hub_cache"])
    manifest = json.loads((cache / "kvbench-prefetch.json").read_text())
    arrow = next(iter(manifest["datasets"]["Xnhyacinth/LongBench/qasper"]["files"]))
    hold = workdir / "hold"
    hold.touch()
    state = workdir / ".fake_slurm"
    env = dict(os.environ) | {
        "PATH": f"{FAKE_SLURM}{os.pathsep}{os.environ['PATH']}",
        "FAKE_SLURM_DIR": str(state),
        "FAKE_SLURM_HOLD": str(hold),
    }
    cmd = [
        SNAKEMAKE,
        "-s",
        str(REPO / "Snakefile"),
        "-d",
        str(workdir),
        *TARGETS,
        "--configfile",
        str(cluster["config_path"]),
        "--retries",
        "0",
        "--forcerun",
        "quality_reference",
        *slurm_args(workdir),
    ]
    before = len(fake_slurm_jobs(workdir))
    with subprocess.Popen(cmd, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        try:
            deadline = time.monotonic() + 120
            while len(fake_slurm_jobs(workdir)) == before and time.monotonic() < deadline and proc.poll() is None:
                time.sleep(0.5)
            assert [j["state"] for j in fake_slurm_jobs(workdir)[before:]] == ["PENDING"]
            (cache / arrow).unlink()
            hold.unlink()
            out, err = proc.communicate(timeout=600)
        finally:
            if proc.poll() is None:
                proc.kill()
            cancel_fake_slurm_jobs(workdir, env)
    assert proc.returncode != 0
    job = fake_slurm_jobs(workdir)[before]
    assert job["state"] == "FAILED"
    log = (workdir / "logs" / "quality" / "smol" / "job1.log").read_text()
    assert "as node fakenode sees it" in log, log[-3000:]
    assert "quality.lm_eval_tasks: longbench_qasper: dataset Xnhyacinth/LongBench/qasper: 1 file(s) missing" in log
    assert f"make prefetch CONFIG={cluster['config_path']}" in log


def test_a_gated_model_is_refused_with_its_licence_then_fetched_with_a_token(hub, tmp_path):
    _, endpoint = hub
    config = offline_config(tmp_path, {"smol": {"path": str(tmp_path)}, "gated": {"hub": GATED_REPO}})
    config["quality"]["lm_eval_tasks"] = []
    (tmp_path / "config.json").write_text(
        json.dumps({"max_position_embeddings": 8192, "hidden_size": 64, "num_attention_heads": 1})
    )
    config_path = write_config(tmp_path, config)
    refused = prefetch(config_path, endpoint)
    assert refused.returncode != 0
    message = refused.stderr
    assert f"models.gated: {GATED_REPO} is gated (HF_TOKEN is not set)" in message, message[-3000:]
    assert f"accept its licence (llama3.1) at {endpoint}/{GATED_REPO}" in message
    assert "export HF_TOKEN=" in message
    wrong = prefetch(config_path, endpoint, token="hf_someone_else")
    assert "HF_TOKEN is set, but its account has no access yet" in wrong.stderr
    accepted = prefetch(config_path, endpoint, token=ACCEPTED_TOKEN)
    assert accepted.returncode == 0, accepted.stderr[-3000:]
    manifest = json.loads((Path(config["hub_cache"]) / "kvbench-prefetch.json").read_text())
    assert list(manifest["models"]) == [GATED_REPO]

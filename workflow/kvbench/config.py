"""The config's schema and the checks of its general keys that the JSON schema cannot express:
lengths against each model's context and against the documents they are cut from, subsets,
cross-references, files on disk; and the helpers that read models from the config.

Low-level: it imports no stage package. The checks that need one (method settings, the serve and
quality sections, corpus sizes) are collected with these by kvbench.checks, which the workflow runs
while it parses. Every problem is one line that starts with the offending key.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Mapping

import jsonschema
import yaml

from kvbench.sources import ModelSourceError, check_model_dir, package_file


class ConfigError(ValueError):
    pass


def _filling_defaults(cls: Any) -> Any:
    """A validator class that also sets each missing property's schema default (as snakemake's
    `validate` does), descending into defaults it inserted."""
    check_properties = cls.VALIDATORS["properties"]

    def properties(validator: Any, props: Mapping[str, Any], instance: Any, schema: Mapping[str, Any]) -> Any:
        if isinstance(instance, dict):
            for name, sub in props.items():
                if "default" in sub:
                    instance.setdefault(name, copy.deepcopy(sub["default"]))
        yield from check_properties(validator, props, instance, schema)

    return jsonschema.validators.extend(cls, {"properties": properties})


SCHEMA = Path(__file__).resolve().parents[1] / "schemas" / "config.schema.yaml"


def load_configfiles(paths: list[str | Path]) -> dict[str, Any]:
    """The config Snakemake builds from `--configfile A B ...`: each file merged into the ones
    before it as snakemake.utils.update_config merges (a mapping into a mapping key by key at every
    depth, over anything else it replaces it, an empty one changes nothing; any other value, a list
    too, replaces the earlier)."""

    def merge(into: Any, update: Mapping[str, Any]) -> Any:
        for key, value in update.items():
            if not isinstance(into, Mapping):
                into = {}
            into[key] = merge(into.get(key, {}), value) if isinstance(value, Mapping) else value
        return into

    config: dict[str, Any] = {}
    for path in paths:
        loaded = yaml.safe_load(Path(path).read_text())
        if not isinstance(loaded, Mapping):
            raise ConfigError(f"{path}: a config file holds a mapping of keys, not {type(loaded).__name__}")
        config = merge(config, loaded)
    return config


def schema_errors(config: dict[str, Any], schema_path: str | Path) -> list[str]:
    """Every schema violation as one line that starts with the offending key's dotted path.
    Fills in the schema's defaults on the way."""
    schema = yaml.safe_load(Path(schema_path).read_text())
    validator = _filling_defaults(jsonschema.Draft202012Validator)(schema)
    lines = []
    for err in sorted(validator.iter_errors(config), key=lambda e: list(map(str, e.absolute_path))):
        where = ".".join(map(str, err.absolute_path)) or "(top level)"
        lines.append(f"config key {where}: {err.message}")
    return lines


def with_schema_defaults(config: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of (part of) a config with every missing key the schema gives a default filled in."""
    filled = copy.deepcopy(dict(config))
    schema_errors(filled, SCHEMA)
    return filled


def model_dir(config: Mapping[str, Any], name: str) -> str:
    source = config["models"][name]
    return str(source["path"]) if "path" in source else f"resources/models/{name}"


def tokenizer_model(config: Mapping[str, Any]) -> str:
    return str(config["corpus"].get("tokenizer") or config["corpus"]["generator"])


def system_models(config: Mapping[str, Any]) -> list[str]:
    return list(config["system"]["models"])


def model_shape(config: Mapping[str, Any], name: str) -> dict[str, int | None]:
    """`max_context` and `head_dim` of a model: from its folder's config.json once it exists (a
    local path, or prepared under resources/), else the context the config declares (or None)."""
    declared = config["models"][name].get("max_context")
    path = Path(model_dir(config, name)) / "config.json"
    if not path.is_file():
        return {"max_context": declared, "head_dim": None, "declared": declared}
    hf = json.loads(path.read_text())
    hf = hf.get("text_config", hf)  # multimodal configs nest the language model's
    heads = hf.get("num_attention_heads")
    head_dim = hf.get("head_dim") or (hf["hidden_size"] // heads if heads and "hidden_size" in hf else None)
    return {"max_context": hf.get("max_position_embeddings"), "head_dim": head_dim, "declared": declared}


def _document_tokens(config: Mapping[str, Any]) -> dict[str, tuple[str, int]]:
    """Least length of each generated corpus' documents, in tokens, and the key that sets it.
    Synthetic documents are `str(i) + ' ' + 'hi ' * L`: L words, at least L tokens."""
    corpus = config["corpus"]
    return {
        "synthetic": ("corpus.synthetic.words", corpus["synthetic"]["words"]),
        "realistic": ("corpus.realistic.target_tokens", corpus["realistic"]["target_tokens"]),
    }


def reference_problems(config: Mapping[str, Any]) -> list[str]:
    models = sorted(config["models"])
    found = []
    refs = [
        ("corpus.generator", config["corpus"]["generator"]),
        ("corpus.tokenizer", config["corpus"].get("tokenizer")),
        ("kv.model", config["kv"]["model"]),
        ("serve.model", config["serve"]["model"]),
    ]
    refs += [("system.models", name) for name in system_models(config)]
    for key, name in refs:
        if name is not None and name not in config["models"]:
            found.append(f"{key}: {name!r} is not a key of models ({models})")
    for name in config["system"].get("methods", []):
        if name not in config["methods"]:
            found.append(f"system.methods: {name!r} is not a key of methods ({sorted(config['methods'])})")
    baseline = config["report"]["baseline"]
    if baseline not in config["methods"]:
        found.append(f"report.baseline: {baseline!r} is not a key of methods ({sorted(config['methods'])})")
    imported = config["corpus"]["imported"]["path"]
    if "imported" in config["kv"]["corpora"] and not imported:
        found.append("kv.corpora: 'imported' needs corpus.imported.path to be set")
    if "imported" in config["system"]["prompts_per_corpus"] and not imported:
        found.append("system.prompts_per_corpus: 'imported' needs corpus.imported.path to be set")
    return found


def subset_problems(config: Mapping[str, Any], counts: Mapping[str, int]) -> list[str]:
    """Subsets and counts; `counts`: how many documents each generated corpus will hold."""
    kv = config["kv"]
    found = [
        f"kv.{key}: {sorted(set(kv[key]) - set(kv[full]))} not in kv.{full} (the detail tables would be empty)"
        for key, full in (("detail_dtypes", "dtypes"), ("detail_codecs", "codecs"))
        if not set(kv[key]) <= set(kv[full])
    ]
    if kv["figure_codec"] not in kv["codecs"]:
        found.append(f"kv.figure_codec: {kv['figure_codec']!r} is not in kv.codecs")
    realistic = config["corpus"]["realistic"]
    if realistic["min_section_tokens"] > realistic["section_tokens"]:
        found.append(
            f"corpus.realistic.min_section_tokens: {realistic['min_section_tokens']} exceeds "
            f"corpus.realistic.section_tokens ({realistic['section_tokens']})"
        )
    for corpus in kv["corpora"]:
        if corpus in counts and kv["docs_per_corpus"] > counts[corpus]:
            found.append(f"kv.docs_per_corpus: {kv['docs_per_corpus']} exceeds the {counts[corpus]} {corpus} documents")
    for corpus, n in config["system"]["prompts_per_corpus"].items():
        if corpus in counts and n > counts[corpus]:
            found.append(f"system.prompts_per_corpus.{corpus}: {n} exceeds the {counts[corpus]} {corpus} documents")
    serve = config["serve"]
    for key in ("docs_per_corpus", "reference_docs_per_corpus"):
        for corpus in serve["corpora"]:
            if corpus in counts and serve[key] > counts[corpus]:
                found.append(f"serve.{key}: {serve[key]} exceeds the {counts[corpus]} {corpus} documents")
    report = config["report"]
    for key, full in (("kv_dtype", "dtypes"), ("kv_codec", "codecs")):
        if report[key] not in kv[full]:
            found.append(
                f"report.{key}: {report[key]!r} is not in kv.{full} (every KV claim would be 'not measurable')"
            )
    return found


def length_problems(config: Mapping[str, Any]) -> list[str]:
    """Lengths against each model's context, and contexts against the documents they cut."""
    found = []
    shapes = {name: model_shape(config, name) for name in config["models"]}
    for name, shape in shapes.items():
        if shape["declared"] is not None and shape["max_context"] != shape["declared"]:
            found.append(
                f"models.{name}.max_context: declared {shape['declared']}, but the model's config.json "
                f"says {shape['max_context']}"
            )
    vllm, kv, system = config["vllm"], config["kv"], config["system"]
    generator = config["corpus"]["generator"]
    limits = [
        ("vllm.max_model_len", vllm["max_model_len"], generator),
        ("vllm.max_model_len", vllm["max_model_len"], config["serve"]["model"]),
        ("kv.context_tokens", kv["context_tokens"], kv["model"]),
    ]
    longest = max(system["context_tokens"]) + system["max_new_tokens"]
    limits += [("system.context_tokens", longest, name) for name in system_models(config)]
    for key, tokens, name in limits:
        context = shapes.get(name, {}).get("max_context")
        if context is not None and tokens > context:
            extra = " (longest context + system.max_new_tokens)" if key == "system.context_tokens" else ""
            found.append(f"{key}: {tokens} tokens{extra} exceed model {name!r}'s context of {context}")
    serve = config["serve"]
    if serve["doc_tokens"] + serve["max_tokens"] >= vllm["max_model_len"]:
        found.append(
            f"serve.doc_tokens: {serve['doc_tokens']} + serve.max_tokens ({serve['max_tokens']}) leave no room "
            f"for the question within vllm.max_model_len ({vllm['max_model_len']})"
        )
    section = config["corpus"]["realistic"]["section_tokens"]
    if section >= vllm["max_model_len"]:
        found.append(
            f"corpus.realistic.section_tokens: {section} leaves no room for the prompt within "
            f"vllm.max_model_len ({vllm['max_model_len']})"
        )
    documents = _document_tokens(config)
    stages = [
        ("kv", "context_tokens", kv["context_tokens"], kv["corpora"]),
        ("system", "context_tokens", max(system["context_tokens"]), list(system["prompts_per_corpus"])),
    ]
    for stage, key, tokens, corpora in stages:
        if config[stage]["allow_short_documents"]:
            continue
        for corpus in corpora:
            if corpus in documents and documents[corpus][1] < tokens:
                source, length = documents[corpus]
                found.append(
                    f"{stage}.{key}: {tokens} tokens exceed the {corpus} documents ({source}: {length}): "
                    f"they would be compared at different lengths; lengthen the documents, shorten the "
                    f"context, or set {stage}.allow_short_documents: true to accept it"
                )
    return found


def file_problems(config: Mapping[str, Any]) -> list[str]:
    found = []
    for name, source in config["models"].items():
        try:
            if "path" in source:
                check_model_dir(source["path"], f"models.{name}.path")
            elif "gguf_package" in source:
                package_file(source["gguf_package"], source["gguf_file"])
        except ModelSourceError as err:
            found.append(str(err) if "path" in source else f"models.{name}.gguf_package: {err}")
    folder = config["corpus"]["imported"]["path"]
    if folder is not None and not Path(folder).is_dir():
        found.append(f"corpus.imported.path: folder {folder!r} does not exist")
    return found

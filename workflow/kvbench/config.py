"""Checks the JSON schema cannot express (cross-references, files on disk); messages name the key."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import jsonschema
import yaml

from kvbench.methods.kinds import check_spec
from kvbench.sources import ModelSourceError, check_model_dir, package_file


class ConfigError(ValueError):
    pass


def schema_errors(config: Mapping[str, Any], schema_path: str | Path) -> list[str]:
    """Every schema violation as one line that starts with the offending key's dotted path."""
    schema = yaml.safe_load(Path(schema_path).read_text())
    validator = jsonschema.Draft202012Validator(schema)
    lines = []
    for err in sorted(validator.iter_errors(config), key=lambda e: list(map(str, e.absolute_path))):
        where = ".".join(map(str, err.absolute_path)) or "(top level)"
        lines.append(f"config key {where}: {err.message}")
    return lines


def check_schema(config: Mapping[str, Any], schema_path: str | Path) -> None:
    errors = schema_errors(config, schema_path)
    if errors:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(errors))


def model_dir(config: Mapping[str, Any], name: str) -> str:
    source = config["models"][name]
    return str(source["path"]) if "path" in source else f"resources/models/{name}"


def tokenizer_model(config: Mapping[str, Any]) -> str:
    return str(config["corpus"].get("tokenizer") or config["corpus"]["generator"])


def check_config(config: Mapping[str, Any]) -> None:
    for section, key in (("corpus", "generator"), ("corpus", "tokenizer"), ("kv", "model"), ("system", "model")):
        name = config[section].get(key)
        if name is not None and name not in config["models"]:
            raise ConfigError(f"{section}.{key}: {name!r} is not a key of models ({sorted(config['models'])})")
    kv = config["kv"]
    if "imported" in kv.get("corpora", []) and not config["corpus"]["imported"]["path"]:
        raise ConfigError("kv.corpora: 'imported' needs corpus.imported.path to be set")
    for name, spec in config["methods"].items():
        try:
            check_spec(spec)
        except ValueError as err:
            raise ConfigError(f"methods.{name}: {err}") from None
    for name in config["system"].get("methods", []):
        if name not in config["methods"]:
            raise ConfigError(f"system.methods: {name!r} is not a key of methods ({sorted(config['methods'])})")
    for corpus in config["system"].get("prompts_per_corpus", {}):
        if corpus == "imported" and not config["corpus"]["imported"]["path"]:
            raise ConfigError("system.prompts_per_corpus: 'imported' needs corpus.imported.path to be set")
    if kv.get("figure_codec", "zstd-3") not in kv.get("codecs", ["zstd-3"]):
        raise ConfigError(f"kv.figure_codec: {kv['figure_codec']!r} is not in kv.codecs")
    for name, source in config["models"].items():
        if "path" in source:
            check_model_dir(source["path"], f"models.{name}.path")
        elif "gguf_package" in source:
            try:
                package_file(source["gguf_package"], source["gguf_file"])
            except ModelSourceError as err:
                raise ConfigError(f"models.{name}.gguf_package: {err}") from None
    baseline = config.get("report", {}).get("baseline", "full")
    if baseline not in config["methods"]:
        raise ConfigError(f"report.baseline: {baseline!r} is not a key of methods ({sorted(config['methods'])})")
    folder = config["corpus"]["imported"]["path"]
    if folder is not None and not Path(folder).is_dir():
        raise ConfigError(f"corpus.imported.path: folder {folder!r} does not exist")

"""Every problem of a config, found while the workflow parses, before any job starts: the schema
and the general keys (kvbench.config), then the checks that need a stage's or family's own code —
method settings per kind, corpus sizes, the serve and quality sections.

Above the stages on purpose: kvbench.config stays low-level (no stage package imports), and this
module collects from both. Every problem is one line that starts with the offending key; all are
reported at once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from kvbench.config import (
    ConfigError, file_problems, length_problems, model_shape, offline_problems, reference_problems, schema_errors,
    subset_problems, system_models,
)
from kvbench.corpus.factsheets import vocabulary  # each domain's document types
from kvbench.methods.kinds import spec_problems
from kvbench.quality.kinds import quality_problems
from kvbench.serve.backends import servers, unsupported
from kvbench.serve.names import check_codec
from kvbench.serve.protocol import parse_ratio


def _document_counts(config: Mapping[str, Any]) -> dict[str, int]:
    """How many documents each generated corpus will hold (realistic: per type of each domain)."""
    corpus = config["corpus"]
    realistic = corpus["realistic"]
    types = sum(len(vocabulary(domain)["doc_types"]) for domain in realistic["domains"])
    return {"synthetic": corpus["synthetic"]["n_docs"], "realistic": realistic["docs_per_type"] * types}


def _method_problems(config: Mapping[str, Any]) -> list[str]:
    # A setting that depends on the model (KIVI's group_size vs head_dim) is checked against
    # every model the methods run on whose shape is known.
    models = set(system_models(config)) | set(config["quality"]["models"])
    head_dims = {model_shape(config, name)["head_dim"] for name in models if name in config["models"]}
    found = []
    for name, spec in config["methods"].items():
        lines = set()
        for head_dim in head_dims or {None}:
            lines |= set(spec_problems(spec, head_dim))
        found += [f"methods.{name}.{line}" for line in sorted(lines)]
    return found


def _serve_problems(config: Mapping[str, Any]) -> list[str]:
    serve, found = config["serve"], []
    if "imported" in serve["corpora"] and not config["corpus"]["imported"]["path"]:
        found.append("serve.corpora: 'imported' needs corpus.imported.path to be set")
    if "valkey" in serve["backends"] and config["vllm"].get("device") == "cuda":
        found.append("serve.backends: 'valkey' (our connector) reads vLLM's CPU cache layout; "
                     "on GPU the offload backend is 'lmcache'")
    for name in serve["codecs"]:
        try:
            check_codec(name, config["methods"])
        except ValueError as err:
            found.append(f"serve.codecs: {err}")
    try:
        parse_ratio(serve["hit_miss_ratio"])
    except ValueError as err:
        found.append(f"serve.hit_miss_ratio: {err}")
    if serve["fault_round"] and serve["valkey"].get("url"):
        found.append("serve.fault_round: it kills Valkey, so it needs the stage's own (serve.valkey.url: null)")
    return found + _port_problems(config)


def _port_problems(config: Mapping[str, Any]) -> list[str]:
    """A fixed vllm.port is fine for one vLLM server at a time; the serve servers (and the corpus
    generator, when no serve corpus waits for it) can run at once and would collide."""
    port, device = config["vllm"]["port"], config["vllm"]["device"]
    if not port:
        return []
    jobs = [f"serve_server[{s}]" for s in servers(config["serve"]["backends"]) if unsupported(s, device) is None]
    if "realistic" not in config["serve"]["corpora"]:
        jobs.append("corpus_realistic")
    if len(jobs) < 2:
        return []
    return [f"vllm.port: {port} is fixed, but {', '.join(jobs)} each start a vLLM server and can run at once; "
            f"use 0 (a free port per server)"]


def config_problems(config: dict[str, Any], schema_path: str | Path) -> list[str]:
    """Every problem of `config` (schema first; the other checks need its types and defaults)."""
    found = schema_errors(config, schema_path)
    if found:
        return found
    references = reference_problems(config)
    found = references + file_problems(config) + _method_problems(config)
    found += subset_problems(config, _document_counts(config))
    found += _serve_problems(config) + quality_problems(config) + offline_problems(config)
    return found if references else found + length_problems(config)


def check_config(config: dict[str, Any], schema_path: str | Path) -> None:
    """What the workflow runs while it parses: raise one ConfigError listing every problem, each
    naming its key; on success `config` holds the schema's defaults."""
    problems = config_problems(config, schema_path)
    if problems:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(problems))

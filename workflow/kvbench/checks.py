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
    ConfigError,
    file_problems,
    length_problems,
    model_shape,
    reference_problems,
    schema_errors,
    subset_problems,
    system_models,
)
from kvbench.corpus.factsheets import vocabulary  # each domain's document types
from kvbench.methods.kinds import settings_of, spec_problems
from kvbench.quality.kinds import quality_problems
from kvbench.report.bootstrap import MIN_UNITS
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
    for corpus in serve["load"]["corpora"]:
        if corpus not in serve["corpora"]:
            found.append(f"serve.load.corpora: {corpus!r} is not one of serve.corpora {serve['corpora']}")
    levels = list(serve["load"]["concurrency"])
    if levels != sorted(set(levels)):
        # the first level is the interleaved one the overhead verdicts read as the lowest
        found.append(f"serve.load.concurrency: {levels} must be strictly ascending (the first level is the lowest)")
    if 1 < serve["interleave_blocks"] < MIN_UNITS:
        found.append(
            f"serve.interleave_blocks: {serve['interleave_blocks']} blocks give no interval (the verdicts' "
            f"units are the blocks: 1, or {MIN_UNITS} or more)"
        )
    for name in serve["load"].get("codecs") or []:
        if name not in serve["codecs"]:
            found.append(f"serve.load.codecs: {name!r} is not one of serve.codecs {serve['codecs']}")
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
    jobs = [
        f"serve_server[{s}]"
        for s in servers(config["serve"]["backends"], config["serve"]["weights"])
        if unsupported(s, device) is None
    ]
    if "realistic" not in config["serve"]["corpora"]:
        jobs.append("corpus_realistic")
    if len(jobs) < 2:
        return []
    return [
        f"vllm.port: {port} is fixed, but {', '.join(jobs)} each start a vLLM server and can run at once; "
        f"use 0 (a free port per server)"
    ]


QA_CATEGORIES = ("single_doc_qa", "multi_doc_qa")


def _qa_answer_caps(config: Mapping[str, Any]) -> dict[str, int]:
    """Longest answer (tokens) of each QA task the quality stage runs: LongBench's generation length,
    capped by quality.max_gen_cap."""
    from kvbench.hub import lm_eval_task
    from kvbench.quality.kinds import LONGBENCH_CATEGORY, dataset_of
    from kvbench.quality.tasks import multi_doc_qa, single_doc_qa

    quality = config["quality"]
    caps = {
        f"quality.tasks.{spec.category}": int(
            quality["tasks"][spec.category].get("max_gen_tokens", spec.max_gen_tokens)
        )
        for spec in (single_doc_qa.SPEC, multi_doc_qa.SPEC)
        if spec.category in quality["tasks"]
    }
    for task in quality.get("lm_eval_tasks") or []:
        if LONGBENCH_CATEGORY.get(dataset_of(task)) in QA_CATEGORIES:
            caps[f"quality.lm_eval_tasks: {task}"] = int(lm_eval_task(task)["generation_kwargs"]["max_gen_toks"])
    return {key: min(cap, int(quality["max_gen_cap"])) for key, cap in caps.items()}


def _cam_problems(config: Mapping[str, Any]) -> list[str]:
    """A CaM that compresses only while decoding first compresses after `interval` decode steps; an
    answer of N tokens takes N - 1 of them. Where that never comes, cam is `full` by construction."""
    decode_only = {
        name: spec
        for name in config["quality"]["methods"]
        if (spec := config["methods"].get(name))
        and spec["kind"] == "cam"
        and "target" in spec
        and not {"keep_ratio", "capacity"} & set(spec)
        and not spec_problems(spec)  # an invalid entry is reported as such
    }
    if not decode_only:
        return []
    caps = _qa_answer_caps(config)
    found = []
    for name, spec in decode_only.items():
        interval = settings_of(spec).interval
        late = [key for key, cap in caps.items() if interval > cap - 1]
        if late:
            found.append(
                f"methods.{name}.interval: {interval} decode steps before CaM's first "
                f"compression, but {', '.join(late)} answer in at most {min(caps[k] for k in late)} tokens: "
                f"{name} would equal full there by construction; lower the interval (or leave QA out)"
            )
    return found


def config_problems(config: dict[str, Any], schema_path: str | Path) -> list[str]:
    """Every problem of `config` (schema first; the other checks need its types and defaults)."""
    found = schema_errors(config, schema_path)
    if found:
        return found
    references = reference_problems(config)
    methods, quality = _method_problems(config), quality_problems(config)
    found = references + file_problems(config) + methods + subset_problems(config, _document_counts(config))
    found += _serve_problems(config) + quality
    found += [] if methods or quality else _cam_problems(config)  # needs valid methods and tasks
    return found if references else found + length_problems(config)


def check_config(config: dict[str, Any], schema_path: str | Path) -> None:
    """What the workflow runs while it parses: raise one ConfigError listing every problem, each
    naming its key; on success `config` holds the schema's defaults."""
    problems = config_problems(config, schema_path)
    if problems:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(problems))

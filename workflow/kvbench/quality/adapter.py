"""The `kvbench` model for lm-eval: every request runs through kvbench's harness with a fresh cache
of one KV method, as LongBench's pred.py prepares it.

Per request: LongBench's middle truncation of the prompt tokens (lm-eval itself would cut from
the left), then the chat template (not for LongBench's few-shot and code tasks), then greedy
generation capped at `max_gen_cap` tokens, stopping at the task's stop strings after leading
newlines (LongBench's first-line rule). The adapter records, per request, TTFT, TPOT, measured KV
bytes and, given the full cache's references, fidelity to them (a sample the reference failed on
is still generated and scored, with `fidelity_note` saying why it has no fidelity). One excluded
warm-up precedes the first timed request. Requests never share a cache, and
lm-eval's response cache is not used: it is keyed by the request, not by the method.

By name, through lm-eval's own API (after `import kvbench.quality`, which registers it):
`simple_evaluate(model="kvbench", model_args="model=<folder>,method=kivi4,config=config/config.yaml", ...)`.
`model` is a Hugging Face model folder; the method's spec is the config file's `methods:` entry of
that name (its `seed` and `quality:` settings apply too) with any inline settings (`bits=2`) over
it, or, without a config entry, the inline settings alone (`method=mine,kind=kivi,bits=4`). The rest
defaults to the pipeline's: float32 on the CPU, LongBench's own maximum generation lengths (no cap),
middle truncation at the model's context - 500, and LongBench's chat-template rule per task name.
"""

from __future__ import annotations

import gc
import importlib
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Mapping

from lm_eval.api.instance import Instance
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from kvbench.harness import context_bucket, generate_scored
from kvbench.prompts import chat_ids
from kvbench.quality.fidelity import Reference, compare, prompt_hash, reference_from_logits

RECORD_KEYS = ("ttft_s", "tpot_s", "e2e_s", "forward_s", "new_tokens", "kv_bytes_prefill", "kv_bytes_end",
               "full16_bytes_prefill", "full16_bytes_end", "ratio_prefill", "ratio_end", "first_divergence")


# model_args the by-name path reads itself; any other is a setting of the method's spec.
OPTIONS = ("model", "method", "config", "seed", "max_gen_cap", "max_prompt_tokens", "dtype", "device", "top_k",
           "plain_tasks")
NO_CAP = 1 << 30  # LongBench's own maximum generation length decides


def uses_chat(task: str) -> bool:
    """LongBench's rule (pred.py) for a task named by lm-eval: no chat template for its few-shot and
    code datasets (lm-eval's `longbench_*` and kvbench's imported `kvbench_longbench_*` tasks), and
    for kvbench's own tasks what the task's builder says; the chat template otherwise."""
    from kvbench.quality.kinds import LONGBENCH_CATEGORY, dataset_of
    from kvbench.quality.longbench import NO_CHAT

    name = task.removeprefix("kvbench_")
    dataset = dataset_of(name)
    if name.startswith("longbench_") and dataset in LONGBENCH_CATEGORY:
        return dataset not in NO_CHAT
    try:
        return bool(importlib.import_module(f"kvbench.quality.tasks.{name}").SPEC.chat)
    except ModuleNotFoundError:
        return True


def method_spec(method: str, config: Mapping[str, Any] | None, inline: Mapping[str, Any]) -> dict[str, Any]:
    """The config's entry for `method` with `inline` settings over it, checked as the config is."""
    from kvbench.methods.kinds import check_spec

    methods = (config or {}).get("methods") or {}
    if method not in methods and "kind" not in inline:
        known = f" (the config's: {', '.join(sorted(methods))})" if methods else ""
        raise ValueError(f"kvbench: method {method!r} is not in the config's methods{known}; name one, or give its "
                         "settings inline (kind=...,bits=...)")
    spec = {**methods.get(method, {}), **inline}
    check_spec(spec)
    return spec


def reference_key(task: str, doc_id: int) -> str:
    return f"{task}/{doc_id}"


def visible(text: str, until: list[str]) -> str:
    """Leading newlines do not end an answer that stops at a newline (LongBench's first line)."""
    return text.lstrip("\n") if "\n" in until else text


def cut_at_stop(text: str, until: list[str]) -> str:
    """The answer up to the first stop string."""
    text = visible(text, until)
    for stop in until:
        text = text.split(stop)[0]
    return text


@register_model("kvbench")
class KvbenchLM(LM):
    def __init__(
        self, model: Any, tokenizer: Any, method: str, spec: dict[str, Any], *, seed: int, max_gen_cap: int,
        max_prompt_tokens: int, plain_tasks: frozenset[str] | None = frozenset(),
        references: dict[str, Reference] | None = None, keep_references: bool = False, top_k: int | None = None,
    ) -> None:
        super().__init__()
        self.model, self.tokenizer, self.method, self.spec = model, tokenizer, method, spec
        self.seed, self.max_gen_cap, self.max_prompt_tokens = seed, max_gen_cap, max_prompt_tokens
        self.plain_tasks, self.references, self.keep_references = plain_tasks, references, keep_references
        self.top_k = top_k
        self.records: dict[str, dict[str, Any]] = {}
        self.new_references: dict[str, Reference] = {}
        self.max_context = int(model.config.max_position_embeddings)
        self.warm = False

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> "KvbenchLM":
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> "KvbenchLM":
        """The by-name path (module docstring): load the folder's model and tokenizer, resolve the
        method's spec, take the rest from the config's `quality:` section or the defaults."""
        import torch
        import yaml

        from kvbench.models import load_model, load_tokenizer
        from kvbench.quality.run import max_prompt_tokens

        args = dict(arg_dict)
        if "model" not in args or "method" not in args:
            raise ValueError("kvbench: model_args needs model=<model folder> and method=<name>")
        config = yaml.safe_load(Path(args["config"]).read_text()) if args.get("config") else {}
        quality = config.get("quality") or {}
        inline = {k: v for k, v in args.items() if k not in OPTIONS}
        method = str(args["method"])
        spec = method_spec(method, config, inline)
        seed = int(args.get("seed", config.get("seed", 0)))
        device = str(args.get("device") or (additional_config or {}).get("device") or quality.get("device", "cpu"))
        dtype = getattr(torch, str(args.get("dtype", quality.get("compute_dtype", "float32"))))
        model = load_model(args["model"], "real", seed, dtype, device)
        cap = args.get("max_gen_cap", quality.get("max_gen_cap"))
        prompt_cap = args.get("max_prompt_tokens", quality.get("max_prompt_tokens"))
        plain = args.get("plain_tasks")
        return cls(model, load_tokenizer(args["model"]), method, spec, seed=seed,
                   max_gen_cap=int(cap) if cap else NO_CAP,
                   max_prompt_tokens=max_prompt_tokens({"max_prompt_tokens": prompt_cap}, model),
                   plain_tasks=frozenset(str(plain).split("|")) if plain else None,
                   top_k=args.get("top_k", quality.get("reference_top_k")))

    def loglikelihood(self, requests: list[Instance]) -> list[tuple[float, bool]]:
        raise NotImplementedError("the kvbench model runs generation tasks (LongBench) only")

    def loglikelihood_rolling(self, requests: list[Instance]) -> list[float]:
        raise NotImplementedError("the kvbench model runs generation tasks (LongBench) only")

    def warm_up(self, ids: list[int]) -> None:
        """One excluded run before the first timed request (as the system stage's `run_row`), so the
        first sample's TTFT carries no one-off initialisation; long enough to pass the quantizers'
        residual windows."""
        if not self.warm:
            generate_scored(self.model, self.spec, ids[:256], 2, seed=self.seed)
            self.warm = True
            gc.collect()

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        return [self._answer(i, len(requests), request) for i, request in enumerate(requests, start=1)]

    def prompt(self, task: str, text: str) -> tuple[list[int], int, bool]:
        """Token ids after LongBench's middle truncation and (unless a plain task) the chat template."""
        raw = self.tokenizer(text).input_ids
        truncated = len(raw) > self.max_prompt_tokens
        if truncated:  # as LongBench's pred.py: decode both halves, join the text
            half = self.max_prompt_tokens // 2
            text = (self.tokenizer.decode(raw[:half], skip_special_tokens=True)
                    + self.tokenizer.decode(raw[-half:], skip_special_tokens=True))
        plain = task in self.plain_tasks if self.plain_tasks is not None else not uses_chat(task)
        ids = list(self.tokenizer(text).input_ids) if plain else chat_ids(self.tokenizer, text)
        return ids, len(raw), truncated

    def _answer(self, i: int, total: int, request: Instance) -> str:
        text, gen_kwargs = request.args
        task, key = request.task_name, reference_key(request.task_name, request.doc_id)
        until = [u for u in (gen_kwargs.get("until") or []) if u]
        longbench_max = int(gen_kwargs.get("max_gen_toks", self.max_gen_cap))
        record: dict[str, Any] = {"max_gen_tokens": longbench_max, "max_gen_cap": self.max_gen_cap,
                                  "max_new_tokens": min(longbench_max, self.max_gen_cap), "error": None,
                                  "fidelity_note": None}
        self.records[key] = record
        start = time.monotonic()
        answer, reference, result = "", None, None
        try:
            ids, raw_tokens, truncated = self.prompt(task, text)
            record |= {"prompt_tokens": raw_tokens, "truncated": truncated, "context_tokens": len(ids),
                       "bucket": context_bucket(len(ids), self.max_context)}
            reference = self.references.get(key) if self.references is not None else None
            if self.references is not None and reference is None:  # the reference run failed on this sample
                record["fidelity_note"] = "fidelity: no full-cache reference (the reference failed on this sample)"
            if reference is not None and reference.prompt_hash != prompt_hash(ids):
                raise ValueError(f"the reference for {key} answered another prompt: rerun the reference job")

            def stop(tokens: list[int]) -> bool:
                text = visible(self.tokenizer.decode(tokens, skip_special_tokens=True), until)
                return any(u in text for u in until)

            self.warm_up(ids)
            result = generate_scored(self.model, self.spec, ids, record["max_new_tokens"],
                                     reference=reference.tokens if reference else None,
                                     stop=stop if until else None, seed=self.seed)
            answer = cut_at_stop(self.tokenizer.decode(result["tokens"], skip_special_tokens=True), until)
            record |= {k: result[k] for k in RECORD_KEYS} | {"output_ids": result["tokens"]}
            if not answer.strip():
                record["error"] = "empty output"
        except Exception as err:  # an OOM or a method failure on this sample: a row with its error
            traceback.print_exc()
            record["error"] = f"{type(err).__name__}: {err}"
            gc.collect()
            result = None
        if result is not None:
            try:  # a failure here loses the fidelity, not the prediction
                if reference is not None:
                    record |= compare(reference, result["logits"])
                if self.keep_references:
                    self.new_references[key] = reference_from_logits(result["tokens"], result["logits"], ids, self.top_k)
            except Exception as err:
                traceback.print_exc()
                record["fidelity_note"] = f"fidelity: {type(err).__name__}: {err}"
        status = record["error"] or f"{record.get('context_tokens')} tokens, {record.get('new_tokens')} new"
        status += f"; {record['fidelity_note']}" if record["fidelity_note"] else ""
        print(f"[quality] {self.method} {i}/{total} {key}: {status} ({time.monotonic() - start:.1f} s)",
              file=sys.stderr, flush=True)
        return answer

"""The `kvbench` model for lm-eval: lm-eval builds the requests from its task files; every request
runs through kvbench's engine (kvbench.quality.engine) with each configured KV method and protocol,
as LongBench's pred.py prepares it.

Per request: LongBench's middle truncation of the prompt tokens (lm-eval itself would cut from the
left), then the chat template (not for LongBench's few-shot and code tasks), then greedy generation
capped at `max_gen_cap` tokens, stopping at the task's stop strings after leading newlines
(LongBench's first-line rule). lm-eval receives the first method's answers under the first protocol;
the others are kept (`answers`, `records`) and scored by kvbench.quality.run through each task's own
`process_results`. Requests never share a cache, and lm-eval's response cache is not used: it is
keyed by the request, not by the method.

By name, through lm-eval's own API (after `import kvbench.quality`, which registers it):
`simple_evaluate(model="kvbench", model_args="model=<folder>,method=kivi4,config=config/config.yaml", ...)`.
`model` is a Hugging Face model folder; the method's spec is the config file's `methods:` entry of
that name (its `seed` and `quality:` settings apply too) with any inline settings (`bits=2`) over
it, or, without a config entry, the inline settings alone (`method=mine,kind=kivi,bits=4`). The rest
defaults to the pipeline's: float32 on the CPU, LongBench's own maximum generation lengths (no cap),
middle truncation at the model's context - 500, LongBench's chat-template rule per task name, and
the query-aware protocol (`protocol=context_only` for the other).
"""

from __future__ import annotations

import gc
import importlib
import sys
import time
from pathlib import Path
from typing import Any, Mapping

from lm_eval.api.instance import Instance
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from kvbench.fidelity import Reference
from kvbench.harness import context_bucket
from kvbench.prompts import chat_ids
from kvbench.quality import engine
from kvbench.quality.engine import QUERY_AWARE, Prompt

# model_args the by-name path reads itself; any other is a setting of the method's spec.
OPTIONS = (
    "model",
    "method",
    "config",
    "seed",
    "max_gen_cap",
    "max_prompt_tokens",
    "dtype",
    "device",
    "top_k",
    "plain_tasks",
    "protocol",
)
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
        raise ValueError(
            f"kvbench: method {method!r} is not in the config's methods{known}; name one, or give its "
            "settings inline (kind=...,bits=...)"
        )
    spec = {**methods.get(method, {}), **inline}
    check_spec(spec)
    return spec


def prompt_key(task: str, doc: Mapping[str, Any] | None, doc_id: int) -> str:
    """A sample's key: its task and its record's `_id` (LongBench's and kvbench's records have one),
    else lm-eval's document index."""
    return f"{task}/{(doc or {}).get('_id', doc_id)}"


def visible(text: str, until: list[str]) -> str:
    """Leading newlines do not end an answer that stops at a newline (LongBench's first line)."""
    return text.lstrip("\n") if "\n" in until else text


def prompt_ids(tokenizer: Any, text: str, chat: bool) -> list[int]:
    """The prompt's token ids: the chat template's rendering (as vLLM's chat endpoint applies it),
    or the plain text for LongBench's few-shot and code tasks."""
    return chat_ids(tokenizer, text) if chat else list(tokenizer(text).input_ids)


def reaches_stop(tokenizer: Any, tokens: list[int], until: list[str]) -> bool:
    """Whether an answer of `tokens` has reached one of the task's stop strings (the harness ends
    its generation there)."""
    return any(u in visible(tokenizer.decode(tokens, skip_special_tokens=True), until) for u in until)


def cut_at_stop(text: str, until: list[str]) -> str:
    """The answer up to the first stop string."""
    text = visible(text, until)
    for stop in until:
        text = text.split(stop)[0]
    return text


def split_point(
    tokenizer: Any, text: str, ids: list[int], chat: bool, context: str | None
) -> tuple[int | None, str | None]:
    """How many of the prompt's tokens are its context (everything up to the end of the document(s);
    the question and the instructions after it follow): (tokens, None), or (None, why not).

    The context's last characters are found in the prompt text; a token that straddles that point
    belongs to the question part. `ids` must be what `text` tokenizes to (chat template applied)."""
    if not context:
        return None, "the sample has no context field"
    tail = context.rstrip()[-64:]
    end = text.rfind(tail)
    if end < 0:
        return None, "the context's end was truncated away"
    end += len(tail)
    full = (
        tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
        if chat
        else text
    )
    offset = full.find(text) if chat else 0
    encoded = tokenizer(full, add_special_tokens=not chat, return_offsets_mapping=True)
    if list(encoded.input_ids) != ids:
        return None, "the prompt does not re-tokenize to its ids"
    boundary = offset + end
    split = next((i for i, (_, stop) in enumerate(encoded.offset_mapping) if stop > boundary), len(ids))
    if not 0 < split < len(ids):
        return None, f"no question after the context (split at {split} of {len(ids)} tokens)"
    return split, None


@register_model("kvbench")
class KvbenchLM(LM):
    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        methods: Mapping[str, dict[str, Any]],
        *,
        seed: int,
        max_gen_cap: int,
        max_prompt_tokens: int,
        plain_tasks: frozenset[str] | None = frozenset(),
        protocols: tuple[str, ...] = (QUERY_AWARE,),
        reference: str | None = None,
        references: dict[str, Reference] | None = None,
        top_k: int | None = None,
        fidelity_positions: int | None = None,
        prompts_per_batch: int = 8,
        max_rows: int = 64,
    ) -> None:
        super().__init__()
        self.model, self.tokenizer, self.methods = model, tokenizer, dict(methods)
        self.seed, self.max_gen_cap, self.max_prompt_tokens = seed, max_gen_cap, max_prompt_tokens
        self.plain_tasks, self.protocols, self.reference = plain_tasks, tuple(protocols), reference
        self.references, self.top_k, self.fidelity_positions = references, top_k, fidelity_positions
        self.prompts_per_batch, self.max_rows = prompts_per_batch, max_rows
        self.prompt_info: dict[str, dict[str, Any]] = {}  # by prompt key
        self.outcomes: dict[tuple[str, str, str], engine.Outcome] = {}
        self.until: dict[str, list[str]] = {}
        self.new_references: dict[str, Reference] = {}
        self.max_context = int(model.config.max_position_embeddings)
        self.cost = engine.Cost()  # the timed runs' (the warm-up's is left out)
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
        return cls(
            model,
            load_tokenizer(args["model"]),
            {method: spec},
            seed=seed,
            protocols=(str(args.get("protocol", QUERY_AWARE)),),
            max_gen_cap=int(cap) if cap else NO_CAP,
            max_prompt_tokens=max_prompt_tokens({"max_prompt_tokens": prompt_cap}, model),
            plain_tasks=frozenset(str(plain).split("|")) if plain else None,
            top_k=args.get("top_k", quality.get("reference_top_k")),
        )

    def loglikelihood(self, requests: list[Instance]) -> list[tuple[float, bool]]:
        raise NotImplementedError("the kvbench model runs generation tasks (LongBench) only")

    def loglikelihood_rolling(self, requests: list[Instance]) -> list[float]:
        raise NotImplementedError("the kvbench model runs generation tasks (LongBench) only")

    def prompt(self, task: str, text: str) -> tuple[list[int], str, int, bool]:
        """Token ids after LongBench's middle truncation and (unless a plain task) the chat template;
        the text they come from, the prompt's tokens before truncation, and whether it was cut."""
        raw = self.tokenizer(text).input_ids
        truncated = len(raw) > self.max_prompt_tokens
        if truncated:  # as LongBench's pred.py: decode both halves, join the text
            half = self.max_prompt_tokens // 2
            text = self.tokenizer.decode(raw[:half], skip_special_tokens=True) + self.tokenizer.decode(
                raw[-half:], skip_special_tokens=True
            )
        ids = prompt_ids(self.tokenizer, text, self.chat(task))
        return ids, text, len(raw), truncated

    def chat(self, task: str) -> bool:
        """Whether `task`'s prompts take the chat template: the pipeline says which tasks are plain;
        by name, LongBench's rule (`uses_chat`)."""
        return task not in self.plain_tasks if self.plain_tasks is not None else uses_chat(task)

    def _prepare(self, request: Instance) -> Prompt:
        text, gen_kwargs = request.args
        task, key = request.task_name, prompt_key(request.task_name, request.doc, request.doc_id)
        until = [u for u in (gen_kwargs.get("until") or []) if u]
        longbench_max = int(gen_kwargs.get("max_gen_toks", self.max_gen_cap))
        ids, final, raw_tokens, truncated = self.prompt(task, text)
        split, note = split_point(self.tokenizer, final, ids, self.chat(task), (request.doc or {}).get("context"))
        self.until[key] = until
        self.prompt_info[key] = {
            "max_gen_tokens": longbench_max,
            "max_gen_cap": self.max_gen_cap,
            "max_new_tokens": min(longbench_max, self.max_gen_cap),
            "prompt_tokens": raw_tokens,
            "truncated": truncated,
            "context_tokens": len(ids),
            "question_tokens": len(ids) - split if split else None,
            "bucket": context_bucket(len(ids), self.max_context),
        }

        def stop(tokens: list[int]) -> bool:
            return reaches_stop(self.tokenizer, tokens, until)

        return Prompt(key, ids, split, self.prompt_info[key]["max_new_tokens"], stop if until else None, note)

    def warm_up(self, prompt: Prompt) -> None:
        """One excluded run of every method and protocol on the first prompt's first 256 tokens (2 new
        tokens) before the first timed one: one-off initialisations (kernel builds, allocator growth)
        are not timed."""
        if self.warm:
            return
        ids = prompt.ids[:256]
        split = min(prompt.split or len(ids) - 8, len(ids) - 8)
        engine.run(
            self.model,
            [Prompt("warm-up", ids, split if split > 0 else None, 2)],
            self.methods,
            protocols=self.protocols,
            seed=self.seed,
            reference=self.reference,
            log=lambda _: None,
        )
        self.warm = True
        gc.collect()

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        prompts = [self._prepare(r) for r in requests]
        if prompts:
            self.warm_up(prompts[0])
        start = time.monotonic()
        self.outcomes, self.new_references = engine.run(
            self.model,
            prompts,
            self.methods,
            protocols=self.protocols,
            seed=self.seed,
            reference=self.reference,
            references=self.references,
            top_k=self.top_k,
            fidelity_positions=self.fidelity_positions,
            prompts_per_batch=self.prompts_per_batch,
            max_rows=self.max_rows,
            cost=self.cost,
        )
        cost = self.cost
        print(
            f"[quality] {len(prompts)} prompts x {len(self.methods)} methods x {len(self.protocols)} protocols in "
            f"{time.monotonic() - start:.0f} s: prefill {cost.prefill_s:.0f} s, forks {cost.fork_s:.0f} s, questions "
            f"{cost.question_s:.0f} s, decode {cost.decode.seconds:.0f} s ({cost.decode.steps} steps, "
            f"{cost.decode.row_steps} row-steps)",
            file=sys.stderr,
            flush=True,
        )
        first = next(iter(self.methods))
        return [self.answer(first, self.protocols[0], p.key) for p in prompts]

    def answer(self, method: str, protocol: str, key: str) -> str:
        outcome = self.outcomes[(method, protocol, key)]
        text = self.tokenizer.decode(outcome.tokens, skip_special_tokens=True) if outcome.error is None else ""
        return cut_at_stop(text, self.until[key])

    def record(self, method: str, protocol: str, key: str) -> dict[str, Any]:
        """Everything measured for one sample of one method under one protocol."""
        outcome = self.outcomes[(method, protocol, key)]
        record = {
            **self.prompt_info[key],
            "fidelity_note": None,
            **outcome.record,
            "error": outcome.error,
            "output_ids": outcome.tokens if outcome.error is None else None,
        }
        if outcome.error is None and not self.answer(method, protocol, key).strip():
            record["error"] = "empty output"
        return record

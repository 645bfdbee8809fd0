"""The quality tasks on the engine: vLLM's own quantized KV caches (kvbench.vllm_native) scored
through lm-eval's OpenAI-compatible API models against the server, with fidelity to the 16-bit
server from the log-probabilities the servers return. Engine numbers, labelled as such next to
the harness's methods (`engine: vllm`).

Per server (the 16-bit reference first, then each `quality.served.servers` label), one at a
time: lm-eval's `local-chat-completions` for the tasks LongBench gives the chat template (the
server applies it) and `local-completions` for its plain ones, greedy, up to the harness's
generation length (min(LongBench's, `max_gen_cap`)); the server generates that many tokens and
the answer is cut at the task's stop strings after leading newlines as the harness cuts it, then
scored by the task's own `process_results`. Fidelity: the reference server's greedy continuation
(up to where the harness's reference would stop: the token that reaches a stop string) is
teacher-forced through every server in one request (`prompt_logprobs`: each position's top-k given
the prompt and the continuation before it), KL(reference || server) over the tokens both top-k
lists hold plus the rest (kvbench.fidelity.kl_top_lists, a lower bound, coarser than the harness's
KL over the reference's top-k) and top-1 agreement, pooled as the harness pools them (position 0
apart as `kl_first`), over the harness's positions per sample (`quality.fidelity_positions`).
Decode-time fidelity too: each server generates those tokens greedily with its top-k per step, and
KL is taken at the steps both servers took from the same context (up to the first divergence):
`decode_kl_mean`, read from the cache as decode steps read it, where a backend's prefill does not
(TurboQuant); `prefill_decode_kl` compares the server's forced and decode views of the same context.
The reference server runs its forced and decode requests twice: its own rows hold the second
against the first, the engine's run-to-run noise (batching), which the report pairs each server with.

What differs from the harness: no middle truncation (a sample whose prompt and answer exceed the
server's context gets its row with the reason), vLLM's kernels and the served dtype instead of
float32 torch, the chat template rendered by the server, and the forced positions computed in one
prefill: vLLM's CPU, FlashAttention and Triton backends read the quantized cache there as a decode
step would, its TurboQuant backend attends to the raw K/V in a request's first prefill chunk (its
rows say so in `fidelity_note`).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

from kvbench.fidelity import kl_top_lists, summarize
from kvbench.quality.adapter import cut_at_stop, prompt_ids, reaches_stop
from kvbench.quality.run import open_tasks, seeds
from kvbench.quality.taskfiles import metric_key
from kvbench.serve.backends import NATIVE, served_dtype, unsupported
from kvbench.vllm_server import SERVED_NAME, VLLMClient, vllm_server

ENGINE = "vllm"
API_LOGGER = "lm_eval.models.api_models"  # where lm-eval's API models log
PREFILL_BYPASS = (
    "vLLM's TurboQuant attention computes a request's first prefill chunk from the raw K/V: the "
    "forced positions (kl_mean, kl_first, top1_agreement) do not read the compressed cache; its decode "
    "steps do (decode_kl_mean, before the first divergence)"
)
COLUMNS = (
    "server", "engine", "kv_cache_dtype", "nearest", "difference", "served_dtype", "dtype_note", "reference_server",
    "top_k", "task", "category", "metric", "longbench", "max_new_tokens", "sample_id", "lm_eval_doc_id",
    "prediction", "score", "metric_score", "error", "prompt_tokens", "kl_first", "kl_mean", "kl_max",
    "top1_agreement", "fidelity_positions", "decode_kl_mean", "decode_positions", "first_divergence",
    "prefill_decode_kl", "reference_continuation", "fidelity_error", "fidelity_note",
)  # fmt: skip


def reference_label(dtype: str) -> str:
    return f"{ENGINE}-{dtype}"


def server_settings(vllm: Mapping[str, Any], dtype: str, label: str | None, top_k: int) -> dict[str, Any]:
    """A server for these requests: nothing cached across requests (every prompt computed in its
    own request, through the KV cache under test), `top_k` log-probabilities allowed, vLLM's
    sampling defaults."""
    # vLLM's own sampling defaults, not the model's generation_config (a repetition penalty there
    # would reach these requests and not the harness's greedy decode)
    args = list(vllm.get("extra_args", [])) + [
        "--no-enable-prefix-caching", "--max-logprobs", str(top_k), "--generation-config", "vllm",
    ]  # fmt: skip
    if label is not None:
        args += ["--kv-cache-dtype", NATIVE[label].dtype]
    return {**vllm, "dtype": dtype, "extra_args": args}


class _Redact(logging.Filter):
    """Drops `secret` from a record's text: lm-eval's async client logs a failed request's
    exception, whose repr holds the request's headers (the API key among them)."""

    def __init__(self, secret: str) -> None:
        super().__init__()
        self.secret = secret

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if self.secret and self.secret in text:
            record.msg, record.args = text.replace(self.secret, "<redacted>"), None
        return True


@contextmanager
def _api_key(key: str) -> Iterator[None]:
    """lm-eval's API models read the key from OPENAI_API_KEY (a model argument would be logged);
    their logger's records lose it while it is set."""
    old = os.environ.get("OPENAI_API_KEY")
    os.environ["OPENAI_API_KEY"] = key
    redact, logger = _Redact(key), logging.getLogger(API_LOGGER)
    logger.addFilter(redact)
    try:
        yield
    finally:
        logger.removeFilter(redact)
        if old is None:
            os.environ.pop("OPENAI_API_KEY", None)
        else:
            os.environ["OPENAI_API_KEY"] = old


def lm_eval_answers(
    client: VLLMClient,
    task: str,
    info: Mapping[str, Any],
    max_new: int,
    manager: Any,
    samples: list[int] | None,
    seed: int,
    concurrency: int = 1,
) -> list[dict[str, Any]]:
    """One task through lm-eval against the server: per sample its doc and answer."""
    from lm_eval import simple_evaluate

    chat = bool(info["chat"])
    endpoint = "chat/completions" if chat else "completions"
    model_args = {
        "model": SERVED_NAME,
        "base_url": f"{client.base_url}/v1/{endpoint}",
        "tokenizer_backend": None,
        "num_concurrent": concurrency,
        "max_retries": 1,
        "timeout": int(client.idle_timeout_s),
        "seed": seed,
    }
    with _api_key(client.api_key or ""):
        results = simple_evaluate(
            model="local-chat-completions" if chat else "local-completions",
            model_args=model_args,
            tasks=[task],
            task_manager=manager,
            apply_chat_template=chat,
            # greedy (the task files' temperature 1 means greedy only with do_sample off, which the
            # API models drop), no stop strings: the harness's first-line cut is applied after
            gen_kwargs={"until": [], "max_gen_toks": max_new, "temperature": 0},
            samples={task: samples} if samples is not None else None,
            log_samples=True,
            bootstrap_iters=0,
            **seeds(seed),
        )
    return [
        {
            "doc": s["doc"],
            "doc_id": int(s["doc_id"]),
            "answer": cut_at_stop(s["resps"][0][0] or "", list(info["until"])),
        }
        for s in results["samples"][task]
    ]


def continuation(
    client: VLLMClient, ids: list[int], n: int, top_k: int, seed: int
) -> tuple[list[int], list[dict[int, float]]]:
    """The server's greedy continuation of `ids`, up to `n` tokens (fewer at end of sequence), and
    each decode step's top-k log-probabilities as the server computed them while generating."""
    reply = client.complete(
        prompt=ids, max_tokens=n, temperature=0, seed=seed, logprobs=top_k, return_tokens_as_token_ids=True
    )
    steps = reply["choices"][0]["logprobs"]
    lists = [{_token_id(t): float(v) for t, v in (entry or {}).items()} for entry in steps["top_logprobs"]]
    return [_token_id(t) for t in steps["tokens"]], lists


def _token_id(text: str) -> int:
    return int(text.removeprefix("token_id:"))


def decode_fidelity(
    reference: list[int],
    reference_steps: list[dict[int, float]],
    tokens: list[int],
    steps: list[dict[int, float]],
    forced_lists: list[dict[int, float]],
) -> dict[str, Any]:
    """KL(reference || server) at the decode steps both servers took from the same context: up to
    and including the first position where their greedy tokens differ (position 0, the prefill's,
    left out as `kl_mean` leaves it out). `first_divergence`: that position, None where the server
    produced the reference's tokens. `prefill_decode_kl`: KL(the server's forced lists || its own
    decode steps) at those positions, the same context read by a prefill and by decode steps."""
    agreed = next((i for i, (a, b) in enumerate(zip(reference, tokens)) if a != b), None)
    last = min(len(reference), len(tokens)) - 1 if agreed is None else agreed
    positions = range(1, last + 1)
    kl = [kl_top_lists(reference_steps[i], steps[i]) for i in positions]
    gap = [kl_top_lists(forced_lists[i], steps[i]) for i in positions]
    return {
        "decode_kl_mean": sum(kl) / len(kl) if kl else None,
        "decode_positions": len(kl),
        "first_divergence": agreed,
        "prefill_decode_kl": sum(gap) / len(gap) if gap else None,
    }


def forced(client: VLLMClient, ids: list[int], tokens: list[int], top_k: int, seed: int) -> list[dict[int, float]]:
    """Each position's top-k log-probabilities with `tokens` teacher-forced after `ids`: position i
    predicts tokens[i] from the prompt and tokens[:i]."""
    reply = client.complete(prompt=ids + tokens, max_tokens=1, temperature=0, seed=seed, prompt_logprobs=top_k)
    lists = reply["choices"][0]["prompt_logprobs"][len(ids) : len(ids) + len(tokens)]
    return [{int(t): float(v["logprob"]) for t, v in (entry or {}).items()} for entry in lists]


def fidelity(reference: list[dict[int, float]], method: list[dict[int, float]], tokens: list[int]) -> dict[str, Any]:
    kl = [kl_top_lists(r, m) for r, m in zip(reference, method)]
    top1 = [max(m, key=m.get) == t for m, t in zip(method, tokens)]
    return summarize(kl, top1)


@dataclass
class _Pass:
    """What every server's requests share: the tasks, the settings, and the reference server's
    continuations and top-k lists by (task, lm-eval doc id) once it has run."""

    tokenizer: Any
    manager: Any
    tasks: dict[str, dict[str, Any]]
    task_objects: dict[str, Any]
    drawn: dict[str, list[int]]
    max_gen_cap: int | None
    fidelity_positions: int | None  # the harness's teacher-forced positions per sample (None: all)
    top_k: int
    concurrency: int
    seed: int
    max_model_len: int
    prompts: dict[tuple[str, int], list[int]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)  # one fast tokenizer, many threads
    continuations: dict[tuple[str, int], list[int]] = field(default_factory=dict)
    reference_lists: dict[tuple[str, int], list[dict[int, float]]] = field(default_factory=dict)
    decode_lists: dict[tuple[str, int], list[dict[int, float]]] = field(default_factory=dict)  # the reference's

    def max_new(self, task: str) -> int:
        longbench = int(self.tasks[task]["max_gen_tokens"])
        return min(longbench, self.max_gen_cap) if self.max_gen_cap else longbench

    def prompt(self, task: str, doc_id: int, doc: Mapping[str, Any]) -> list[int]:
        with self.lock:
            if (task, doc_id) not in self.prompts:
                text = self.task_objects[task].doc_to_text(doc)
                self.prompts[task, doc_id] = prompt_ids(self.tokenizer, text, bool(self.tasks[task]["chat"]))
            return self.prompts[task, doc_id]

    def task_rows(self, client: VLLMClient, base: dict[str, Any], task: str, reference: bool) -> list[dict[str, Any]]:
        """The task's rows on this server: a sample whose prompt and answer do not fit the server's
        context gets its row with the reason (this route has no middle truncation), the others go
        through lm-eval; a task lm-eval fails on gets one row with the error."""
        info, max_new = self.tasks[task], self.max_new(task)
        head = {**base, **_task_columns(task, info), "max_new_tokens": max_new}
        docs = self.task_objects[task].eval_docs
        fits, rows = [], []
        for i in self.drawn.get(task) or range(len(docs)):
            n = len(self.prompt(task, i, docs[i]))
            if n + max_new <= self.max_model_len:
                fits.append(i)
                continue
            why = f"prompt of {n} tokens + {max_new} new exceeds the server's max_model_len {self.max_model_len}"
            rows.append({**head, **_sample_columns(docs[i], i), "prompt_tokens": n, "error": why})
        if not fits:
            return rows
        try:
            answers = lm_eval_answers(client, task, info, max_new, self.manager, fits, self.seed, self.concurrency)
        except Exception as err:  # noqa: BLE001 (the task's row says why; the other tasks go on)
            _note(f"{base['server']} {task}: {type(err).__name__}: {err}")
            return rows + [{**head, "error": f"{type(err).__name__}: {err}"}]
        with ThreadPoolExecutor(self.concurrency) as pool:  # the server batches what is in flight
            return rows + list(pool.map(lambda a: self.sample_row(client, head, a, reference), answers))

    def sample_row(self, client: VLLMClient, head: dict[str, Any], answer: dict[str, Any], reference: bool) -> dict:
        task, doc = head["task"], answer["doc"]
        info, key = self.tasks[task], (task, answer["doc_id"])
        row = {**head, **_sample_columns(doc, answer["doc_id"]), "prediction": answer["answer"], "error": None}
        try:
            metrics = self.task_objects[task].process_results(doc, [answer["answer"]])
            row["score"], row["metric_score"] = float(metrics["score"]), float(metrics[metric_key(info["metric"])])
        except Exception as err:  # noqa: BLE001 (this sample's row says why)
            row["error"] = f"{type(err).__name__}: {err}"
        try:
            ids = self.prompt(task, answer["doc_id"], doc)
            row["prompt_tokens"] = len(ids)
            if reference:
                tokens, steps = continuation(client, ids, self.max_new(task), self.top_k, self.seed)
                self.continuations[key] = self.until_stop(task, tokens)
                self.decode_lists[key] = steps[: len(self.continuations[key])]
            if key not in self.continuations or not (reference or key in self.reference_lists):
                row["fidelity_error"] = "no reference continuation (the reference server failed on this sample)"
                return row
            tokens = self.continuations[key]
            with self.lock:
                row["reference_continuation"] = self.tokenizer.decode(tokens, skip_special_tokens=True)
            compared = tokens[: self.fidelity_positions]  # the harness's positions per sample
            if not compared:
                return row
            lists = forced(client, ids, compared, self.top_k, self.seed)
            if reference:  # and again: the reference's rows hold its own run-to-run noise
                self.reference_lists[key], lists = lists, forced(client, ids, compared, self.top_k, self.seed)
            row |= fidelity(self.reference_lists[key], lists, compared)
        except Exception as err:  # noqa: BLE001 (the score stands; this sample has no fidelity)
            row["fidelity_error"] = f"{type(err).__name__}: {err}"
            return row
        try:  # this server generates the compared steps itself (the reference again, for its noise)
            mine, steps = continuation(client, ids, len(compared), self.top_k, self.seed)
            row |= decode_fidelity(compared, self.decode_lists[key], mine, steps, lists)
        except Exception as err:  # noqa: BLE001 (the forced fidelity stands)
            row["fidelity_error"] = f"decode steps: {type(err).__name__}: {err}"
        return row

    def until_stop(self, task: str, tokens: list[int]) -> list[int]:
        """The continuation up to the token that reaches a stop string, where the harness's
        reference ends (the harness's stop check)."""
        until = list(self.tasks[task]["until"])
        if not until:  # the harness's reference runs to its length or end of sequence
            return tokens
        with self.lock:
            end = next((n for n in range(1, len(tokens) + 1) if reaches_stop(self.tokenizer, tokens[:n], until)), None)
        return tokens[:end] if end else tokens


def run(
    model_dir: str,
    tokenizer: Any,
    quality: Mapping[str, Any],
    vllm: Mapping[str, Any],
    tasks_dir: str,
    seed: int,
    logs: Mapping[str, str],
) -> list[dict[str, Any]]:
    """Rows for every sample of every task on every server (the reference's included); a server
    this machine cannot run gets one row per task with its reason, a failed task or request its
    error. `logs`: each server's log by label ("reference" for the 16-bit one)."""
    served = quality["served"]
    tasks, manager, drawn = open_tasks(tasks_dir, quality, seed)
    shared = _Pass(
        tokenizer,
        manager,
        tasks,
        manager.load(list(tasks))["tasks"],
        drawn,
        quality.get("max_gen_cap"),
        quality.get("fidelity_positions"),
        int(served["top_k"]),
        int(served["concurrency"]),
        seed,
        int(vllm["max_model_len"]),
    )
    dtype, dtype_note = served_dtype(served["dtype"], vllm["device"])
    reference = reference_label(dtype)
    rows: list[dict[str, Any]] = []
    for label in [None, *served["servers"]]:
        name = label or reference
        base = {
            "server": name,
            "engine": ENGINE,
            "kv_cache_dtype": NATIVE[label].dtype if label else "auto",
            "nearest": NATIVE[label].nearest if label else None,
            "difference": NATIVE[label].difference if label else None,
            "served_dtype": dtype,
            "dtype_note": dtype_note,
            "reference_server": reference,
            "top_k": shared.top_k,
            "fidelity_note": PREFILL_BYPASS if label and NATIVE[label].dtype.startswith("turboquant") else None,
        }
        reason = unsupported(label, vllm["device"]) if label else None
        if reason is not None:
            _note(f"{name}: {reason}")
            rows += _task_errors(base, tasks, reason)
            continue
        started = time.monotonic()
        settings = server_settings(vllm, dtype, label, shared.top_k)
        mine: list[dict[str, Any]] = []
        try:
            with vllm_server(model_dir, settings, seed, logs[label or "reference"]) as client:
                _note(f"{name}: up in {time.monotonic() - started:.0f} s")
                for task in tasks:
                    mine += shared.task_rows(client, base, task, reference=label is None)
        except Exception as err:  # noqa: BLE001 (a server that failed: its tasks' rows say why; the next one runs)
            _note(f"{name}: {type(err).__name__}: {err}")
            done = {row["task"] for row in mine}
            mine += _task_errors(
                base, {t: info for t, info in tasks.items() if t not in done}, f"{type(err).__name__}: {err}"
            )
        rows += mine
        _note(f"{name}: done in {time.monotonic() - started:.0f} s")
    return rows


def _task_errors(base: dict[str, Any], tasks: Mapping[str, Mapping[str, Any]], why: str) -> list[dict[str, Any]]:
    """One row per task that has no sample rows on this server, saying why."""
    return [{**base, **_task_columns(t, info), "error": why} for t, info in tasks.items()]


def _sample_columns(doc: Mapping[str, Any], doc_id: int) -> dict[str, Any]:
    return {"sample_id": str(doc.get("_id", doc_id)), "lm_eval_doc_id": doc_id}


def _task_columns(task: str, info: Mapping[str, Any]) -> dict[str, Any]:
    return {k: info[k] for k in ("category", "metric", "longbench")} | {"task": task}


def _note(text: str) -> None:
    print(f"[quality-served] {text}", file=sys.stderr, flush=True)


def run_job(
    model_dir: str,
    quality: Mapping[str, Any],
    vllm: Mapping[str, Any],
    tasks_dir: str,
    seed: int,
    logs: Mapping[str, str],
    table_path: str,
    provenance: Mapping[str, Any],
) -> None:
    """The rule's job: every server's rows in one table, and per server what they hold (counts and
    means only: the report's intervals compare)."""
    import pandas as pd

    from kvbench.models import load_tokenizer
    from kvbench.provenance import write_table

    rows = run(model_dir, load_tokenizer(model_dir), quality, vllm, tasks_dir, seed, logs)
    table = pd.DataFrame(rows, columns=list(COLUMNS))
    for server, part in table.groupby("server", sort=False):
        _note(
            f"{server}: {int(part['score'].notna().sum())} samples scored, {int(part['error'].notna().sum())} rows "
            f"with an error, mean score {part['score'].mean():.3f}, KL {part['kl_mean'].mean():.4f} over "
            f"{int(part['fidelity_positions'].fillna(0).sum())} forced positions"
        )
    write_table(table, table_path, provenance)

"""Every method on every prompt under each protocol, from one shared prefill per prompt.

Per prompt: one full-precision prefill (kvbench.prefill); every method's cache is forked from it,
under each protocol:
- `query-aware`: compressed after the whole prompt (context and question) — the first answer token
  follows the uncompressed prefill, so it is the same for every method;
- `context-only` (kvpress's default, the cache-reuse case): compressed after the context alone, then
  the question runs through the compressed cache (one batched pass for every method), so the first
  answer token already depends on the method.
Then the reference method's rows decode (its greedy continuation and distributions become the
references, unless stored ones are given), and every other method's rows are teacher-forced on
them and branch off at their first divergence (kvbench.decode), all in one batched decode loop.

A method that fails on a prompt (at its fork, its question pass or a decode step) gets a record with
its error; the others go on.
"""

from __future__ import annotations

import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from kvbench.decode import Row, Tally, eos_ids, extend_rows, run_rows
from kvbench.fidelity import Reference, prompt_hash, reduced, summarize
from kvbench.methods.base import ModelShape
from kvbench.prefill import fork, shared_prefill

QUERY_AWARE, CONTEXT_ONLY = "query-aware", "context-only"
PROTOCOLS = (QUERY_AWARE, CONTEXT_ONLY)


@dataclass
class Prompt:
    key: str  # task/doc_id
    ids: list[int]
    split: int | None  # tokens of the context (the context-only protocol's compressed part); None: no context
    max_new_tokens: int
    stop: Callable[[list[int]], bool] | None = None
    split_note: str | None = None  # why there is no split


@dataclass
class Cost:
    """Where a run's time went: the shared prefills, the methods' compressions (forks), the
    context-only question passes, and the batched decode steps."""

    prefill_s: float = 0.0
    fork_s: float = 0.0
    question_s: float = 0.0
    decode: Tally = field(default_factory=Tally)

    @property
    def forward_s(self) -> float:
        return self.prefill_s + self.question_s + self.decode.seconds


@dataclass
class Outcome:
    """One prompt × method × protocol."""

    tokens: list[int] = field(default_factory=list)
    record: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


def reference_key(protocol: str, key: str) -> str:
    return f"{protocol}/{key}"


def _error(err: BaseException) -> str:
    traceback.print_exc()
    return f"{type(err).__name__}: {err}"


def run(
    model: torch.nn.Module,
    prompts: list[Prompt],
    methods: Mapping[str, dict[str, Any]],
    *,
    protocols: tuple[str, ...],
    seed: int,
    reference: str | None = None,
    references: Mapping[str, Reference] | None = None,
    top_k: int | None = None,
    fidelity_positions: int | None = None,
    prompts_per_batch: int = 8,
    max_rows: int = 64,
    log: Callable[[str], None] | None = None,
    cost: Cost | None = None,
) -> tuple[dict[tuple[str, str, str], Outcome], dict[str, Reference]]:
    """Outcomes by (method, protocol, prompt key), and the references the reference method made here.

    `reference`: the method whose continuations the others are compared with (it runs first, in
    this call, and the others compare with its whole distributions); `references`: stored ones
    instead (keys `protocol/prompt key`). Neither: free generation only, no fidelity. The references
    returned keep `top_k` tokens per position where it is set (what another job reads back).
    `fidelity_positions`: teacher-forced positions per sample at most (the first answer token's
    included); a row that agrees with the reference on all of them goes on by itself."""
    log = log or (lambda text: print(text, file=sys.stderr, flush=True))
    outcomes: dict[tuple[str, str, str], Outcome] = {}
    made: dict[str, Reference] = {}
    shape = ModelShape.of(model.config)
    cost = cost if cost is not None else Cost()
    for start in range(0, len(prompts), prompts_per_batch):
        group = prompts[start : start + prompts_per_batch]
        began = time.monotonic()
        rows = _forks(model, group, methods, protocols, seed, shape, outcomes, reference, cost, fidelity_positions)
        exact: dict[str, Reference] = {}  # this group's, over the whole vocabulary
        if reference is not None:
            mine = [row for row in rows if row.tag[0] == reference]
            run_rows(model, mine, max_rows, cost.decode)
            for row in mine:
                _method, protocol, key = row.tag
                if row.error is None:
                    ids = next(p.ids for p in group if p.key == key)
                    exact[reference_key(protocol, key)] = Reference(
                        row.tokens, torch.stack(row.logprobs), prompt_hash(ids)
                    )
            _record(mine, outcomes, shape)
            rows = [row for row in rows if row.tag[0] != reference]
        # Compared with the reference as another job reads it back (the top_k most likely tokens per
        # position where top_k is set), so a method's numbers do not depend on the job it ran in.
        kept = {k: reduced(ref, top_k) for k, ref in exact.items()}
        stored = {**(references or {}), **kept}
        for row in rows:
            _method, protocol, key = row.tag
            ref = stored.get(reference_key(protocol, key))
            if ref is not None:
                ids = next(p.ids for p in group if p.key == key)
                if ref.prompt_hash != prompt_hash(ids):
                    raise ValueError(f"the reference for {key} answered another prompt: rerun the reference job")
                row.reference = ref
            elif reference is not None or references is not None:
                outcomes[row.tag].record["fidelity_note"] = (
                    "fidelity: no full-cache reference (the reference failed on this sample)"
                )
        run_rows(model, rows, max_rows, cost.decode)
        _record(rows, outcomes, shape)
        made |= kept
        log(
            f"[quality] prompts {start + 1}-{start + len(group)} of {len(prompts)}: {len(group) * len(methods) * len(protocols)} "
            f"runs in {time.monotonic() - began:.1f} s"
        )
    return outcomes, made


def _forks(
    model: torch.nn.Module,
    group: list[Prompt],
    methods: Mapping[str, dict[str, Any]],
    protocols: tuple[str, ...],
    seed: int,
    shape: ModelShape,
    outcomes: dict,
    reference: str | None,
    cost: Cost,
    fidelity_positions: int | None,
) -> list[Row]:
    """Every method's cache for every prompt and protocol, from one shared prefill per prompt; the
    rows to decode (a failed fork is an outcome with its error, and no row)."""
    eos = eos_ids(model)
    rows = []
    for prompt in group:
        prefill = shared_prefill(model, prompt.ids)
        cost.prefill_s += prefill.seconds
        for protocol in protocols:
            upto = len(prompt.ids) if protocol == QUERY_AWARE else prompt.split
            forked = []
            for method, spec in methods.items():
                outcome = outcomes.setdefault((method, protocol, prompt.key), Outcome())
                outcome.record |= {"prefill_s": prefill.seconds, "fidelity_note": None}
                if upto is None:
                    outcome.error = f"context-only: {prompt.split_note or 'no context/question split'}"
                    continue
                try:
                    cache, seconds = fork(model, prefill, spec, upto, seed)
                except Exception as err:  # a method that cannot build its cache here: its row says why
                    outcome.error = _error(err)
                    continue
                cost.fork_s += seconds
                outcome.record |= {
                    "fork_s": seconds,
                    "kv_bytes_prefill": cache.nbytes(),
                    "full16_bytes_prefill": shape.full_bytes(upto),
                }
                forked.append((method, cache))
            if not forked:
                continue
            logits, errors = [prefill.logits] * len(forked), {}
            if upto < len(prompt.ids):  # the question through each compressed cache, all in one pass
                batch, errors, seconds = extend_rows(model, [c for _, c in forked], prompt.ids[upto:], upto)
                cost.question_s += seconds
                logits = list(batch)
                for method, _ in forked:
                    outcomes[(method, protocol, prompt.key)].record["question_s"] = seconds / len(forked)
            for b, ((method, cache), first) in enumerate(zip(forked, logits)):
                if b in errors:
                    outcomes[(method, protocol, prompt.key)].error = errors[b]
                    continue
                rows.append(
                    Row(
                        cache,
                        first,
                        len(prompt.ids),
                        prompt.max_new_tokens,
                        eos,
                        prompt.stop,
                        forced_positions=fidelity_positions,
                        keep_logprobs=method == reference,
                        keep_positions=fidelity_positions,
                        tag=(method, protocol, prompt.key),
                    )
                )
        del prefill
    return rows


def _record(rows: list[Row], outcomes: dict, shape: ModelShape) -> None:
    for row in rows:
        outcome = outcomes[row.tag]
        done = row.result()
        error = row.error or done.error
        if error is not None:
            outcome.error = error
            continue
        steps = len(done.tokens) - 1
        record = outcome.record
        full_end = shape.full_bytes(row.start + steps)
        record |= {
            "new_tokens": len(done.tokens),
            "first_divergence": row.divergence if row.reference is not None else None,
            "kv_bytes_end": done.bytes_end,
            "full16_bytes_end": full_end,
            "ratio_prefill": record["full16_bytes_prefill"] / record["kv_bytes_prefill"],
            "ratio_end": full_end / done.bytes_end,
            "tpot_s": done.tpot_s,
            "ttft_s": record["prefill_s"] + record["fork_s"] + record.get("question_s", 0.0),
        }
        if row.reference is not None:
            record["same_output_as_reference"] = done.tokens == row.reference.tokens
        if row.reference is not None and row.reference.logprobs is not None:
            k = row.reference.indices
            record |= summarize(row.kl, row.top1) | {
                "fidelity_reference": "whole vocabulary" if k is None else f"top {k.shape[-1]} + rest"
            }
        outcome.tokens = done.tokens

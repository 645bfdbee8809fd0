"""Decode cost of the quantized caches against `full` at a long context, step by step interleaved.

One shared prefill (kvbench.prefill) fills every method's cache (the same `update` a prefill
makes), then all methods decode the same tokens (full's greedy answer, teacher-forced) through the
decode loop (kvbench.decode), one row per step, one step each in an order shuffled per step. Each
step's time over the same step's `full` time is a same-round ratio: drift from other load on the
machine cancels; the table gives medians.

    .venv/bin/python bench/decode_overhead.py [--context 4096] [--steps 32]
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path
from typing import Callable

import pandas as pd
import torch
import yaml

from kvbench.decode import Row, run_rows
from kvbench.fidelity import Reference
from kvbench.kv.study import long_document
from kvbench.models import load_model, load_tokenizer
from kvbench.prefill import fork, shared_prefill
from kvbench.provenance import provenance, write_table
from kvbench.report.blocks import Block
from kvbench.report.render import fmt

MODEL = "resources/models/smollm2-135m"
CONFIG_METHODS = yaml.safe_load((Path(__file__).resolve().parents[1] / "config" / "config.yaml").read_text())["methods"]
METHODS = {"full-fp32": {"kind": "full"}} | {
    name: spec for name, spec in CONFIG_METHODS.items() if spec["kind"] in ("full", "kivi", "turboquant", "fp8")
}


def interleaved(names: list[str], steps: int, rng: random.Random) -> Callable[[Row], tuple[int, int]]:
    """Sort key for `run_rows(order=...)`: with one row per step, every method steps once per decode
    step, in an order shuffled per step, so each step's ratio to `full` is taken within one round."""
    rank = {(step, name): (step, i) for step in range(steps) for i, name in enumerate(rng.sample(names, len(names)))}
    return lambda row: rank[(row.position - row.start, row.tag)]


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer, model = load_tokenizer(MODEL), load_model(MODEL)
    docs = pd.read_parquet("results/corpus/realistic/docs.parquet")
    text = long_document(docs, lambda text: tokenizer(text).input_ids, args.context).text.iloc[0]
    ids = tokenizer(text).input_ids[: args.context]
    # One prefill fills every method's cache (`fork`: the same `update` a prefill makes).
    prefill = shared_prefill(model, ids)

    def row(spec: dict, name: str, reference: Reference | None = None) -> Row:
        cache, _ = fork(model, prefill, spec, len(ids))
        return Row(cache, prefill.logits, len(ids), args.steps + 1, reference=reference, branch_free=False, tag=name)

    (full,) = run_rows(model, [row({"kind": "full"}, "answer")])  # full's greedy answer, no stop at EOS
    answer = Reference(full.tokens, None, "")
    rows = []

    def record(batch: list[Row], seconds: float, cpu_seconds: float) -> None:
        (done,) = batch
        step = done.position - done.start - 1
        rows.append(
            {
                "step": step,
                "method": done.tag,
                "seconds": seconds,
                "cpu_seconds": cpu_seconds,
                "kv_bytes": done.cache.nbytes(),
            }
        )
        if len(rows) % len(METHODS) == 0:
            print(
                f"step {step}: " + ", ".join(f"{r['method']} {r['cpu_seconds']:.3f}" for r in rows[-len(METHODS) :]),
                flush=True,
            )

    decoded = run_rows(
        model,
        [row(spec, name, answer) for name, spec in METHODS.items()],
        max_batch=1,  # each step times one method alone
        order=interleaved(list(METHODS), args.steps, random.Random(args.seed)),
        on_step=record,
    )
    if failed := {r.tag: r.error for r in decoded if r.error}:
        raise SystemExit(f"methods failed: {failed}")
    table = pd.DataFrame(rows)
    columns = {}
    for clock in ("seconds", "cpu_seconds"):
        per_step = table.pivot(index="step", columns="method", values=clock)
        columns |= {
            f"tpot_{clock}": per_step.median(),
            f"{clock}_vs_full": per_step.div(per_step["full"], axis=0).median(),
            f"{clock}_vs_full_fp32": per_step.div(per_step["full-fp32"], axis=0).median(),
        }
    summary = pd.DataFrame(columns | {"kv_bytes": table.groupby("method").kv_bytes.last()}).sort_values(
        "cpu_seconds_vs_full"
    )
    pd.set_option("display.width", 200)
    print(f"{len(ids)} context tokens, {args.steps} steps, {args.threads} threads")
    print(summary.to_string(float_format="%.3f"))
    config = {
        "seed": args.seed,
        "bench": "decode_overhead",
        "context": args.context,
        "steps": args.steps,
        "threads": args.threads,
    }
    write_table(
        table.assign(context_tokens=len(ids)),
        "results/bench/decode_overhead.parquet",
        provenance(config, model="smollm2-135m"),
    )


# Decode cost per token vs the fp16 `full` at this bench's context: KIVI-2 <= 1.3x, TurboQuant <= 1.5x.
BUDGETS = {"kivi2": 1.3, "turboquant3": 1.5, "turboquant4": 1.5, "turboquant4-mse": 1.5}


def render(t: pd.DataFrame) -> pd.DataFrame:
    """Per method: the median over steps of the step's time over the same step's `full` time
    (the bench interleaves methods within a step), wall clock and process CPU time."""
    columns = {}
    for clock, label in (("seconds", "wall"), ("cpu_seconds", "CPU")):
        per_step = t.pivot(index="step", columns="method", values=clock)
        columns[f"TPOT / full ({label})"] = per_step.div(per_step["full"], axis=0).median()
    per_method = t.sort_values("step").groupby("method")
    out = pd.DataFrame(
        {
            "tokens": per_method.context_tokens.first(),
            "steps": per_method.step.nunique(),
            "TPOT (s, wall)": per_method.seconds.median(),
            **columns,
            "KV MB": per_method.kv_bytes.last() / 1e6,
        }
    )
    return out.sort_values("TPOT / full (wall)").rename_axis("method").reset_index()


def render_budgets(t: pd.DataFrame) -> str:
    """Each budgeted method's wall-clock ratio to `full`, against its budget."""
    shown = render(t).set_index("method")
    verdicts = [
        f"{m} {fmt(shown.loc[m, 'TPOT / full (wall)'])}× (budget ≤ {b}×: "
        f"{'met' if shown.loc[m, 'TPOT / full (wall)'] <= b else 'missed'})"
        for m, b in BUDGETS.items()
        if m in shown.index
    ]
    tokens = int(t.context_tokens.iloc[0])
    return f"at {tokens} tokens, TPOT over `full`'s: " + ", ".join(verdicts) if verdicts else "no budgeted method ran"


BLOCKS = {
    "decode-overhead": Block(render, ("bench/decode_overhead.parquet",), make="make bench-core"),
    "decode-overhead-budgets": Block(
        render_budgets, ("bench/decode_overhead.parquet",), make="make bench-core", inline=True
    ),
}


if __name__ == "__main__":
    main()

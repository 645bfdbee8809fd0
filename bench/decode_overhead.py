"""Decode cost of the quantized caches against `full` at a long context, step by step interleaved.

One prefill of the prompt captures every layer's K/V; each method's cache is filled from them
(the same `update` a prefill makes), then all methods decode the same tokens (full's greedy
answer), one step each in a shuffled order per step: kvbench.decode's `step`, the one timed step of
every stage. Each step's time over the same step's `full` time is a same-round ratio: drift from
other load on the machine cancels; the table gives medians.

    .venv/bin/python bench/decode_overhead.py [--context 4096] [--steps 32]
"""

from __future__ import annotations

import argparse
import math
import random
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch
import yaml

from kvbench.decode import step_one
from kvbench.harness import generate, prefill
from kvbench.kv.study import long_document
from kvbench.methods.base import ModelShape
from kvbench.methods.catalog import build_cache
from kvbench.models import load_model, load_tokenizer
from kvbench.provenance import provenance, write_table
from kvbench.report.blocks import Block
from kvbench.report.bootstrap import MIN_UNITS
from kvbench.report.render import fmt
from kvbench.serve.intervals import bootstrap

MODEL = "resources/models/smollm2-135m"
CONFIG_METHODS = yaml.safe_load((Path(__file__).resolve().parents[1] / "config" / "config.yaml").read_text())["methods"]
METHODS = {"full-fp32": {"kind": "full"}} | {
    name: spec for name, spec in CONFIG_METHODS.items() if spec["kind"] in ("full", "kivi", "turboquant", "fp8")
}


@torch.inference_mode()
def prefilled_caches(model, ids: list[int]) -> dict:
    """Every method's cache after the prompt, from one prefill's K/V."""
    shape = ModelShape.of(model.config)
    capture = build_cache({"kind": "full"}, shape)
    prefill(model, capture, ids)
    caches = {}
    for name, spec in METHODS.items():
        cache = build_cache(spec, shape)
        for layer, source in zip(cache.layers, capture.layers):
            layer.update(source.keys, source.values)
        caches[name] = cache
    return caches


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
    answer = generate(model, {"kind": "full"}, ids, args.steps + 1)["tokens"]
    caches = prefilled_caches(model, ids)
    rng, rows = random.Random(args.seed), []
    for index, token in enumerate(answer[:-1]):
        for name in rng.sample(list(caches), len(caches)):
            cpu = time.process_time()
            _, seconds = step_one(model, caches[name], token, len(ids) + index)
            rows.append(
                {
                    "step": index,
                    "method": name,
                    "seconds": seconds,
                    "cpu_seconds": time.process_time() - cpu,
                    "kv_bytes": caches[name].nbytes(),
                }
            )
        print(
            f"step {index}: " + ", ".join(f"{r['method']} {r['cpu_seconds']:.3f}" for r in rows[-len(caches) :]),
            flush=True,
        )
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


MIN_STEPS = MIN_UNITS  # fewer steps give no interval, and no budget verdict
# Decode cost per token vs the fp16 `full` at this bench's context: KIVI-2 <= 1.3x, TurboQuant <= 1.5x.
BUDGETS = {"kivi2": 1.3, "turboquant3": 1.5, "turboquant4": 1.5, "turboquant4-mse": 1.5}


def step_ratios(t: pd.DataFrame, clock: str = "seconds") -> pd.DataFrame:
    """Each step's time over the same step's `full` time: [step, method]."""
    per_step = t.pivot(index="step", columns="method", values=clock)
    return per_step.div(per_step["full"], axis=0)


def interval(ratios: pd.Series) -> tuple[float, float]:
    """95 % bootstrap interval of the median ratio, steps resampled as if independent (seeded): how
    steady the ratio is over one prompt's steps in one process, not how it varies between prompts
    or runs. None below MIN_STEPS steps."""
    if ratios.notna().sum() < MIN_STEPS:
        return math.nan, math.nan
    return bootstrap(ratios.to_numpy(), np.median)


def shown_interval(low: float, high: float) -> str:
    return f"{fmt(low)}–{fmt(high)}" if low == low else f"none (n < {MIN_STEPS})"


def render(t: pd.DataFrame) -> pd.DataFrame:
    """Per method: the median over steps of the step's time over the same step's `full` time
    (the bench interleaves methods within a step) with its interval, wall clock and process CPU
    time."""
    columns = {}
    for clock, label in (("seconds", "wall"), ("cpu_seconds", "CPU")):
        columns[f"TPOT / full ({label})"] = step_ratios(t, clock).median()
    wall = step_ratios(t)
    columns["95 % interval (wall)"] = pd.Series(
        {m: shown_interval(*interval(wall[m])) if m != "full" else "—" for m in wall}
    )
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


def budget_verdict(low: float, high: float, budget: float) -> str:
    """`met` when the interval's upper end is within the budget, `missed` when its lower end is
    over it, `inconclusive` when the interval straddles it (or there is none)."""
    return "met" if high <= budget else "missed" if low > budget else "inconclusive"


def render_budgets(t: pd.DataFrame) -> str:
    """Each budgeted method's wall-clock ratio to `full`, with its interval and n, against its budget."""
    wall = step_ratios(t)
    verdicts = []
    for m, b in BUDGETS.items():
        if m in wall.columns:
            low, high = interval(wall[m])
            verdicts.append(
                f"{m} {fmt(wall[m].median())}× [{shown_interval(low, high)}] (budget ≤ {b}×: {budget_verdict(low, high, b)})"
            )
    tokens = int(t.context_tokens.iloc[0])
    head = f"at {tokens} tokens, TPOT over `full`'s (median over {len(wall)} steps, 95 % interval): "
    return head + ", ".join(verdicts) if verdicts else "no budgeted method ran"


BLOCKS = {
    "decode-overhead": Block(render, ("bench/decode_overhead.parquet",), make="make bench-core"),
    "decode-overhead-budgets": Block(
        render_budgets, ("bench/decode_overhead.parquet",), make="make bench-core", inline=True
    ),
}


if __name__ == "__main__":
    main()

"""Decode cost of our methods and their peers in one process, step by step interleaved
(`make bench-peers`).

`bench/side_by_side.py` times whole generations, each side in its own venv, one method after
another: on this small shared CPU a round's methods run seconds apart, drift swings single-round
TPOT ratios by ±30 %, and the two venvs' transformers versions differ. Here one process per round,
in the peer venv (`.bench/peer-venv`, where `make bench-peers` installs this checkout's kvbench too), prefills every
method's cache for a prompt, ours and the peers', on the same model object, then decodes the same
tokens (our `full`'s greedy answer, teacher-forced) one step per method, in an order shuffled per
step (seeded): the two sides share the transformers, the torch, the threads and the moment, and
drift cancels in the ratio of their summed step times (TPOT over the same steps). Each step's
predicted next token is kept, so the table also says how often ours and the peer agree.

What differs from `make run`: our methods run on the peer venv's transformers (kvpress pins < 5.3),
not on ours. Each round is a fresh process.

    .venv/bin/python bench/decode_side_by_side.py [--rounds 5] [--steps 32] [--contexts 1024 4096]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from side_by_side import MODEL, OURS, PEER_PYTHON, build_all_prompts

from kvbench.harness import generate
from kvbench.models import load_model, load_tokenizer
from kvbench.provenance import provenance, write_table
from kvbench.report.blocks import Block

# Ours against its peer; `full` against `peer-full` (a plain DynamicCache) shows what our cache and
# decode step (appending in place, attention routed through our cache) cost against HF's.
PEER_OF = {
    "full": "peer-full",
    "snapkv": "kvpress-snapkv",
    "snapkv-fp32": "kvpress-snapkv",
    "kivi2": "quanto-int2",
    "kivi4": "quanto-int4",
}
OWN_FULL = {"ours": "full", "peer": "peer-full"}
MIN_ROUNDS = 5  # a verdict needs every one of at least this many rounds on one side


def run_round(setup: dict[str, Any]) -> dict:
    Path(".bench/steps_setup.json").write_text(json.dumps(setup))
    subprocess.run(
        [PEER_PYTHON, "bench/peer_methods.py", "steps", MODEL, ".bench/steps_setup.json", ".bench/steps.json"],
        check=True,
    )
    return json.loads(Path(".bench/steps.json").read_text())


def per_round(table: pd.DataFrame) -> pd.DataFrame:
    """Per round, prompt and method: TPOT (mean step time) and its ratios to the same process's
    DynamicCache (`peer-full`) and to the method's own side's full cache, over the same steps."""
    sums = (
        table.groupby(["round", "prompt_id", "method"], sort=False)
        .agg(
            context_tokens=("context_tokens", "first"),
            steps=("step", "nunique"),
            seconds=("seconds", "sum"),
            kv_bytes=("kv_bytes", "last"),
        )
        .reset_index()
    )
    sums["tpot_s"] = sums.seconds / sums.steps
    ref = sums.set_index(["round", "prompt_id", "method"]).seconds
    own_full = sums.method.map(lambda m: OWN_FULL["ours" if m in PEER_OF else "peer"])
    for column, base in (("tpot_vs_dynamic", pd.Series("peer-full", index=sums.index)), ("tpot_vs_own_full", own_full)):
        sums[column] = (
            sums.seconds.to_numpy()
            / ref.reindex(pd.MultiIndex.from_arrays([sums["round"], sums.prompt_id, base])).to_numpy()
        )
    return sums


def pairs(table: pd.DataFrame) -> pd.DataFrame:
    """Ours vs peer per prompt: medians (and range) over rounds of ours / peer TPOT over the same
    steps of the same process; each side over the DynamicCache and over its own full; bytes after
    the last step; the share of steps whose predicted next token is the same on both sides."""
    rounds = per_round(table).set_index(["method", "prompt_id"]).sort_index()
    tokens = table.set_index(["method", "prompt_id", "round", "step"]).next_token.sort_index()
    rows = []
    for ours, peer in PEER_OF.items():
        for prompt_id in table.prompt_id.unique():
            a = rounds.loc[[(ours, prompt_id)]].set_index("round")
            b = rounds.loc[[(peer, prompt_id)]].set_index("round")
            ratio = a.tpot_s / b.tpot_s
            same = (tokens.loc[(ours, prompt_id)] == tokens.loc[(peer, prompt_id)]).mean()
            rows.append(
                {
                    "ours": ours,
                    "peer": peer,
                    "prompt_id": prompt_id,
                    "context_tokens": int(a.context_tokens.iloc[0]),
                    "steps": int(a.steps.iloc[0]),
                    "rounds": len(ratio),
                    "tpot_ratio": ratio.median(),
                    "tpot_ratio_min": ratio.min(),
                    "tpot_ratio_max": ratio.max(),
                    "tpot_vs_dynamic_ours": a.tpot_vs_dynamic.median(),
                    "tpot_vs_dynamic_peer": b.tpot_vs_dynamic.median(),
                    "tpot_vs_own_full_ours": a.tpot_vs_own_full.median(),
                    "tpot_vs_own_full_peer": b.tpot_vs_own_full.median(),
                    "tpot_ours_s": a.tpot_s.median(),
                    "tpot_peer_s": b.tpot_s.median(),
                    "bytes_ours": int(a.kv_bytes.iloc[0]),
                    "bytes_peer": int(b.kv_bytes.iloc[0]),
                    "next_token_agreement": float(same),
                }
            )
    return pd.DataFrame(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--quanto-group", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    Path(".bench").mkdir(exist_ok=True)
    threads = len(os.sched_getaffinity(0))  # every CPU the bench may use
    torch.set_num_threads(threads)
    tokenizer, model = load_tokenizer(MODEL), load_model(MODEL)
    prompts = [
        {
            "prompt_id": p["prompt_id"],
            "input_ids": p["input_ids"],
            "tokens": generate(model, {"kind": "full"}, p["input_ids"], args.steps)["tokens"],
        }
        for p in build_all_prompts(tokenizer, args.contexts)
    ]
    del model
    rows, versions = [], {}
    for round_ in range(args.rounds):
        setup = {
            "prompts": prompts,
            "seed": args.seed * 1000 + round_,
            "threads": threads,
            "snapkv": OURS["snapkv"],
            "quanto": {"group_size": args.quanto_group, "residual": OURS["kivi2"]["residual"]},
            "ours": {name: OURS[name] for name in PEER_OF},
        }
        out = run_round(setup)
        versions = out["versions"]
        rows += [
            r | {"round": round_, "implementation": "ours" if r["method"] in PEER_OF else "peer"} for r in out["rows"]
        ]
    table = pd.DataFrame(rows).assign(peer_versions=json.dumps(versions, sort_keys=True), threads=threads)
    compared = pairs(table)
    pd.set_option("display.width", 250)
    print(compared.to_string(index=False, float_format="%.3f"))
    config = {
        "seed": args.seed,
        "bench": "decode_side_by_side",
        "rounds": args.rounds,
        "steps": args.steps,
        "contexts": args.contexts,
        "quanto_group": args.quanto_group,
    }
    write_table(table, "results/bench/decode_side_by_side.parquet", provenance(config, model="smollm2-135m"))
    write_table(compared, "results/bench/decode_side_by_side_pairs.parquet", provenance(config, model="smollm2-135m"))


def render(pairs: pd.DataFrame) -> pd.DataFrame:
    """The pairs (ours and the peers in one process, decode steps interleaved): the median over
    rounds of ours / peer TPOT on the same steps, and its range; each side's TPOT over the process's
    DynamicCache and over its own full cache; both sides' bytes after the last step; how often the
    two predict the same next token; the verdict: `yes` only where ours is faster in every round
    while holding at most the peer's bytes (faster with more: by how much), `no` where it is slower
    in every round, `inconclusive` where the rounds disagree or are fewer than MIN_ROUNDS (a sign
    test: all of 5 exchangeable rounds fall on one side by chance with probability 1/16 per side)."""
    enough = pairs.rounds >= MIN_ROUNDS
    faster, slower = enough & (pairs.tpot_ratio_max < 1), enough & (pairs.tpot_ratio_min > 1)
    extra = 100 * (pairs.bytes_ours / pairs.bytes_peer - 1)
    more = "faster, +" + extra.round(1).astype(str) + " % bytes"
    verdict = np.select([faster & (extra <= 0), faster, slower], ["yes", more, "no"], "inconclusive")
    span = pairs.tpot_ratio_min.round(3).astype(str) + "–" + pairs.tpot_ratio_max.round(3).astype(str)
    return pd.DataFrame(
        {
            "prompt": pairs.prompt_id,
            "tokens": pairs.context_tokens,
            "ours": pairs.ours,
            "peer": pairs.peer,
            "steps": pairs.steps,
            "rounds": pairs.rounds,
            "TPOT ours/peer": pairs.tpot_ratio,
            "range over rounds": span,
            "TPOT / DynamicCache, ours": pairs.tpot_vs_dynamic_ours,
            "TPOT / DynamicCache, peer": pairs.tpot_vs_dynamic_peer,
            "TPOT / own full, ours": pairs.tpot_vs_own_full_ours,
            "TPOT / own full, peer": pairs.tpot_vs_own_full_peer,
            "TPOT ours (s)": pairs.tpot_ours_s,
            "TPOT peer (s)": pairs.tpot_peer_s,
            "KV MB ours": pairs.bytes_ours / 1e6,
            "KV MB peer": pairs.bytes_peer / 1e6,
            "same next token %": (100 * pairs.next_token_agreement).round(1),
            "ours faster at ≤ its bytes (every round)": verdict,
        }
    )


BLOCKS = {"peers-decode": Block(render, ("bench/decode_side_by_side_pairs.parquet",), make="make bench-peers")}


if __name__ == "__main__":
    main()

"""Our methods next to their peers on the same prompts, in one run (`make bench-peers`):
our SnapKV vs kvpress SnapKVPress, our KIVI vs transformers' QuantizedCache (quanto), plus the
prefill overhead of every method against `full` at 4K context. Run after `make run`.

Timings on a small shared CPU drift by 5-10 % between runs, so the run is interleaved: each round
runs every peer (one subprocess) and every one of our methods once on every prompt, and the tables
compare medians over rounds, prefill overhead as the median of same-round ratios to `full` (run
first and last in each round, so drift within a round cancels). The method's own prefill work (its cache updates and query hooks) is also timed directly, which does
not drift with the model's matmuls.

    .venv/bin/python bench/side_by_side.py [--rounds 3] [--new-tokens 24]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

import pandas as pd
import torch
import yaml

from kvbench.harness import run_row
from kvbench.kv.study import long_document, pick_documents
from kvbench.methods.base import MethodCache, build_cache
from kvbench.methods.eviction import EvictionCache
from kvbench.models import load_model, load_tokenizer
from kvbench.prompts import build_prompts
from kvbench.provenance import provenance, write_table

MODEL = "resources/models/smollm2-135m"
PEER_PYTHON = ".bench/peer-venv/bin/python"
# The pipeline's own settings (config/config.yaml), plus SnapKV stored at fp32 as kvpress keeps
# it: equal measured bytes.
CONFIG_METHODS = yaml.safe_load(Path("config/config.yaml").read_text())["methods"]
OURS = {name: CONFIG_METHODS[name] for name in ("full", "snapkv", "kivi2", "kivi4", "turboquant3", "turboquant4")}
OURS["snapkv-fp32"] = OURS["snapkv"] | {"storage": "fp32"}
PEER_OF = {"snapkv": "kvpress-snapkv", "snapkv-fp32": "kvpress-snapkv", "kivi2": "quanto-kivi2",
           "kivi4": "quanto-kivi4"}


class PrefillClock:
    """Seconds spent in a cache's own code (layer updates, query hooks) while it prefills; each
    new cache restarts the count, so after `run_row` it holds the measured run's, not the warm-up's."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def timed(self, fn: Callable[..., Any], layer: Any) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if layer.is_initialized:  # decode
                return fn(*args, **kwargs)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return call

    def build(self, spec: dict[str, Any], shape: Any, seed: int = 0) -> MethodCache:
        self.seconds = 0.0
        cache = build_cache(spec, shape, seed)
        for layer in cache.layers:
            layer.update = self.timed(layer.update, layer)
        if isinstance(cache, EvictionCache):
            make_hook = cache.query_hook
            cache.query_hook = lambda index: self.timed(make_hook(index), cache.layers[index])
        return cache


def build_all_prompts(tokenizer: Any) -> list[dict[str, Any]]:
    docs = pd.read_parquet("results/corpus/realistic/docs.parquet")
    facts = pd.read_parquet("results/corpus/realistic/facts.parquet")
    prompts = build_prompts(docs, facts, tokenizer, 1, 1024, pick_documents)
    joined = long_document(docs, lambda text: tokenizer(text).input_ids, 4200).assign(doc_id="joined-4k")
    # The joined document asks about the first realistic document's fact.
    first_fact = facts[facts.doc_id == sorted(docs.doc_id)[0]].assign(doc_id="joined-4k")
    return prompts + build_prompts(joined, first_fact, tokenizer, 1, 4096, pick_documents)


def our_round(model: Any, prompts: list[dict[str, Any]], new_tokens: int, round_: int) -> list[dict[str, Any]]:
    rows = []
    for name in [*OURS, "full"]:  # full opens and closes the round: its reference is their mean
        spec = OURS[name]
        for prompt in prompts:
            clock = PrefillClock()
            row = run_row(model, name, spec, prompt["input_ids"], new_tokens, 1, 0, 8192, clock.build)
            rows.append({"implementation": "kvbench", "method": name, "round": round_, "prompt_id": prompt["prompt_id"],
                         "context_tokens": row["context_tokens"], "ttft_s": row["ttft_s"], "tpot_s": row["tpot_s"],
                         "method_prefill_s": clock.seconds,
                         "kv_bytes_prefill": row["kv_bytes_prefill"], "kv_bytes_end": row["kv_bytes_end"],
                         "error": row["error"]})
            print(f"round {round_} {name} {prompt['prompt_id']}: TTFT {row['ttft_s']:.2f} s, "
                  f"TPOT {row['tpot_s']:.3f} s", flush=True)
    return rows


def peer_round(prompts: list[dict[str, Any]], new_tokens: int, round_: int) -> tuple[list[dict[str, Any]], dict]:
    # The peers get our settings: SnapKV's window, kernel and keep ratio; KIVI's group and residual.
    setup = {"snapkv": OURS["snapkv"], "kivi": OURS["kivi2"], "new_tokens": new_tokens, "repeats": 1,
             "prompts": [{"prompt_id": p["prompt_id"], "input_ids": p["input_ids"]} for p in prompts]}
    Path(".bench/prompts.json").write_text(json.dumps(setup))
    subprocess.run([PEER_PYTHON, "bench/peer_methods.py", MODEL, ".bench/prompts.json", ".bench/peers.json"], check=True)
    peers = json.loads(Path(".bench/peers.json").read_text())
    rows = [{"implementation": "peer", "method": p["method"], "round": round_, "prompt_id": p["prompt_id"],
             "context_tokens": p["context_tokens"], "ttft_s": p["ttft_s"], "tpot_s": p["tpot_s"],
             "method_prefill_s": None, "kv_bytes_prefill": p["kv_bytes_prefill"], "kv_bytes_end": p["kv_bytes_end"],
             "error": None} for p in peers["rows"]]
    return rows, peers["versions"]


def summarize(table: pd.DataFrame) -> pd.DataFrame:
    full = table[table.method == "full"].groupby(["round", "prompt_id"])[["ttft_s", "method_prefill_s"]].mean()
    ref = full.reindex(pd.MultiIndex.from_frame(table[["round", "prompt_id"]]))  # each row's round reference
    table["prefill_overhead_vs_full"] = table.ttft_s.to_numpy() / ref.ttft_s.to_numpy() - 1
    table["method_prefill_overhead"] = (table.method_prefill_s.to_numpy() - ref.method_prefill_s.to_numpy()) \
        / ref.ttft_s.to_numpy()
    return table.groupby(["implementation", "method", "prompt_id"], sort=False).agg(
        ttft_s=("ttft_s", "median"), tpot_s=("tpot_s", "median"), kv_bytes_end=("kv_bytes_end", "first"),
        prefill_overhead_vs_full=("prefill_overhead_vs_full", "median"),
        method_prefill_overhead=("method_prefill_overhead", "median"), rounds=("round", "nunique")).reset_index()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=24)
    args = parser.parse_args()
    Path(".bench").mkdir(exist_ok=True)
    tokenizer = load_tokenizer(MODEL)
    prompts = build_all_prompts(tokenizer)
    model = load_model(MODEL)
    rows, versions = [], {}
    for round_ in range(args.rounds):
        peer_rows, versions = peer_round(prompts, args.new_tokens, round_)
        rows += peer_rows + our_round(model, prompts, args.new_tokens, round_)
    table = pd.DataFrame(rows)
    summary = summarize(table)
    pd.set_option("display.width", 200)
    print(summary.to_string(index=False, float_format="%.3f"))
    medians = summary.set_index(["method", "prompt_id"])
    for ours, peer in PEER_OF.items():
        a, b = medians.loc[ours], medians.loc[peer]
        print(f"{ours} vs {peer} (ours/peer): TTFT {(a.ttft_s / b.ttft_s).round(2).to_dict()}, "
              f"TPOT {(a.tpot_s / b.tpot_s).round(2).to_dict()}, bytes {(a.kv_bytes_end / b.kv_bytes_end).round(2).to_dict()}")
    table["peer_versions"] = json.dumps(versions, sort_keys=True)
    config = {"seed": 0, "bench": "side_by_side", "rounds": args.rounds, "new_tokens": args.new_tokens}
    write_table(table, "results/bench/side_by_side.parquet", provenance(config, model="smollm2-135m"))


if __name__ == "__main__":
    main()

"""Our methods next to their peers on the same prompts, run the same way (`make bench-peers`):
our SnapKV vs kvpress SnapKVPress, our KIVI vs transformers' QuantizedCache (optimum-quanto, which
is not KIVI: per-token groups with fp32 scale and shift, whole cache re-quantized every
`residual` tokens), plus each method's overhead against transformers' DynamicCache.

Like for like: both sides prefill with `logits_to_keep=1` and stop at end of sequence (each row
records its `new_tokens`); each side runs every round in a fresh process (model loaded, one untimed full-length prefill per
prompt), then one 256-token warm-up per method; each side's overhead is taken against a plain
DynamicCache run in its own venv (`dynamic` in ours, `peer-full` in the peer's: the same code, so
the two venvs' base speeds cancel; our `full` appends in place and is a method row); our SnapKV is also run at fp32 storage, kvpress's equal bytes; quanto runs
with groups of `--quanto-group` values (default 64: fp32 scale + shift per 64 values cost what
KIVI's fp16 scale + zero point per 32 do; quanto's residual tokens stay at the model's fp32 where
KIVI's are fp16, so bytes are never exactly equal), and the table shows both sides' measured bytes.
Timings on a small shared CPU drift, so the run is interleaved: each round runs every peer (one
subprocess) and every one of our methods (another) once per prompt, in an order shuffled per round (seeded),
and the summary takes medians over rounds of same-round ratios. Whole generations run seconds apart
still drift (single-round ratios swing ±30 %): `bench/decode_side_by_side.py` times decode step by
step, interleaved, and is the one the decode budget is judged on; this bench gives TTFT and bytes.

    .venv/bin/python bench/side_by_side.py [--rounds 3] [--new-tokens 24] [--contexts 1024 4096]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pandas as pd
import torch
import yaml
from transformers import DynamicCache

from kvbench.harness import generate
from kvbench.kv.study import long_document, pick_documents
from kvbench.methods.catalog import build_cache
from kvbench.models import load_model, load_tokenizer
from kvbench.prompts import build_prompts
from kvbench.provenance import provenance, write_table
from kvbench.report.blocks import Block

MODEL = "resources/models/smollm2-135m"
PEER_PYTHON = ".bench/peer-venv/bin/python"
CONFIG_METHODS = yaml.safe_load((Path(__file__).resolve().parents[1] / "config" / "config.yaml").read_text())["methods"]
OURS = {name: CONFIG_METHODS[name] for name in ("snapkv", "kivi2", "kivi4")}
OURS["full"] = {"kind": "full"}  # fp32 as the peer's DynamicCache keeps it; appends in place
OURS["dynamic"] = {"kind": "full"}  # run as transformers' own DynamicCache (make_cache below)
OURS["snapkv-fp32"] = OURS["snapkv"] | {"storage": "fp32"}
# dynamic vs peer-full: the two venvs' transformers versions alone (the base of every raw ratio).
PEER_OF = {
    "dynamic": "peer-full",
    "full": "peer-full",
    "snapkv": "kvpress-snapkv",
    "snapkv-fp32": "kvpress-snapkv",
    "kivi2": "quanto-int2",
    "kivi4": "quanto-int4",
}
PEERS = ["peer-full", "kvpress-snapkv", "quanto-int2", "quanto-int4"]


class Dynamic(DynamicCache):
    """transformers' own DynamicCache, the cache the peer venv's `peer-full` runs: the same code in
    both venvs, so it is the reference each side is divided by (our `full` appends decode tokens in
    place where DynamicCache concatenates, so it is a method row like the others)."""

    def attach(self, model: Any) -> list:
        return []

    def decoding(self, on: bool) -> None:
        """No layer here attends over a stored form (kvbench.decode's loop asks every cache)."""

    def attend(
        self, index: int, original: Any, module: Any, query: Any, key: Any, value: Any, mask: Any, **kwargs: Any
    ):
        """A decode step's attention at layer `index` (kvbench.decode routes each row through its
        cache): DynamicCache's own update (concatenating), then attention over what it returns."""
        keys, values = self.update(key, value, index)
        return original(module, query, keys, values, mask, **kwargs)

    def nbytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for layer in self.layers for t in (layer.keys, layer.values))


def make_cache(name: str):
    """The cache factory `generate` takes for our method `name`."""
    return (lambda spec, shape, seed: Dynamic()) if name == "dynamic" else build_cache


def build_all_prompts(tokenizer: Any, contexts: list[int]) -> list[dict[str, Any]]:
    """One realistic document's prompt per context up to 1K; above it, realistic documents joined."""
    docs = pd.read_parquet("results/corpus/realistic/docs.parquet")
    facts = pd.read_parquet("results/corpus/realistic/facts.parquet")
    prompts = []
    for context in contexts:
        if context <= 1024:
            prompts += build_prompts(docs, facts, tokenizer, 1, context, pick_documents)
            continue
        joined = long_document(docs, lambda text: tokenizer(text).input_ids, context + 104).assign(
            doc_id=f"joined-{context}"
        )
        # The joined document asks about the first realistic document's fact.
        first_fact = facts[facts.doc_id == sorted(docs.doc_id)[0]].assign(doc_id=f"joined-{context}")
        prompts += build_prompts(joined, first_fact, tokenizer, 1, context, pick_documents)
    return prompts


def our_round(model: Any, prompts: list[dict[str, Any]], new_tokens: int, round_: int, order: list[str]) -> list[dict]:
    rows = []
    for prompt in prompts:  # every prompt length touched once, untimed, as the peer's fresh process does
        generate(model, OURS["dynamic"], prompt["input_ids"], 2, make_cache=make_cache("dynamic"))
    for name in order:
        for prompt in prompts:
            generate(model, OURS[name], prompt["input_ids"][:256], 2, make_cache=make_cache(name))  # warm-up, excluded
            run = generate(model, OURS[name], prompt["input_ids"], new_tokens, make_cache=make_cache(name))
            rows.append(
                {
                    "implementation": "kvbench",
                    "method": name,
                    "round": round_,
                    "prompt_id": prompt["prompt_id"],
                    "context_tokens": run["context_tokens"],
                    "new_tokens": run["new_tokens"],
                    "ttft_s": run["ttft_s"],
                    "tpot_s": run["tpot_s"],
                    "kv_bytes_prefill": run["kv_bytes_prefill"],
                    "kv_bytes_end": run["kv_bytes_end"],
                    "output_ids": run["tokens"],
                }
            )
            print(
                f"round {round_} {name} {prompt['prompt_id']}: TTFT {run['ttft_s']:.2f} s, TPOT {run['tpot_s']:.3f} s",
                flush=True,
            )
    return rows


def run_ours(prompts: list[dict[str, Any]], new_tokens: int, round_: int, order: list[str]) -> list[dict]:
    """One round of ours in a fresh process, as each peer round runs (`--our-round`)."""
    setup = {
        "prompts": [{"prompt_id": p["prompt_id"], "input_ids": p["input_ids"]} for p in prompts],
        "new_tokens": new_tokens,
        "round": round_,
        "order": order,
    }
    Path(".bench/ours_setup.json").write_text(json.dumps(setup))
    subprocess.run([sys.executable, __file__, "--our-round", ".bench/ours_setup.json", ".bench/ours.json"], check=True)
    return json.loads(Path(".bench/ours.json").read_text())


def our_round_process(setup_path: str, out_path: str) -> None:
    setup = json.loads(Path(setup_path).read_text())
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    rows = our_round(load_model(MODEL), setup["prompts"], setup["new_tokens"], setup["round"], setup["order"])
    Path(out_path).write_text(json.dumps(rows))


def peer_setup(prompts: list[dict[str, Any]], new_tokens: int, quanto_group: int, order: list[str]) -> dict:
    # The peers get our settings: SnapKV's window, kernel and keep ratio; KIVI's residual.
    return {
        "snapkv": OURS["snapkv"],
        "quanto": {"group_size": quanto_group, "residual": OURS["kivi2"]["residual"]},
        "new_tokens": new_tokens,
        "order": order,
        "threads": torch.get_num_threads(),
        "prompts": [{"prompt_id": p["prompt_id"], "input_ids": p["input_ids"]} for p in prompts],
    }


def run_peer(mode: str, setup: dict) -> dict:
    Path(".bench/setup.json").write_text(json.dumps(setup))
    subprocess.run(
        [PEER_PYTHON, "bench/peer_methods.py", mode, MODEL, ".bench/setup.json", ".bench/peers.json"], check=True
    )
    return json.loads(Path(".bench/peers.json").read_text())


def peer_round(prompts, new_tokens: int, quanto_group: int, round_: int, rng: random.Random) -> tuple[list[dict], dict]:
    peers = run_peer("run", peer_setup(prompts, new_tokens, quanto_group, rng.sample(PEERS, len(PEERS))))
    rows = [
        {
            "implementation": "peer",
            "method": p["method"],
            "round": round_,
            "prompt_id": p["prompt_id"],
            "context_tokens": p["context_tokens"],
            "new_tokens": p["new_tokens"],
            "ttft_s": p["ttft_s"],
            "tpot_s": p["tpot_s"],
            "kv_bytes_prefill": p["kv_bytes_prefill"],
            "kv_bytes_end": p["kv_bytes_end"],
            "output_ids": p["output_ids"],
        }
        for p in peers["rows"]
    ]
    return rows, peers["versions"]


def add_overheads(table: pd.DataFrame) -> pd.DataFrame:
    """Each row's TTFT and TPOT over its own side's DynamicCache run of the same round and prompt, - 1."""
    table["side_full"] = table.implementation.map({"kvbench": "dynamic", "peer": "peer-full"})
    full = table[table.method == table.side_full].set_index(["implementation", "round", "prompt_id"])
    ref = full.reindex(pd.MultiIndex.from_frame(table[["implementation", "round", "prompt_id"]]))
    table["ttft_overhead"] = table.ttft_s.to_numpy() / ref.ttft_s.to_numpy() - 1
    table["tpot_overhead"] = table.tpot_s.to_numpy() / ref.tpot_s.to_numpy() - 1
    return table.drop(columns="side_full")


def pairs(table: pd.DataFrame) -> pd.DataFrame:
    """Ours vs peer, per prompt: medians over rounds of the same-round ratios ours / peer, raw and
    normalized by each side's DynamicCache run (the two venvs run different transformers versions,
    so the raw ratio includes their base speed; the normalized one compares the implementations)."""
    rows = []
    by = table.set_index(["method", "round", "prompt_id"])
    for ours, peer in PEER_OF.items():
        for prompt_id in table.prompt_id.unique():
            a, b = (
                by.xs((ours, prompt_id), level=("method", "prompt_id")),
                by.xs((peer, prompt_id), level=("method", "prompt_id")),
            )
            tpot_norm = (1 + a.tpot_overhead) / (1 + b.tpot_overhead)
            rows.append(
                {
                    "ours": ours,
                    "peer": peer,
                    "prompt_id": prompt_id,
                    "context_tokens": int(a.context_tokens.iloc[0]),
                    "ttft_ratio": (a.ttft_s / b.ttft_s).median(),
                    "tpot_ratio": (a.tpot_s / b.tpot_s).median(),
                    "ttft_norm_ratio": ((1 + a.ttft_overhead) / (1 + b.ttft_overhead)).median(),
                    "tpot_norm_ratio": tpot_norm.median(),
                    "tpot_norm_ratio_min": tpot_norm.min(),
                    "tpot_norm_ratio_max": tpot_norm.max(),
                    "ttft_overhead_ours": a.ttft_overhead.median(),
                    "ttft_overhead_peer": b.ttft_overhead.median(),
                    "tpot_overhead_ours": a.tpot_overhead.median(),
                    "tpot_overhead_peer": b.tpot_overhead.median(),
                    "bytes_prefill_ours": int(a.kv_bytes_prefill.iloc[0]),
                    "bytes_prefill_peer": int(b.kv_bytes_prefill.iloc[0]),
                    "bytes_ours": int(a.kv_bytes_end.iloc[0]),
                    "bytes_peer": int(b.kv_bytes_end.iloc[0]),
                    "bytes_ratio": a.kv_bytes_end.iloc[0] / b.kv_bytes_end.iloc[0],
                    "rounds": len(a),
                    # TPOT averages over these steps: equal counts, or the pair says it is not
                    "new_tokens_ours": int(a.new_tokens.median()),
                    "new_tokens_peer": int(b.new_tokens.median()),
                }
            )
    return pd.DataFrame(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--quanto-group", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--our-round", nargs=2, metavar=("SETUP", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.our_round:
        return our_round_process(*args.our_round)
    Path(".bench").mkdir(exist_ok=True)
    torch.manual_seed(args.seed)
    torch.set_num_threads(len(os.sched_getaffinity(0)))  # both sides: every CPU the bench may use
    tokenizer = load_tokenizer(MODEL)
    prompts = build_all_prompts(tokenizer, args.contexts)
    rng = random.Random(args.seed)
    rows, versions = [], {}
    for round_ in range(args.rounds):
        # Sides alternate which goes first (a coin flip over 3 rounds need not balance).
        for side in ["peer", "ours"] if round_ % 2 == 0 else ["ours", "peer"]:
            if side == "peer":
                peer_rows, versions = peer_round(prompts, args.new_tokens, args.quanto_group, round_, rng)
                rows += peer_rows
            else:
                rows += run_ours(prompts, args.new_tokens, round_, rng.sample(list(OURS), len(OURS)))
    table = add_overheads(pd.DataFrame(rows))
    pd.set_option("display.width", 250)
    summary = (
        table.groupby(["implementation", "method", "prompt_id"], sort=False)
        .agg(
            ttft_s=("ttft_s", "median"),
            tpot_s=("tpot_s", "median"),
            kv_bytes_end=("kv_bytes_end", "first"),
            ttft_overhead=("ttft_overhead", "median"),
            tpot_overhead=("tpot_overhead", "median"),
            rounds=("round", "nunique"),
        )
        .reset_index()
    )
    print(summary.to_string(index=False, float_format="%.3f"))
    compared = pairs(table)
    print(compared.to_string(index=False, float_format="%.3f"))
    table["peer_versions"] = json.dumps(versions, sort_keys=True)
    table["threads"] = torch.get_num_threads()
    config = {
        "seed": args.seed,
        "bench": "side_by_side",
        "rounds": args.rounds,
        "new_tokens": args.new_tokens,
        "contexts": args.contexts,
        "quanto_group": args.quanto_group,
    }
    write_table(table, "results/bench/side_by_side.parquet", provenance(config, model="smollm2-135m"))
    write_table(compared, "results/bench/side_by_side_pairs.parquet", provenance(config, model="smollm2-135m"))


def render(pairs: pd.DataFrame) -> pd.DataFrame:
    """The pairs (whole generations): ratios ours / peer (medians over rounds of same-round
    ratios), raw and divided by each side's DynamicCache run (`÷ DynamicCache`: without the two
    venvs' base speeds; the range is over rounds), each side's overhead over its DynamicCache run,
    both sides' measured bytes and decode steps."""
    pct = lambda col: (100 * pairs[col]).round(1)  # noqa: E731
    span = pairs.tpot_norm_ratio_min.round(3).astype(str) + "–" + pairs.tpot_norm_ratio_max.round(3).astype(str)
    return pd.DataFrame(
        {
            "prompt": pairs.prompt_id,
            "tokens": pairs.context_tokens,
            "ours": pairs.ours,
            "peer": pairs.peer,
            "TTFT ours/peer": pairs.ttft_ratio,
            "TPOT ours/peer": pairs.tpot_ratio,
            "TTFT ours/peer ÷ DynamicCache": pairs.ttft_norm_ratio,
            "TPOT ours/peer ÷ DynamicCache": pairs.tpot_norm_ratio,
            "TPOT ÷ DynamicCache range": span,
            "TTFT vs DynamicCache, ours %": pct("ttft_overhead_ours"),
            "TTFT vs DynamicCache, peer %": pct("ttft_overhead_peer"),
            "TPOT vs DynamicCache, ours %": pct("tpot_overhead_ours"),
            "TPOT vs DynamicCache, peer %": pct("tpot_overhead_peer"),
            "KV MB ours": pairs.bytes_ours / 1e6,
            "KV MB peer": pairs.bytes_peer / 1e6,
            "new tokens ours/peer": pairs.new_tokens_ours.astype(str) + "/" + pairs.new_tokens_peer.astype(str),
            "rounds": pairs.rounds,
        }
    )


BLOCKS = {"peers": Block(render, ("bench/side_by_side_pairs.parquet",), make="make bench-peers")}


if __name__ == "__main__":
    main()

"""Our methods next to their peers on the same prompts, in one run (`make bench-peers`):
our SnapKV vs kvpress SnapKVPress, our KIVI vs transformers' QuantizedCache (quanto), plus the
prefill overhead of every method against `full` at 4K context. Run after `make run`.

    .venv/bin/python bench/side_by_side.py [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

import pandas as pd
import torch

from kvbench.harness import run_row
from kvbench.kv.study import long_document, pick_documents
from kvbench.models import load_model, load_tokenizer
from kvbench.prompts import build_prompts
from kvbench.provenance import provenance, write_table

MODEL = "resources/models/smollm2-135m"
PEER_PYTHON = ".bench/peer-venv/bin/python"
OURS = {
    "full": {"kind": "full", "storage": "fp16"},
    "snapkv": {"kind": "snapkv", "window": 32, "kernel": 7, "keep_ratio": 0.25},
    "kivi2": {"kind": "kivi", "bits": 2, "group_size": 32, "residual": 128},
    "kivi4": {"kind": "kivi", "bits": 4, "group_size": 32, "residual": 128},
    "turboquant3": {"kind": "turboquant", "bits": 3},
    "turboquant4": {"kind": "turboquant", "bits": 4},
}
PEER_OF = {"snapkv": "kvpress-snapkv", "kivi2": "quanto-kivi2", "kivi4": "quanto-kivi4"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=16)
    args = parser.parse_args()
    tokenizer = load_tokenizer(MODEL)
    docs = pd.read_parquet("results/corpus/realistic/docs.parquet")
    facts = pd.read_parquet("results/corpus/realistic/facts.parquet")
    encode = lambda text: tokenizer(text).input_ids  # noqa: E731
    prompts = build_prompts(docs, facts, tokenizer, 1, 1024, pick_documents)
    joined = long_document(docs, encode, 4200).assign(doc_id="joined-4k")
    # The joined document asks about the first realistic document's fact.
    first_fact = facts[facts.doc_id == sorted(docs.doc_id)[0]].assign(doc_id="joined-4k")
    prompts += build_prompts(joined, first_fact, tokenizer, 1, 4096, pick_documents)

    Path(".bench").mkdir(exist_ok=True)
    setup = {"keep_ratio": 0.25, "new_tokens": args.new_tokens, "repeats": args.repeats,
             "prompts": [{"prompt_id": p["prompt_id"], "input_ids": p["input_ids"]} for p in prompts]}
    Path(".bench/prompts.json").write_text(json.dumps(setup))
    subprocess.run([PEER_PYTHON, "bench/peer_methods.py", MODEL, ".bench/prompts.json", ".bench/peers.json"], check=True)
    peers = json.loads(Path(".bench/peers.json").read_text())

    torch.set_num_threads(torch.get_num_threads())
    model = load_model(MODEL)
    rows = []
    for name, spec in OURS.items():
        for prompt in prompts:
            row = run_row(model, name, spec, prompt["input_ids"], args.new_tokens, args.repeats, 0, 8192)
            rows.append({"implementation": "kvbench", "method": name, "prompt_id": prompt["prompt_id"],
                         "context_tokens": row["context_tokens"], "ttft_s": row["ttft_s"], "tpot_s": row["tpot_s"],
                         "kv_bytes_prefill": row["kv_bytes_prefill"], "kv_bytes_end": row["kv_bytes_end"],
                         "error": row["error"]})
            print(name, prompt["prompt_id"], f"TTFT {row['ttft_s']:.2f} s", flush=True)
    for peer in peers["rows"]:
        rows.append({"implementation": "peer", "method": peer["method"], "prompt_id": peer["prompt_id"],
                     "context_tokens": peer["context_tokens"], "ttft_s": peer["ttft_s"], "tpot_s": peer["tpot_s"],
                     "kv_bytes_prefill": peer["kv_bytes_prefill"], "kv_bytes_end": peer["kv_bytes_end"], "error": None})
    table = pd.DataFrame(rows)
    full = table[table.method == "full"].set_index("prompt_id").ttft_s
    table["prefill_overhead_vs_full"] = table.ttft_s / table.prompt_id.map(full) - 1
    table["peer_versions"] = json.dumps(peers["versions"], sort_keys=True)
    pd.set_option("display.width", 200)
    print(table.drop(columns=["peer_versions", "error"]).to_string(index=False, float_format="%.3f"))
    for ours, peer in PEER_OF.items():
        a = table[table.method == ours].set_index("prompt_id")
        b = table[table.method == peer].set_index("prompt_id")
        print(f"{ours} vs {peer}: TTFT ratio (ours/peer) {(a.ttft_s / b.ttft_s).round(2).to_dict()}, "
              f"bytes ratio (ours/peer) {(a.kv_bytes_end / b.kv_bytes_end).round(2).to_dict()}")
    config = {"seed": 0, "bench": "side_by_side", "repeats": args.repeats, "new_tokens": args.new_tokens}
    write_table(table, "results/bench/side_by_side.parquet", provenance(config, model="smollm2-135m"))


if __name__ == "__main__":
    main()

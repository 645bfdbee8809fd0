"""What the connector's background stores cost a CPU server's prefill, by the priority their
threads run at: a bf16 SmolLM2 prefill of `--tokens` tokens on the machine's cores (torch's
OpenMP team, as vLLM's CPU worker runs its forward pass), with a store thread beside it encoding
and sealing real KV chunks with every codec of `serve.codecs` in a loop, at `nice 19` (the
connector's priority before SCHED_IDLE) or at the priority the connector gives its store threads
now (async_store.lower_priority: SCHED_IDLE on Linux), against no store thread. Between two
prefills the bench sleeps `--gap-ms` (a client's round trip to the next request), so a store
thread has time to start an encoding that then runs into the next prefill, as in the serve
stage's warm-ups. Each block asks every mode in a seeded order, `--per` prefills each; a mode's
cost is the geometric mean of its prefill time over no-store's, paired by position within the
block, with the blocks as the interval's units (paired_log_ratio). `chunks_per_s` is the store
thread's progress over the mode's prefills and gaps: a priority that starves the stores would
show there. Not here: the SET (Valkey runs in its own process at normal priority) and vLLM's own
kernels (the forward pass here is transformers', same threads).

    .venv/bin/python bench/store_priority.py [--blocks 8] [--per 4] [--codecs zstd-3 kivi2]

Writes results/bench/store_priority.parquet (one row per prefill) and prints the table.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import threading
import time
from pathlib import Path

import pandas as pd
import torch
import yaml
from serve_transfer import MODEL, paged_cache

from kvbench.models import load_model
from kvbench.provenance import provenance, write_table
from kvbench.report.blocks import Block
from kvbench.serve.async_store import NICE, lower_priority
from kvbench.serve.integrity import seal
from kvbench.serve.intervals import paired_log_ratio
from kvbench.serve.transfer import gather
from kvbench.serve.wire import wire_format

BASELINE = "no store"
NICE_MODE = f"nice {NICE}"


class StoreThread(threading.Thread):
    """Encodes and seals every codec's chunks in a loop while `running` is set."""

    def __init__(self, mode: str, chunks: list[torch.Tensor], wires: list) -> None:
        super().__init__(daemon=True, name=f"store-{mode}")
        self.mode, self.chunks, self.wires = mode, chunks, wires
        self.running, self.done, self.priority = threading.Event(), 0, ""

    def run(self) -> None:
        if self.mode == NICE_MODE:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
            self.priority = NICE_MODE
        else:
            self.priority = lower_priority()
        while True:
            for wire in self.wires:
                for i, chunk in enumerate(self.chunks):
                    self.running.wait()
                    seal(f"chunk{i}", wire.encode(chunk))
                    self.done += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--per", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=540, help="a serve warm-up's prompt: 512 + the question")
    parser.add_argument("--gap-ms", type=float, default=30.0)
    parser.add_argument("--codecs", nargs="+", help="default: serve.codecs")
    parser.add_argument("--out", default="results/bench/store_priority.parquet")
    args = parser.parse_args()
    config = yaml.safe_load(Path("config/config.yaml").read_text())
    cache, spec = paged_cache(MODEL, 512, torch.bfloat16)
    chunks = gather(cache, [0, 1])
    codecs = args.codecs or config["serve"]["codecs"]
    threads = {}
    for mode in (NICE_MODE, "connector"):  # one at a time: model loading is not thread-safe
        wires = [wire_format(c, spec, config["methods"].get(c), seed=0) for c in codecs]
        threads[mode] = StoreThread(mode, chunks, wires)
        threads[mode].start()
    model = load_model(MODEL, dtype=torch.bfloat16)
    ids = torch.randint(100, 40000, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    order, rows = random.Random(0), []
    with torch.inference_mode():
        for _ in range(3):
            model(ids)
        for block in range(args.blocks):
            for mode in order.sample([BASELINE, *threads], 1 + len(threads)):
                worker = threads.get(mode)
                if worker:
                    worker.running.set()
                done, start = worker.done if worker else 0, time.perf_counter()
                for i in range(args.per):
                    time.sleep(args.gap_ms / 1e3)
                    t = time.perf_counter()
                    model(ids)
                    rows.append({"block": block, "mode": mode, "index": i, "prefill_s": time.perf_counter() - t})
                if worker:
                    worker.running.clear()
                    rows[-1]["chunks_per_s"] = (worker.done - done) / (time.perf_counter() - start)
                print(f"block {block} {mode:<10} {rows[-1]['prefill_s']:.3f} s", file=sys.stderr, flush=True)
    table = pd.DataFrame(rows)
    table["priority"] = table["mode"].map({m: t.priority for m, t in threads.items()}).fillna("")
    table["tokens"], table["threads"], table["codecs"] = args.tokens, torch.get_num_threads(), ",".join(codecs)
    settings = {"seed": 0, "bench": "store_priority", "tokens": args.tokens, "blocks": args.blocks}
    settings |= {"per": args.per, "gap_ms": args.gap_ms, "codecs": codecs}
    write_table(table, args.out, provenance(settings, model="smollm2-135m"))
    print(render(table).to_string(index=False))


def render(t: pd.DataFrame) -> pd.DataFrame:
    """Per store priority: its prefills' time over no-store's (paired by block and position, the
    blocks as units), the store thread's chunks per second."""
    base = t[t["mode"] == BASELINE].set_index(["block", "index"])["prefill_s"]
    rows = []
    for mode, part in t[t["mode"] != BASELINE].groupby("mode", sort=False):
        part = part.set_index(["block", "index"])
        pairs = part.join(base.rename("base"), how="inner")
        ratio, low, high, n, units = paired_log_ratio(
            pairs["prefill_s"].to_numpy(), pairs["base"].to_numpy(), pairs.index.get_level_values("block").to_numpy()
        )
        rows.append(
            {
                "store thread": mode,
                "priority": part["priority"].iloc[0],
                "prefill_vs_no_store": f"{ratio:.3g}" + ("" if pd.isna(low) else f" [{low:.3g}, {high:.3g}]"),
                "pairs": n,
                "blocks": units,
                "median_prefill_s": part["prefill_s"].median(),
                "no_store_median_prefill_s": base.median(),
                "chunks_per_s": part["chunks_per_s"].median(),
            }
        )
    return pd.DataFrame(rows).round(3)


BLOCKS = {"store-priority": Block(render, ("bench/store_priority.parquet",), make="make bench-core")}


if __name__ == "__main__":
    main()

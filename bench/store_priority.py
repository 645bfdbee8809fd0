"""What the connector's background stores cost a prefill on the same cores, by the priority their
threads run at. A micro-benchmark, not a server: a bf16 SmolLM2 prefill of `--tokens` tokens
through transformers on torch's OpenMP team (vLLM's CPU worker also runs its forward pass on an
OpenMP team, with its own kernels, a different pattern of Python between ops, and engine and API
processes beside it), while a store thread encodes and seals one request's stores (every codec
of `serve.codecs` on two real KV chunks) submitted before each prefill, as a warm-up request
submits them: at `nice 19` (the connector's priority before SCHED_IDLE), at the priority the
connector gives its store threads now (async_store.lower_priority: SCHED_IDLE on Linux), or no
store thread. Every mode does the same store work: after its window of `--per` prefills the
bench waits until the thread has stored all of it (`drain_s`), so nothing carries over into the
next mode, and `stored_share` says what share of the window's chunks was stored by the end of
its last prefill (chunks, not CPU time: a kivi2 chunk costs far more than an lz4 one). A
priority that starves the stores puts their work off; it does not make it cheaper. A pause of a
client's round trip (`--gap-ms`) precedes each prefill. Each block asks the three modes in one of
their 6 orders, cycled. `prefill_ratio` is the geometric mean of a mode's prefill time over
another's, paired by block and position, with its t-interval over blocks (paired_log_ratio).
Not here: the SET and Valkey's CPU, vLLM's busy-polling processes, the connector's yield to
forward steps (its encodings start only between steps; here at any time).

    .venv/bin/python bench/store_priority.py [--blocks 12] [--per 4] [--codecs zstd-3 kivi2]

Writes results/bench/store_priority.parquet (one row per prefill) and prints the table.
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import queue
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pandas as pd
import torch
import yaml
from serve_transfer import paged_cache

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
    """Encodes and seals the batches it is given, in order, as the connector's store thread does a
    request's chunks (`batches.join()`: all of them done; an encoder's error ends the bench)."""

    def __init__(self, mode: str) -> None:
        super().__init__(daemon=True, name=f"store-{mode}")
        self.mode, self.priority, self.done, self.error = mode, "", 0, None
        self.batches: queue.Queue[list[tuple[Any, torch.Tensor]]] = queue.Queue()

    def run(self) -> None:
        if self.mode == NICE_MODE:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
            self.priority = NICE_MODE
        else:
            self.priority = lower_priority()
        while True:
            batch = self.batches.get()
            try:
                for i, (wire, chunk) in enumerate(batch):
                    seal(f"chunk{i}", wire.encode(chunk))
                    self.done += 1
            except Exception as err:  # noqa: BLE001 -- reported by the main thread, not a hang
                self.error = err
            self.batches.task_done()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=12, help="a multiple of 6: every order of the 3 modes as often")
    parser.add_argument("--per", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=540, help="a serve warm-up's prompt: 512 + the question")
    parser.add_argument("--gap-ms", type=float, default=30.0)
    parser.add_argument("--codecs", nargs="+", help="default: serve.codecs")
    parser.add_argument("--out", default="results/bench/store_priority.parquet")
    args = parser.parse_args()
    if args.blocks % 6:
        parser.error("--blocks must be a multiple of 6: every order of the 3 modes as often")
    config = yaml.safe_load(Path("config/config.yaml").read_text())
    model_dir = f"resources/models/{config['serve']['model']}"
    cache, spec = paged_cache(model_dir, 512, torch.bfloat16)
    chunks = gather(cache, [0, 1])
    codecs = args.codecs or config["serve"]["codecs"]
    # one request's stores: every codec's two chunks, as a warm-up request submits them
    batch = [(wire_format(c, spec, config["methods"].get(c), seed=0), chunk) for c in codecs for chunk in chunks]
    threads = {mode: StoreThread(mode) for mode in (NICE_MODE, "connector")}
    for thread in threads.values():
        thread.start()
    model = load_model(model_dir, dtype=torch.bfloat16)
    ids = torch.randint(100, 40000, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    orders, rows = list(itertools.permutations([BASELINE, *threads])), []
    with torch.inference_mode():
        for _ in range(3):
            model(ids)
        for block in range(args.blocks):
            for mode in orders[block % len(orders)]:
                worker = threads.get(mode)
                for i in range(args.per):
                    time.sleep(args.gap_ms / 1e3)
                    if worker:
                        worker.batches.put(batch)
                    t = time.perf_counter()
                    model(ids)
                    rows.append({"block": block, "mode": mode, "index": i, "prefill_s": time.perf_counter() - t})
                if worker:  # the window's stores finish before the next mode starts: no carry-over
                    done, start = worker.done, time.perf_counter()
                    worker.batches.join()
                    if worker.error is not None:
                        raise SystemExit(f"{mode} store thread: {worker.error!r}")
                    rows[-1] |= {
                        "drain_s": time.perf_counter() - start,
                        "stored_share": 1 - (worker.done - done) / (args.per * len(batch)),
                    }
                print(f"block {block} {mode:<10} {rows[-1]['prefill_s']:.3f} s", file=sys.stderr, flush=True)
    table = pd.DataFrame(rows)
    table["priority"] = table["mode"].map({m: t.priority for m, t in threads.items()}).fillna("")
    table["tokens"], table["threads"], table["codecs"] = args.tokens, torch.get_num_threads(), ",".join(codecs)
    table["kernel"] = platform.release()
    settings = {"seed": 0, "bench": "store_priority", "tokens": args.tokens, "blocks": args.blocks}
    settings |= {"per": args.per, "gap_ms": args.gap_ms, "codecs": codecs}
    write_table(table, args.out, provenance(settings, model=config["serve"]["model"]))
    print(render(table).to_string(index=False))


def _paired(t: pd.DataFrame, mode: str, base: str) -> dict[str, Any]:
    """`mode`'s prefill time over `base`'s, paired by block and position, the blocks as units."""
    a = t[t["mode"] == mode].set_index(["block", "index"])["prefill_s"]
    b = t[t["mode"] == base].set_index(["block", "index"])["prefill_s"].rename("base")
    pairs = pd.concat([a, b], axis=1, join="inner")
    ratio, low, high, n, units = paired_log_ratio(
        pairs["prefill_s"].to_numpy(), pairs["base"].to_numpy(), pairs.index.get_level_values("block").to_numpy()
    )
    shown = f"{ratio:.3g}" + ("" if pd.isna(low) else f" [{low:.3g}, {high:.3g}]")
    return {"prefill_ratio": shown, "pairs": n, "blocks": units}


def render(t: pd.DataFrame) -> pd.DataFrame:
    """Each store priority's prefills over no-store's and nice 19's over the connector's (paired by
    block and position), with the window's store work: the share done by the end of its last
    prefill and the wait for the rest."""
    rows = []
    for mode, part in t[t["mode"] != BASELINE].groupby("mode", sort=False):
        rows.append(
            {
                "comparison": f"{mode} ({part['priority'].iloc[0]}) / {BASELINE}",
                **_paired(t, mode, BASELINE),
                "median_prefill_s": part["prefill_s"].median(),
                "stored_share": part["stored_share"].median(),
                "drain_s": part["drain_s"].median(),
            }
        )
    rows.append({"comparison": f"{NICE_MODE} / connector", **_paired(t, NICE_MODE, "connector")})
    return pd.DataFrame(rows).round(3)


BLOCKS = {"store-priority": Block(render, ("bench/store_priority.parquet",), make="make bench-core")}


if __name__ == "__main__":
    main()

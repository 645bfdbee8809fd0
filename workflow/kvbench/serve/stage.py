"""One server job of the serve stage: start what the backends need, run the long_doc_qa rounds,
return the request rows, the server's metric deltas per round and the connector's transfers.

Every server gets the same pre-warm (long_doc_qa's five "hi" prompts) before any measured round.
The main server (real weights) then runs, per corpus, the warm-ups (Valkey storing every codec at
once, between two passes of vLLM's prefix-cache warm-up), and the query rounds: on the load
corpora a concurrency sweep (each backend x codec a round per level, with enough requests for
`hits_per_cell` hits; the first level interleaved in blocks, each block after the first behind
lead-ins) and then, at each `load.rates` level, the same kind of round sent open loop (Poisson
arrivals), elsewhere one round per backend at `max_inflight` (Valkey with the first codec),
each whole. After every Valkey round (or block) the stage waits until the store's tally
of queued chunks is 0, so background stores never overlap another cell's requests. The
dummy-weights server runs the Valkey warm-up and query rounds; the fault round (main server) kills
Valkey in the middle of a pass, while a request streams, and starts it again.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import pandas as pd
import valkey as valkey_client

from kvbench.job_secrets import VALKEY_PASSWORD_ENV
from kvbench.serve import backends as bk
from kvbench.serve.async_store import pending
from kvbench.serve.client import chat_body, send_all
from kvbench.serve.documents import serve_prompts
from kvbench.serve.events import read_events
from kvbench.serve.keys import pending_key
from kvbench.serve.metrics import delta, scrape
from kvbench.serve.names import is_lossless
from kvbench.serve.protocol import (
    Planned,
    lead_in,
    poisson_arrivals,
    prewarm_prompts,
    query_round,
    repeats_for_hits,
    warmup_round,
)
from kvbench.serve.valkey_server import RestartableValkey, ValkeyAddress
from kvbench.vllm_server import VLLMClient, vllm_server

NO_CODEC = "-"
ALL_CODECS = "all"  # the valkey warm-up stores every codec at once
SHARED_SALT = ("prefix", *bk.NATIVE)  # backends measured through vLLM's own prefix cache
FLUSH_TIMEOUT_S = 300.0
ARRIVAL_SEED = 500_000  # added to a level's plan seed: its arrival times draw from another stream
LEADIN_SEED = 700_000  # likewise for a lead-in's miss prefix (plus the plan index of the request it repeats)
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "auto": 2}


@dataclass(frozen=True)
class ServeSettings:
    model: str
    dtype: str
    weights: tuple[str, ...]
    corpora: tuple[str, ...]
    backends: tuple[str, ...]
    codecs: tuple[str, ...]
    docs_per_corpus: int
    reference_docs_per_corpus: int
    doc_tokens: int
    question: str
    max_tokens: int
    max_inflight: int
    repeat_count: int
    repeat_mode: str
    hit_miss_ratio: str
    block_size: int
    prewarm: Mapping[str, Any]
    load: Mapping[str, Any]
    store: Mapping[str, Any]
    fault_round: bool
    valkey: Mapping[str, Any]
    interleave_blocks: int

    @classmethod
    def of(cls, cfg: Mapping[str, Any]) -> "ServeSettings":
        return cls(
            **{k: tuple(v) if isinstance(v, list) else v for k, v in cfg.items() if k in cls.__dataclass_fields__}
        )

    @property
    def headline(self) -> str:
        """The codec of the rounds that run one codec: the first configured."""
        return self.codecs[0]


def note(message: str) -> None:
    print(f"[serve] {time.strftime('%H:%M:%S')} {message}", file=sys.stderr, flush=True)


class Rounds:
    """Runs rounds against one server and keeps every row."""

    def __init__(
        self,
        server: str,
        vllm: VLLMClient,
        settings: ServeSettings,
        run_id: str,
        connector: bool,
        served: tuple[str, str | None],
        store: ValkeyAddress | RestartableValkey | None,
        engine: Mapping[str, str] | None = None,
    ) -> None:
        self.server, self.s, self.run_id, self.connector = server, settings, run_id, connector
        self.engine = dict(engine or {})  # vLLM's scheduling mode and model runner (VLLMClient.engine_mode)
        self.base_url, self.api_key, self.log_path = vllm.base_url, vllm.api_key, vllm.log_path
        self.served, self.store = served, store
        self.requests: list[dict[str, Any]] = []
        self.metrics: list[dict[str, Any]] = []
        self.runs = 0

    def run(
        self,
        backend: str,
        codec: str,
        corpus: str,
        planned: list[Planned],
        params: Callable[[Planned, str, str], dict[str, Any]],
        concurrency: int,
        fault: "MidRoundKill | None" = None,
        arrivals: Sequence[float] | None = None,
        rate_rps: float = 0.0,
        block: int = 0,
        **extra: Any,
    ) -> None:
        """One round at `concurrency` requests in flight, or open loop (`arrivals`: each request's
        send time, at `rate_rps`); Valkey rounds end when their stores have. `block`: which slice of
        an interleaved level's plan this round asks (0: a whole round). `fault`: kills Valkey
        during the round and starts it again (what it did goes in the round's metrics)."""
        level = f"r{rate_rps:g}" if arrivals is not None else f"c{concurrency}"
        self.runs += 1  # in the tags: a round asked again at another level (rewarm) keeps its tags apart
        tags = [
            f"{self.run_id}.{self.runs}.{backend}.{codec}.{corpus}.{p.round}.{level}.{p.phase or ''}.{p.index}"
            for p in planned
        ]
        bodies = [chat_body(p.prompt, self.s.max_tokens, **params(p, tag, corpus)) for p, tag in zip(planned, tags)]
        before = scrape(self.base_url)
        start = time.monotonic()
        hooks = {"on_first_token": fault.first_token, "on_done": fault.done} if fault is not None else {}
        in_flight = concurrency or len(bodies)  # 0: open loop, no cap
        results = send_all(self.base_url, bodies, in_flight, api_key=self.api_key, arrivals=arrivals, **hooks)
        round_s = time.monotonic() - start
        # a block's lead-in is not the round's work: its time until the first measured request starts
        measured = [r["start"] for p, r in zip(planned, results) if p.round != "leadin"]
        lead_s = min(measured) - min(r["start"] for r in results) if len(measured) < len(results) else 0.0
        round_s -= lead_s
        extra |= fault.info if fault is not None else {}
        flush_s, flush_timed_out = self.flush() if backend == "valkey" else (0.0, False)
        server = delta(before, scrape(self.base_url))
        key = {
            "run_id": self.run_id,
            "server": self.server,
            "weights": bk.server_weights(self.server),
            "served_dtype": self.served[0],
            "dtype_note": self.served[1],
            "block_size": bk.served_block_size(self.server, self.s.block_size),
            **self.engine,
            "backend": backend,
            "codec": codec,
            "corpus": corpus,
            "round": planned[-1].round,  # a lead-in comes first
            "concurrency": concurrency,
            "rate_rps": float(rate_rps),
            "block": block,
        }
        for p, tag, body, result in zip(planned, tags, bodies, results):
            self.requests.append(
                {
                    **key,
                    "round": p.round,
                    "index": p.index,
                    "phase": p.phase,
                    "doc_id": p.doc_id,
                    "miss": p.miss,
                    "tag": tag,
                    "cache_salt": body.get("cache_salt"),
                    "arrival_s": arrivals[p.index] if arrivals is not None else None,
                    **result,
                }
            )
        ok = [r["ttft_s"] for r in results if r["ttft_s"] is not None]  # lead-ins too, as the server's counters
        self.metrics.append(
            {
                **key,
                "phase": planned[-1].phase,
                "requests": len(planned),
                "leadin_requests": len(planned) - len(measured),
                "leadin_s": lead_s,
                "round_s": round_s,
                "flush_s": flush_s,
                "flush_timed_out": flush_timed_out,
                "client_ttft_mean_s": sum(ok) / len(ok) if ok else float("nan"),
                **extra,
                **server,
            }
        )
        errors = sum(r["error"] is not None for r in results)
        note(
            f"{backend:<9} {codec:<17} {corpus:<9} {planned[-1].round:<6} {level} {len(planned)} requests in "
            f"{round_s:6.1f} s (+{flush_s:.1f} s stores), client TTFT {self.metrics[-1]['client_ttft_mean_s']:.2f} s"
            + (f", {errors} errors" if errors else "")
        )

    def run_cell(self, cell: Cell, params: Callable[[Planned, str, str], dict[str, Any]]) -> None:
        """One of the stage's planned rounds (main_cells, reference_cells)."""
        self.run(
            cell.backend,
            cell.codec,
            cell.corpus,
            cell.planned,
            params,
            cell.concurrency,
            arrivals=cell.arrivals,
            rate_rps=cell.rate_rps,
            block=cell.block,
        )

    def flush(self) -> tuple[float, bool]:
        """Wait until the store's tally of queued chunks is 0 (its background stores are done);
        the seconds waited, and whether FLUSH_TIMEOUT_S passed first (stores starved, e.g. by
        other work on the machine: the next round starts with stores still queued)."""
        start = time.monotonic()
        client = self.store.client()
        while time.monotonic() - start < FLUSH_TIMEOUT_S:
            try:
                if pending(client, pending_key(self.run_id)) == 0:
                    return time.monotonic() - start, False
            except (valkey_client.exceptions.ValkeyError, OSError):
                return time.monotonic() - start, False  # no store (killed): its stores fail and are recorded
            time.sleep(0.05)
        note(f"stores still queued after {FLUSH_TIMEOUT_S:.0f} s: the next round starts with them")
        return time.monotonic() - start, True

    def params(
        self, backend: str, load: str | None, store: list[str], salted: bool = True
    ) -> Callable[[Planned, str, str], dict[str, Any]]:
        """cache_salt: one per corpus where a backend reuses vLLM's prefix cache (the prefix
        warm-up's pass before Valkey's another, so that the pass after it prefills cold too and is
        the one the query rounds reuse), else one per request (so only the backend's own store can
        hit); the connector's choice per request."""

        def make(p: Planned, tag: str, corpus: str) -> dict[str, Any]:
            out: dict[str, Any] = {}
            if salted:
                shared = f"{backend}-{self.run_id}-{corpus}" + ("-before" if p.phase == "before" else "")
                out["cache_salt"] = shared if backend in SHARED_SALT else f"{backend}-{tag}"
            if self.connector:
                out["kv_transfer_params"] = {"tag": tag, "load": load, "store": store}
            return out

        return make


def prewarm(vllm: VLLMClient, settings: ServeSettings, connector: bool) -> None:
    """long_doc_qa's pre-warm on every server alike (first-request costs are no backend's); the
    connector neither loads nor stores it."""
    extra: dict[str, Any] = {"cache_salt": f"prewarm-{uuid.uuid4().hex}"}
    if connector:
        extra["kv_transfer_params"] = {"load": None, "store": []}
    prompts = prewarm_prompts(int(settings.prewarm["prompts"]), int(settings.prewarm["words"]))
    bodies = [chat_body(p, settings.max_tokens, **extra) for p in prompts]
    send_all(vllm.base_url, bodies, settings.max_inflight, api_key=vllm.api_key)


def fault_repeats(docs: int) -> int:
    """How often the fault round's `during` pass asks each document: twice, three requests at least."""
    return max(2, -(-3 // docs))


def store_bound_mb(settings: ServeSettings, chunk_bytes: int) -> int:
    """Valkey's memory cap: every chunk the main server's plan can store (main_cells: the warm-up
    every codec, each miss and lead-in miss its codec; the fault round), each at raw size (lossless
    codecs stay within it, lossy ones far below), plus room for the server itself."""
    chunks_per_doc = settings.doc_tokens // settings.block_size + 1  # the question may complete one more
    docs = {c: {f"{c}{i}": "" for i in range(settings.docs_per_corpus)} for c in settings.corpora}
    backends = bk.server_backends("main", list(settings.backends))
    stored_docs = fault_repeats(settings.docs_per_corpus) * settings.docs_per_corpus
    for cell in main_cells("main", backends, settings, docs, seed=0):  # the miss places do not depend on it
        if cell.backend == "valkey":
            stored_docs += (
                len(cell.planned) * len(cell.store) if cell.codec == ALL_CODECS else sum(p.miss for p in cell.planned)
            )
    return int(stored_docs * chunks_per_doc * chunk_bytes * 1.1 / 2**20) + 128


def chunk_bytes(model_dir: str | Path, block_size: int, dtype_bytes: int) -> int:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    head = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return (
        cfg["num_hidden_layers"]
        * cfg.get("num_key_value_heads", cfg["num_attention_heads"])
        * block_size
        * 2
        * head
        * dtype_bytes
    )


Tables = tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]


def serve_job(
    server: str,
    settings: ServeSettings,
    docs: Mapping[str, pd.DataFrame],
    methods: Mapping[str, Any],
    vllm: Mapping[str, Any],
    model_dir: str,
    seed: int,
    logs: Mapping[str, str],
) -> Tables:
    """All rows of one server job: requests, metric deltas per round, connector transfers. A
    backend this machine cannot serve gets one row per corpus with its reason, and nothing starts."""
    run_id = uuid.uuid4().hex[:10]
    backends = bk.server_backends(server, list(settings.backends))
    reason = bk.unsupported(server, vllm["device"])
    served = bk.served_dtype(settings.dtype, vllm["device"])
    if reason is not None:
        note(f"{server}: {reason}")
        rows = [
            {
                "run_id": run_id,
                "server": server,
                "weights": bk.server_weights(server),
                "served_dtype": served[0],
                "dtype_note": served[1],
                "block_size": bk.served_block_size(server, settings.block_size),
                "backend": b,
                "codec": NO_CODEC,
                "corpus": c,
                "round": None,
                "error": reason,
            }
            for b in backends
            for c in settings.corpora
        ]
        return pd.DataFrame(rows), pd.DataFrame(), pd.DataFrame()
    if served[1]:
        note(served[1])
    from kvbench.models import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    n = max(settings.docs_per_corpus, settings.reference_docs_per_corpus)
    prompts = serve_prompts(
        dict(docs),
        n,
        settings.doc_tokens,
        settings.question,
        lambda text: tokenizer(text, add_special_tokens=False).input_ids,
        tokenizer.decode,
    )
    with tempfile.TemporaryDirectory(prefix="kvbench-serve-") as work:
        return run_server(
            server,
            settings,
            prompts,
            methods,
            {**vllm, "dtype": served[0]},
            served,
            model_dir,
            seed,
            Path(work),
            logs,
            run_id,
        )


def run_server(
    server: str,
    settings: ServeSettings,
    prompts: dict[str, dict[str, str]],
    methods: Mapping[str, Any],
    vllm: Mapping[str, Any],
    served: tuple[str, str | None],
    model_dir: str,
    seed: int,
    workdir: Path,
    logs: Mapping[str, str],
    run_id: str,
) -> Tables:
    backends = bk.server_backends(server, list(settings.backends))
    events = workdir / "events"
    with _servers(server, settings, methods, vllm, model_dir, seed, workdir, logs, run_id, events) as (client, store):
        connector = server in ("main", bk.DUMMY_SERVER) and store is not None
        rounds = Rounds(server, client, settings, run_id, connector, served, store, client.engine_mode(vllm))
        prewarm(client, settings, connector)
        docs = {c: dict(list(prompts[c].items())[: settings.docs_per_corpus]) for c in settings.corpora}
        if server in ("main", bk.DUMMY_SERVER):
            _main_rounds(rounds, backends, settings, docs, seed, store)
        elif server == "lmcache":
            _lmcache_rounds(rounds, settings, docs, seed)
        else:
            _reference_rounds(rounds, server, backends[0], settings, prompts, seed, workdir)
    transfers = read_events(events) if events.is_dir() else pd.DataFrame()
    return pd.DataFrame(rounds.requests), pd.DataFrame(rounds.metrics), transfers


@contextlib.contextmanager
def _servers(
    server: str,
    settings: ServeSettings,
    methods: Mapping[str, Any],
    vllm: Mapping[str, Any],
    model_dir: str,
    seed: int,
    workdir: Path,
    logs: Mapping[str, str],
    run_id: str,
    events: Path,
) -> Iterator[tuple[VLLMClient, RestartableValkey | ValkeyAddress | None]]:
    """Valkey (the stage's own, restartable, or the user's URL) and vLLM with what `server` needs."""
    with contextlib.ExitStack() as stack:
        store, transfer, env = None, None, bk.kvbench_pythonpath()
        if server in ("main", bk.DUMMY_SERVER, "lmcache") and ("valkey" in settings.backends or server == "lmcache"):
            url = settings.valkey.get("url")
            if url is None:
                mb = settings.valkey.get("maxmemory_mb") or store_bound_mb(
                    settings, chunk_bytes(model_dir, settings.block_size, DTYPE_BYTES[vllm["dtype"]])
                )
                note(f"starting valkey (maxmemory {mb} MB)")
                store = RestartableValkey(stack, mb, logs["valkey"], settings.valkey["startup_timeout_s"])
                note(f"valkey pid {store.proc.pid} at {store.url}")
            else:  # the user's own store: never stopped or killed by us
                store = ValkeyAddress(url, os.environ.get(VALKEY_PASSWORD_ENV))
            env |= {VALKEY_PASSWORD_ENV: store.password} if store.password else {}
            if server == "lmcache":
                transfer, env = bk.lmcache_transfer(), env | bk.lmcache_env(store, settings.block_size)
            else:
                codecs = {c: methods.get(c) for c in settings.codecs}
                transfer = bk.valkey_transfer(
                    store.url, run_id, settings.model, codecs, settings.headline, str(events), seed, settings.store
                )
        if server == "example":
            storage = workdir / "example-kv"
            storage.mkdir(parents=True, exist_ok=True)
            stack.callback(shutil.rmtree, storage, True)
            transfer = bk.example_transfer(str(storage))
        run = bk.server_settings(vllm, server, settings.block_size, transfer)
        if store is not None:  # last out: no log of the job keeps the store's password
            stack.callback(bk.mask_secret, logs["vllm"], store.password)
        note(f"starting vLLM for {server} ({vllm['dtype']}): {' '.join(run['extra_args'])}")
        client = stack.enter_context(vllm_server(model_dir, run, seed, logs["vllm"], env=env))
        note(f"vllm pid {client.pid} at {client.base_url}")
        if server == "lmcache":
            bk.require_lmcache_store(logs["vllm"], None)
        yield client, store


def _query_cells(backends: list[str], s: ServeSettings, swept: bool, level_index: int) -> list[tuple[str, str]]:
    """recompute, prefix and the valkey codecs of a query round: the headline codec off the sweep,
    every codec at its lowest level, `load.codecs` above it."""
    cells = [(b, NO_CODEC) for b in ("recompute", "prefix") if b in backends]
    if "valkey" in backends:
        codecs = s.codecs[:1]
        if swept:
            chosen = s.load.get("codecs") if level_index else None
            codecs = [c for c in s.codecs if c in chosen] if chosen else s.codecs
        cells += [("valkey", c) for c in codecs]
    return cells


@dataclass(frozen=True)
class Cell:
    """One round of a server: what it asks, how many at once (or when: `arrivals`, open loop at
    `rate_rps`), what the connector does."""

    backend: str
    codec: str
    corpus: str
    planned: list[Planned]
    load: str | None
    store: tuple[str, ...]
    concurrency: int
    rate_rps: float = 0.0
    arrivals: tuple[float, ...] | None = None
    block: int = 0  # the slice of an interleaved level's plan (0: a whole round)


def sweep_levels(s: ServeSettings, swept: bool) -> list[tuple[int, float]]:
    """(requests in flight, request rate) of each query round of a corpus: the load sweep's
    concurrency levels (rate 0: closed loop), then its `rates` (open loop: 0 in flight, no cap);
    off the sweep one closed-loop round at `max_inflight`."""
    if not swept:
        return [(s.max_inflight, 0.0)]
    return [(int(c), 0.0) for c in s.load["concurrency"]] + [(0, float(r)) for r in s.load.get("rates") or []]


def level_cell(cell: Cell, in_flight: int, rate: float, seed: int) -> Cell:
    """`cell` at one sweep level: open loop sends its requests at seeded Poisson arrivals, with no
    cap on how many are in flight (concurrency 0)."""
    if not rate:
        return replace(cell, concurrency=in_flight)
    return replace(cell, concurrency=0, rate_rps=rate, arrivals=tuple(poisson_arrivals(len(cell.planned), rate, seed)))


def warmup_cells(backends: list[str], s: ServeSettings, prompts: dict[str, str], corpus: str) -> list[Cell]:
    """A corpus's warm-ups: Valkey storing every codec, and vLLM's prefix cache, the reference its
    requests pair with by document, asked in a pass before it and again after it (phases `before`
    and `after`, each every document, cold: the before pass under a salt of its own). A request
    pairs with the geometric mean of its document's two: a drift over the warm-ups cancels, a step
    between the passes (the calm after Valkey's flush) halves, and the summary reports it
    (summary._versus_recompute)."""
    planned = warmup_round(prompts)
    valkey = (
        [Cell("valkey", ALL_CODECS, corpus, planned, None, s.codecs, s.max_inflight)] if "valkey" in backends else []
    )
    if "prefix" not in backends:
        return valkey
    phases = ["before", "after"] if valkey else [None]
    before, *after = [
        Cell("prefix", NO_CODEC, corpus, [replace(p, phase=phase) for p in planned], None, (), s.max_inflight)
        for phase in phases
    ]
    return [before, *valkey, *after]


def plan_blocks(planned: list[Planned], count: int) -> list[list[Planned]]:
    """`planned` cut into `count` consecutive slices of near-equal size (no empty one; none of
    an empty plan)."""
    count = max(1, min(count, len(planned)))
    size, extra = divmod(len(planned), count)
    bounds = [i * size + min(i, extra) for i in range(count + 1)]
    return [planned[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]


def main_cells(
    server: str, backends: list[str], s: ServeSettings, docs: dict[str, dict[str, str]], seed: int
) -> list[Cell]:
    """The main server's rounds in order (the fault round after them), per corpus: its warm-ups,
    then its query rounds per level and cell (kvbench.resources counts them for the cluster
    profile). The load sweep's first level, whose pairs decide the overhead verdicts, runs in
    `interleave_blocks` blocks (numbered from 1; 0: a whole round), each a slice of the level's plan
    asked by every cell in a seeded order, so a request and the recompute request it pairs with
    run within one block's time (tens of seconds), not rounds apart. Each block after the first
    starts with lead-ins (protocol.lead_in): the plan's requests before its slice, one per request
    in flight, asked again, so that its first request follows its predecessor as in a whole round
    (a miss's queued stores included) and not an idle server after the previous cell's flush. The
    other levels and corpora run each cell's round whole, in a seeded order. A whole prefix round
    starts with the warm-up's requests again (round `rewarm`): the rounds before it, other
    backends' requests under their own salts, may have evicted its documents from vLLM's cache."""
    cells = []
    for c, corpus in enumerate(s.corpora):
        cells += warmup_cells(backends, s, docs[corpus], corpus)
        swept = corpus in s.load["corpora"] and server == "main"
        count = s.repeat_count
        if swept:
            count = max(count, repeats_for_hits(len(docs[corpus]), s.hit_miss_ratio, int(s.load["hits_per_cell"])))
        rewarm = [replace(p, round="rewarm") for p in warmup_round(docs[corpus])]
        for level_index, (in_flight, rate) in enumerate(sweep_levels(s, swept)):
            # one plan (and arrival times) per level, the same for every cell (paired), other miss
            # prefixes per level
            level_seed = seed + 1000 * c + level_index
            planned = query_round(docs[corpus], count, s.repeat_mode, s.hit_miss_ratio, level_seed)
            kinds = _query_cells(backends, s, swept, level_index)
            interleaved = swept and level_index == 0 and not rate and len(kinds) > 1
            parts = plan_blocks(planned, s.interleave_blocks if interleaved else 1)
            rng = random.Random(level_seed)
            for b, part in enumerate(parts):
                # the same lead-ins for every cell of the block (paired): the plan's requests before
                # its slice, one a slot, so its first request starts as the others free up
                start = part[0].index
                before = planned[max(0, start - max(1, in_flight)) : start] if b else []
                part = [lead_in(p, docs[corpus], LEADIN_SEED + level_seed + p.index) for p in before] + part
                order = list(kinds)
                rng.shuffle(order)
                for backend, codec in order:
                    if backend == "prefix" and not interleaved:
                        cells.append(Cell("prefix", NO_CODEC, corpus, rewarm, None, (), s.max_inflight))
                    load = codec if backend == "valkey" else None
                    block = b + 1 if interleaved else 0
                    cell = Cell(backend, codec, corpus, part, load, (load,) if load else (), 0, block=block)
                    cells.append(level_cell(cell, in_flight, rate, ARRIVAL_SEED + level_seed))
    return cells


def _main_rounds(
    r: Rounds,
    backends: list[str],
    s: ServeSettings,
    docs: dict[str, dict[str, str]],
    seed: int,
    store: RestartableValkey | ValkeyAddress | None,
) -> None:
    for cell in main_cells(r.server, backends, s, docs, seed):
        params = r.params(cell.backend, cell.load, list(cell.store))
        r.run_cell(cell, params)
    if s.fault_round and "valkey" in backends and r.server == "main":
        _fault_round(r, s, docs, store)


class MidRoundKill:
    """Kills the stage's Valkey (SIGKILL) when the round's first request streams its first token
    (its chunks loaded, the request decoding, the round's other requests queued or in flight) and
    starts it again, empty, on the same port when the next request has ended: that request meets
    a store that is gone (its lookup refused, its stores failing), the ones after it the restarted one.
    A kill or restart that fails is recorded (`fault_error`), never raised: the round goes on."""

    def __init__(self, store: RestartableValkey, run_id: str) -> None:
        self.store, self.run_id = store, run_id
        self.info: dict[str, Any] = {}

    def first_token(self, index: int) -> None:
        if self.info:
            return
        self.info = {"killed_at": time.time(), "killed_at_request": index}
        try:
            client = self.store.client()
            keys = client.scan_iter(match=f"kvbench:{self.run_id}:*", count=1000)
            self.info["lost_chunks"] = sum(1 for key in keys if key.decode() != pending_key(self.run_id))
            self.store.kill()
            note(f"fault: valkey killed (SIGKILL) at request {index}'s first token, {self.info['lost_chunks']} chunks")
        except Exception as err:  # the round goes on (and the restart is still tried): what failed is recorded
            self.info["fault_error"] = f"kill: {type(err).__name__}: {err}"
            note(f"fault: {self.info['fault_error']}")

    def done(self, index: int) -> None:
        if not self.info or "restarted_at" in self.info or index <= self.info["killed_at_request"]:
            return
        try:
            self.store.restart()
            self.info |= {"restarted_at": time.time(), "restarted_after_request": index}
            self.info["down_s"] = self.info["restarted_at"] - self.info["killed_at"]
            note(f"fault: valkey back after request {index} ended ({self.info['down_s']:.2f} s down), empty")
        except Exception as err:
            self.info["fault_error"] = f"restart: {type(err).__name__}: {err}"
            note(f"fault: {self.info['fault_error']}")


def _fault_round(
    r: Rounds, s: ServeSettings, docs: dict[str, dict[str, str]], store: RestartableValkey | ValkeyAddress | None
) -> None:
    """Every document of the first load corpus loads (pass `before`); then (`during`) each is
    asked at least twice, three requests at least, and Valkey, with every chunk of the run in it,
    is killed at the first token of that pass's first request and started again, empty, when the
    second has ended (MidRoundKill): the second finds no store; later ones find the restarted store,
    a miss (recomputed and stored again) until the pass has stored their document again, then a
    load; then each once more (`reloaded`: loaded from the restarted store). With more than one
    request in flight, others overlap the outage at any point of theirs, and the restart follows
    the first of them to end."""
    if not isinstance(store, RestartableValkey):
        raise ValueError("serve.fault_round kills Valkey: it needs the stage's own server (serve.valkey.url: null)")
    corpus = next((c for c in s.corpora if c in s.load["corpora"]), s.corpora[0])
    codec = next((c for c in s.codecs if is_lossless(c)), s.headline)  # lossless: a wrong load would show
    params = r.params("valkey", codec, [codec])

    def fault_pass(phase: str, times: int = 1, **extra: Any) -> None:
        items = list(docs[corpus].items()) * times
        planned = [Planned("fault", i, doc, text, False, phase) for i, (doc, text) in enumerate(items)]
        r.run("valkey", codec, corpus, planned, params, s.max_inflight, **extra)

    fault_pass("before")
    fault_pass("during", times=fault_repeats(len(docs[corpus])), fault=MidRoundKill(store, r.run_id))
    note(f"fault: valkey pid {store.proc.pid} at {store.url}")
    fault_pass("reloaded")


def _lmcache_rounds(r: Rounds, s: ServeSettings, docs: dict[str, dict[str, str]], seed: int) -> None:
    """LMCache (GPU): warm-up and query rounds without a cache_salt (vLLM's prefix cache is off
    on this server), then each document once more with a fresh salt: whether LMCache's hits
    survive a salt is what the `salted` rows record (a silent miss shows as no cached tokens)."""
    for c, corpus in enumerate(s.corpora):
        plain = r.params("lmcache", None, [], salted=False)
        r.run("lmcache", NO_CODEC, corpus, warmup_round(docs[corpus]), plain, s.max_inflight)
        bk.require_lmcache_store(r.log_path, bk.lmcache_chunks(r.store.client()))
        r.run(
            "lmcache",
            NO_CODEC,
            corpus,
            query_round(docs[corpus], s.repeat_count, s.repeat_mode, s.hit_miss_ratio, seed + 1000 * c),
            plain,
            s.max_inflight,
        )
        salted = [Planned("salted", i, doc, text, False) for i, (doc, text) in enumerate(docs[corpus].items())]
        r.run(
            "lmcache",
            NO_CODEC,
            corpus,
            salted,
            r.params("lmcache", None, []),
            s.max_inflight,
            lmcache_version=bk.lmcache_version(),
        )


def reference_cells(
    server: str, backend: str, s: ServeSettings, prompts: dict[str, dict[str, str]], seed: int
) -> list[Cell]:
    """An example or vLLM-native server's rounds: per corpus a warm-up of its reference documents,
    then query rounds with enough repeats for `load.hits_per_cell` hits; a vLLM-native cache at
    every `load.concurrency` level on the load corpora, as the main server's cells are."""
    codec = "safetensors" if server == "example" else NO_CODEC
    cells = []
    for c, corpus in enumerate(s.corpora):
        chosen = dict(list(prompts[corpus].items())[: s.reference_docs_per_corpus])
        count = max(s.repeat_count, repeats_for_hits(len(chosen), s.hit_miss_ratio, int(s.load["hits_per_cell"])))
        swept = server in bk.NATIVE and corpus in s.load["corpora"]
        cells.append(Cell(backend, codec, corpus, warmup_round(chosen), None, (), s.max_inflight))
        for level_index, (in_flight, rate) in enumerate(sweep_levels(s, swept)):
            level_seed = seed + 1000 * c + level_index
            planned = query_round(chosen, count, s.repeat_mode, s.hit_miss_ratio, level_seed)
            cell = Cell(backend, codec, corpus, planned, None, (), 0)
            cells.append(level_cell(cell, in_flight, rate, ARRIVAL_SEED + level_seed))
    return cells


def _reference_rounds(
    rounds: Rounds,
    server: str,
    backend: str,
    s: ServeSettings,
    prompts: dict[str, dict[str, str]],
    seed: int,
    workdir: Path,
) -> None:
    storage, params = workdir / "example-kv", rounds.params(backend, None, [])
    for cell in reference_cells(server, backend, s, prompts, seed):
        before = _dir_bytes(storage)
        rounds.run_cell(cell, params)
        if server == "example":
            rounds.metrics[-1]["disk_bytes_written"] = _dir_bytes(storage) - before


def _dir_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) if folder.is_dir() else 0

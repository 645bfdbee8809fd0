"""One server job of the serve stage: start what the backends need, run the long_doc_qa rounds,
return the request rows, the server's metric deltas per round and the connector's transfers."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import pandas as pd

from kvbench.serve import backends as bk
from kvbench.serve.client import chat_body, send_all
from kvbench.serve.documents import serve_prompts
from kvbench.serve.events import read_events
from kvbench.serve.metrics import delta, scrape
from kvbench.serve.protocol import Planned, parse_ratio, query_round, warmup_round
from kvbench.serve.summary import DTYPE_BYTES
from kvbench.serve.valkey_server import valkey_server
from kvbench.vllm_server import vllm_server

NO_CODEC = "-"
ALL_CODECS = "all"  # the valkey warm-up stores every codec at once
SHARED_SALT = ("prefix", "fp8")  # backends measured through vLLM's own prefix cache


@dataclass(frozen=True)
class ServeSettings:
    model: str
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
    fault_round: bool
    valkey: Mapping[str, Any]

    @classmethod
    def of(cls, cfg: Mapping[str, Any]) -> "ServeSettings":
        return cls(
            **{k: tuple(v) if isinstance(v, list) else v for k, v in cfg.items() if k in cls.__dataclass_fields__}
        )


def note(message: str) -> None:
    print(f"[serve] {time.strftime('%H:%M:%S')} {message}", file=sys.stderr, flush=True)


class Rounds:
    """Runs rounds against one server and keeps every row."""

    def __init__(self, server: str, base_url: str, settings: ServeSettings, run_id: str, connector: bool) -> None:
        self.server, self.base_url, self.s, self.run_id, self.connector = server, base_url, settings, run_id, connector
        self.requests: list[dict[str, Any]] = []
        self.metrics: list[dict[str, Any]] = []

    def run(
        self,
        backend: str,
        codec: str,
        corpus: str,
        planned: list[Planned],
        params: Callable[[Planned, str, str], dict[str, Any]],
        between: Callable[[], None] | None = None,
    ) -> None:
        """One round; `between` runs after the first half of the requests (fault injection)."""
        tags = [f"{self.run_id}.{backend}.{codec}.{corpus}.{p.round}.{p.index}" for p in planned]
        bodies = [chat_body(p.prompt, self.s.max_tokens, **params(p, tag, corpus)) for p, tag in zip(planned, tags)]
        before = scrape(self.base_url)
        start = time.monotonic()
        if between is None:
            results = send_all(self.base_url, bodies, self.s.max_inflight)
        else:
            half = len(bodies) // 2
            results = send_all(self.base_url, bodies[:half], self.s.max_inflight)
            between()
            results += send_all(self.base_url, bodies[half:], self.s.max_inflight)
        round_s = time.monotonic() - start
        server = delta(before, scrape(self.base_url))
        key = {
            "run_id": self.run_id,
            "server": self.server,
            "backend": backend,
            "codec": codec,
            "corpus": corpus,
            "round": planned[0].round,
        }
        for p, tag, body, result in zip(planned, tags, bodies, results):
            self.requests.append(
                {
                    **key,
                    "index": p.index,
                    "doc_id": p.doc_id,
                    "miss": p.miss,
                    "tag": tag,
                    "cache_salt": body.get("cache_salt"),
                    **result,
                }
            )
        ok = [r["ttft_s"] for r in results if r["ttft_s"] is not None]
        self.metrics.append(
            {
                **key,
                "requests": len(planned),
                "round_s": round_s,
                "client_ttft_mean_s": sum(ok) / len(ok) if ok else float("nan"),
                **server,
            }
        )
        errors = sum(r["error"] is not None for r in results)
        note(
            f"{backend:<9} {codec:<17} {corpus:<9} {planned[0].round:<6} {len(planned)} requests in {round_s:6.1f} s, "
            f"client TTFT {self.metrics[-1]['client_ttft_mean_s']:.2f} s, server {server['server_ttft_mean_s']:.2f} s"
            + (f", {errors} errors" if errors else "")
        )

    def params(self, backend: str, load: str | None, store: list[str]) -> Callable[[Planned, str, str], dict[str, Any]]:
        """cache_salt: one per corpus where a backend reuses vLLM's prefix cache, else one per
        request (so only the backend's own store can hit); the connector's choice per request."""

        def make(p: Planned, tag: str, corpus: str) -> dict[str, Any]:
            salt = f"{backend}-{self.run_id}-{corpus}" if backend in SHARED_SALT else f"{backend}-{tag}"
            out: dict[str, Any] = {"cache_salt": salt}
            if self.connector:
                out["kv_transfer_params"] = {"tag": tag, "load": load, "store": store}
            return out

        return make


def rounds_for(
    prompts: dict[str, str], settings: ServeSettings, seed: int, n_docs: int
) -> tuple[list[Planned], list[Planned]]:
    chosen = dict(list(prompts.items())[:n_docs])
    return warmup_round(chosen), query_round(
        chosen, settings.repeat_count, settings.repeat_mode, settings.hit_miss_ratio, seed
    )


def warm_server(base_url: str, max_tokens: int, connector: bool) -> None:
    """One short request before any measured round (first-request costs are not a backend's)."""
    extra: dict[str, Any] = {"cache_salt": f"warm-{uuid.uuid4().hex}"}
    if connector:
        extra["kv_transfer_params"] = {"load": None, "store": []}
    send_all(base_url, [chat_body("Warm-up.", max_tokens, **extra)], 1)


def store_bound_mb(settings: ServeSettings, chunk_bytes: int) -> int:
    """Valkey's memory cap: every chunk the run can store, each at raw size (lossless codecs stay
    within it, lossy ones far below), plus room for the server itself."""
    chunks_per_doc = settings.doc_tokens // settings.block_size + 1  # the question may complete one more
    hit, miss = parse_ratio(settings.hit_miss_ratio)
    misses = sum(i % (hit + miss) >= hit for i in range(settings.docs_per_corpus * settings.repeat_count))
    n_codecs = len(settings.codecs)
    docs = settings.docs_per_corpus * n_codecs + misses * n_codecs  # the fault round replays stored prompts
    return int(len(settings.corpora) * docs * chunks_per_doc * chunk_bytes * 1.1 / 2**20) + 128


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
    backends = [b for b in settings.backends if bk.SERVER_OF[b] == server]
    reason = bk.unsupported(server, vllm["device"])
    if reason is not None:
        note(f"{server}: {reason}")
        rows = [
            {
                "run_id": run_id,
                "server": server,
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
        return run_server(server, settings, prompts, methods, vllm, model_dir, seed, Path(work), logs, run_id)


def run_server(
    server: str,
    settings: ServeSettings,
    prompts: dict[str, dict[str, str]],
    methods: Mapping[str, Any],
    vllm: Mapping[str, Any],
    model_dir: str,
    seed: int,
    workdir: Path,
    logs: Mapping[str, str],
    run_id: str,
) -> Tables:
    backends = [b for b in settings.backends if bk.SERVER_OF[b] == server]
    events = workdir / "events"
    with _servers(server, settings, methods, vllm, model_dir, seed, workdir, logs, run_id, events) as (base, valkey):
        connector = server == "main" and valkey is not None
        rounds = Rounds(server, base, settings, run_id, connector)
        warm_server(base, settings.max_tokens, connector)
        if server == "main":
            _main_rounds(rounds, backends, settings, prompts, seed, valkey)
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
) -> Iterator[tuple[str, Any]]:
    with contextlib.ExitStack() as stack:
        valkey, transfer, env = None, None, bk.kvbench_pythonpath()
        if (server == "main" and "valkey" in settings.backends) or server == "lmcache":
            url = settings.valkey.get("url")
            if url is None:
                mb = settings.valkey.get("maxmemory_mb") or store_bound_mb(
                    settings, chunk_bytes(model_dir, settings.block_size, DTYPE_BYTES[vllm["dtype"]])
                )
                note(f"starting valkey (maxmemory {mb} MB)")
                url, proc = stack.enter_context(valkey_server(mb, logs["valkey"], settings.valkey["startup_timeout_s"]))
                note(f"valkey pid {proc.pid} at {url}")
                valkey = proc
            else:
                valkey = url  # the user's own store: never stopped or killed by us
            if server == "main":
                codecs = {c: methods.get(c) for c in settings.codecs}
                transfer = bk.valkey_transfer(
                    url, run_id, settings.model, codecs, settings.codecs[0], str(events), seed
                )
            else:
                transfer, env = bk.lmcache_transfer(), env | bk.lmcache_env(url, vllm["cpu_kvcache_space_gb"])
        if server == "example":
            storage = workdir / "example-kv"
            storage.mkdir(parents=True, exist_ok=True)
            stack.callback(shutil.rmtree, storage, True)
            transfer = bk.example_transfer(str(storage))
        args = list(vllm.get("extra_args", [])) + bk.server_args(server, settings.block_size, transfer)
        note(f"starting vLLM for {server}: {' '.join(args)}")
        client = stack.enter_context(vllm_server(model_dir, {**vllm, "extra_args": args}, seed, logs["vllm"], env=env))
        note(f"vllm pid {client.pid} at {client.base_url}")
        yield client.base_url, valkey


def _main_rounds(
    rounds: Rounds, backends: list[str], s: ServeSettings, prompts: dict[str, dict[str, str]], seed: int, valkey: Any
) -> None:
    plans = {c: rounds_for(prompts[c], s, seed, s.docs_per_corpus) for c in s.corpora}
    for backend in [b for b in ("recompute", "prefix") if b in backends]:
        for corpus in s.corpora:
            warm, query = plans[corpus]
            params = rounds.params(backend, None, [])
            if backend == "prefix":  # recompute has nothing to warm: its warm-up would be its query round again
                rounds.run(backend, NO_CODEC, corpus, warm, params)
            rounds.run(backend, NO_CODEC, corpus, query, params)
    if "valkey" not in backends:
        return
    for corpus in s.corpora:
        rounds.run("valkey", ALL_CODECS, corpus, plans[corpus][0], rounds.params("valkey", None, list(s.codecs)))
    for codec in s.codecs:
        for corpus in s.corpora:
            rounds.run("valkey", codec, corpus, plans[corpus][1], rounds.params("valkey", codec, [codec]))
    if s.fault_round:
        corpus, codec = s.corpora[0], s.codecs[0]
        # every document twice, all planned hits (the warm-up stored them): the first pass loads,
        # the second comes after the kill, so each of its requests is a hit that must recompute
        chosen = list(prompts[corpus].items())[: s.docs_per_corpus]
        fault = [Planned("fault", i, doc, text, False) for i, (doc, text) in enumerate(chosen * 2)]

        def kill() -> None:
            if isinstance(valkey, str):
                raise ValueError(
                    "serve.fault_round kills Valkey: it needs the stage's own server (serve.valkey.url: null)"
                )
            note("fault: killing valkey (SIGKILL) in the middle of the round")
            os.killpg(valkey.pid, signal.SIGKILL)
            valkey.wait(timeout=30)

        rounds.run("valkey", codec, corpus, fault, rounds.params("valkey", codec, [codec]), between=kill)


def _reference_rounds(
    rounds: Rounds,
    server: str,
    backend: str,
    s: ServeSettings,
    prompts: dict[str, dict[str, str]],
    seed: int,
    workdir: Path,
) -> None:
    storage = workdir / "example-kv"
    for corpus in s.corpora:
        for planned in rounds_for(prompts[corpus], s, seed, s.reference_docs_per_corpus):
            before = _dir_bytes(storage)
            rounds.run(
                backend,
                "safetensors" if server == "example" else NO_CODEC,
                corpus,
                planned,
                rounds.params(backend, None, []),
            )
            if server == "example":
                rounds.metrics[-1]["disk_bytes_written"] = _dir_bytes(storage) - before


def _dir_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) if folder.is_dir() else 0

"""Serve settings the schema cannot judge are refused at parse time, naming the key."""

import json
from dataclasses import replace

import pytest

from kvbench.checks import check_config
from kvbench.config import ConfigError
from kvbench.serve.backends import lmcache_env, lmcache_transfer, served_dtype, server_args, servers, unsupported
from kvbench.serve.valkey_server import ValkeyAddress
from kvbench.tinyrun import REPO, default_config

SCHEMA = REPO / "workflow" / "schemas" / "config.schema.yaml"


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda c: c["serve"].update(codecs=["snapkv"]),
            "serve.codecs: method 'snapkv' (kind snapkv) is not a wire format",
        ),
        (lambda c: c["serve"].update(codecs=["gzip"]), "serve.codecs: 'gzip' is neither a codec"),
        (lambda c: c["serve"].update(hit_miss_ratio="0:0"), "serve.hit_miss_ratio"),
        (lambda c: c["serve"].update(corpora=["imported"]), "serve.corpora: 'imported' needs corpus.imported.path"),
        (
            lambda c: (c["serve"].update(fault_round=True), c["serve"]["valkey"].update(url="redis://10.0.0.1:6379/0")),
            "serve.fault_round: it kills Valkey",
        ),
        (lambda c: c["serve"]["load"].update(corpora=["imported"]), "serve.load.corpora: 'imported' is not one of"),
        (lambda c: c["serve"]["load"].update(concurrency=[2, 1]), "serve.load.concurrency: .2, 1. must be strictly"),
        (lambda c: c["serve"].update(interleave_blocks=3), "serve.interleave_blocks: 3 blocks give no interval"),
        (
            lambda c: c["serve"]["load"].update(codecs=["zstd-9"]),
            "serve.load.codecs: 'zstd-9' is not one of serve.codecs",
        ),
        (
            lambda c: c["report"]["scenarios"]["memory-bound"]["serve"]["limits"].update(ttft_s={"max": 1}),
            "report.scenarios.memory-bound.serve.limits",
        ),
    ],
)
def test_bad_serve_settings_are_refused(edit, message):
    config = default_config()
    edit(config)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_config(config, SCHEMA)


def test_default_serve_settings_pass_and_need_two_servers_here():
    config = default_config()
    check_config(config, SCHEMA)
    assert servers(config["serve"]["backends"], config["serve"]["weights"]) == ["main", "dummy", "lmcache"]
    assert unsupported("lmcache", "cpu") is not None  # so two vLLM servers start here: real and dummy weights
    assert servers(["valkey", "recompute", "prefix"]) == ["main"]
    assert servers(["recompute", "vllm-fp8"], ["real", "dummy"]) == ["main", "vllm-fp8"]  # no valkey: no dummy
    assert server_args("dummy", 256)[-2:] == ["--load-format", "dummy"]
    assert "--no-enable-prefix-caching" in server_args("lmcache", 256)
    assert unsupported("lmcache", "cpu").startswith("unsupported: LMCache")
    assert unsupported("main", "cpu") is None and unsupported("lmcache", "cuda") is None
    assert server_args("vllm-fp8", 256)[-2:] == ["--kv-cache-dtype", "fp8"]
    with pytest.raises(ValueError, match="unknown serve backend 'redis'"):
        servers(["redis"])


def test_bf16_is_served_only_where_the_cpu_has_avx512_bf16(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    assert served_dtype("bfloat16", "cpu") == ("bfloat16", None)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    dtype, reason = served_dtype("bfloat16", "cpu")
    assert dtype == "float32" and "lacks AVX-512 BF16" in reason
    assert served_dtype("bfloat16", "cuda") == ("bfloat16", None) and served_dtype("float32", "cpu") == (
        "float32",
        None,
    )


def test_lmcache_reaches_the_same_store_over_resp_with_its_password_in_the_environment_only():
    # lmcache 0.5.6: valkey:// needs valkey-glide-sync, which neither lmcache nor our lock has (without
    # it LMCache runs with no remote store, silently); its RESP adapter reads LMCACHE_RESP_PASSWORD
    # outside the config it logs whole (a password in LMCACHE_EXTRA_CONFIG would be printed).
    store = ValkeyAddress("redis://127.0.0.1:6400/0", "s3cret")
    env = lmcache_env(store, 256)
    assert env["LMCACHE_REMOTE_URL"] == "resp://127.0.0.1:6400" and env["LMCACHE_CHUNK_SIZE"] == "256"
    assert env["LMCACHE_RESP_PASSWORD"] == "s3cret" and env["LMCACHE_SAVE_UNFULL_CHUNK"] == "False"
    assert "LMCACHE_EXTRA_CONFIG" not in env and "LMCACHE_USE_EXPERIMENTAL" not in env  # 0.5.6 reads neither
    logged = {k: v for k, v in env.items() if k != "LMCACHE_RESP_PASSWORD"}  # what LMCache's config holds
    assert "s3cret" not in json.dumps(logged) + json.dumps(lmcache_transfer())
    assert "LMCACHE_RESP_PASSWORD" not in lmcache_env(ValkeyAddress(store.url, None), 256)
    glide = (REPO / "envs" / "gpu.lock.txt").read_text()
    assert "valkey-glide-sync" not in glide  # so valkey:// would fail: resp:// it is


def test_the_serve_only_mode_refuses_dummy_weights_for_a_backend_without_a_dummy_server(capsys):
    from kvbench.serve.__main__ import parse

    assert parse(["--backend", "valkey", "--weights", "dummy"]).weights == "dummy"
    with pytest.raises(SystemExit):
        parse(["--backend", "vllm-fp8", "--weights", "dummy"])
    assert "--weights dummy serves the valkey backend only" in capsys.readouterr().err


def test_the_sweep_runs_every_codec_at_its_lowest_level_and_load_codecs_above():
    from kvbench.serve.stage import ServeSettings, _query_cells

    config = default_config()
    check_config(config, SCHEMA)  # fills the schema's defaults
    s = ServeSettings.of(config["serve"])
    backends = ["recompute", "prefix", "valkey"]
    lowest, higher = (_query_cells(backends, s, True, i) for i in (0, 1))
    assert [c for b, c in lowest if b == "valkey"] == list(s.codecs)
    assert [c for b, c in higher if b == "valkey"] == [c for c in s.codecs if c in s.load["codecs"]]
    assert [b for b, _ in higher[:2]] == ["recompute", "prefix"]
    assert _query_cells(backends, s, False, 0)[2:] == [("valkey", s.codecs[0])]  # off the sweep: the headline


def test_a_vllm_native_cache_runs_the_load_sweep_and_an_example_server_one_level():
    from kvbench.serve.stage import ServeSettings, reference_cells

    config = default_config()
    check_config(config, SCHEMA)
    s = ServeSettings.of(config["serve"])
    prompts = {c: {f"{c}{i}": f"text {c} {i}" for i in range(s.docs_per_corpus)} for c in s.corpora}
    native = reference_cells("vllm-fp8", "vllm-fp8", s, prompts, seed=3)
    levels = [(c.corpus, c.concurrency) for c in native if c.planned[0].round == "query"]
    swept = [
        (corpus, level)
        for corpus in s.corpora
        for level in (s.load["concurrency"] if corpus in s.load["corpora"] else [s.max_inflight])
    ]
    assert levels == swept and [c.corpus for c in native if c.planned[0].round == "warmup"] == list(s.corpora)
    for cell in native:
        docs = {p.doc_id for p in cell.planned}
        assert len(docs) == s.reference_docs_per_corpus  # the reference documents only
        if cell.planned[0].round == "query":
            assert sum(not p.miss for p in cell.planned) >= s.load["hits_per_cell"]
    example = reference_cells("example", "example", s, prompts, seed=3)
    assert {c.concurrency for c in example} == {s.max_inflight} and {c.codec for c in example} == {"safetensors"}


def _default_cells(seed: int, blocks: int | None = None):
    from kvbench.serve.stage import ServeSettings, main_cells

    config = default_config()
    if blocks is not None:
        config["serve"]["interleave_blocks"] = blocks
    check_config(config, SCHEMA)
    s = ServeSettings.of(config["serve"])
    docs = {c: {f"{c}{i}": f"text {c} {i}" for i in range(s.docs_per_corpus)} for c in s.corpora}
    return s, main_cells("main", ["recompute", "prefix", "valkey"], s, docs, seed)


def test_the_first_level_runs_interleaved_blocks_of_one_plan_in_an_order_shuffled_by_the_seed():
    """The verdicts' pairs must not sit rounds apart: at a corpus's first level every cell asks
    each slice of the one plan before any cell asks the next, in a seeded order per block
    (recompute, every pair's reference, not always first); the slices cover the plan once per cell."""
    s, cells = _default_cells(3)
    assert s.interleave_blocks > 1
    level = [c for c in cells if c.corpus == "realistic" and c.planned[-1].round == "query" and c.concurrency == 1]
    kinds = sorted({(c.backend, c.codec) for c in level})
    assert kinds == sorted([("recompute", "-"), ("prefix", "-")] + [("valkey", c) for c in s.codecs])
    runs = [level[i : i + len(kinds)] for i in range(0, len(level), len(kinds))]
    assert len(runs) == s.interleave_blocks
    orders = []
    for block in runs:
        assert sorted((c.backend, c.codec) for c in block) == kinds  # every cell once per block
        assert len({tuple((p.index, p.prompt) for p in c.planned) for c in block}) == 1  # the same slice
        orders.append([(c.backend, c.codec) for c in block])
    assert len({tuple(o) for o in orders}) > 1 and {o[0] for o in orders} != {("recompute", "-")}
    for kind in kinds:
        asked = [p.index for c in level if (c.backend, c.codec) == kind for p in c.planned if p.round == "query"]
        assert asked == list(range(len(asked)))  # the plan in order, once
    again, other = _default_cells(3)[1], _default_cells(4)[1]
    assert [(c.backend, c.codec) for c in again] == [(c.backend, c.codec) for c in cells]
    assert [(c.backend, c.codec) for c in other] != [(c.backend, c.codec) for c in cells]
    # off the first level, each cell's round is whole; a whole prefix round asks its documents first
    whole = [
        c for c in cells if c.planned[0].round == "rewarm" or (c.planned[0].round == "query" and c.concurrency != 1)
    ]
    planned = sum(p.round == "query" for c in level for p in c.planned) // len(kinds)
    assert all(len(c.planned) == planned for c in whole if c.planned[0].round == "query")
    warmup = next(c for c in cells if c.backend == "valkey" and c.planned[0].round == "warmup")
    prefix_rounds = [i for i, c in enumerate(whole) if c.backend == "prefix" and c.planned[0].round == "query"]
    assert prefix_rounds
    for i in prefix_rounds:
        before = whole[i - 1]
        assert before.backend == "prefix" and before.planned[0].round == "rewarm"
        assert [(p.doc_id, p.prompt) for p in before.planned] == [(p.doc_id, p.prompt) for p in warmup.planned]
    # interleaved blocks keep the prefix documents fresh: no rewarm between the level's first cell and its last
    span = cells[cells.index(level[0]) : cells.index(level[-1]) + 1]
    assert len(span) == len(level) and not any(p.round == "rewarm" for c in span for p in c.planned)


def test_each_block_after_the_first_starts_behind_its_predecessor_in_the_plan():
    """A block's first request follows the plan's previous request (asked again, a miss under a new
    prefix so that it stores again), not an idle server after the previous cell's flush; every cell
    of the block gets the same lead-in, and no figure reads it (round `leadin`)."""
    from kvbench.serve.protocol import Planned, lead_in

    s, cells = _default_cells(3)
    level = [c for c in cells if c.corpus == "realistic" and c.planned[-1].round == "query" and c.concurrency == 1]
    by_block: dict[int, list] = {}
    for c in level:
        by_block.setdefault(c.block, []).append(c)
    assert sorted(by_block) == list(range(1, s.interleave_blocks + 1))  # 0: a whole round
    plan = {p.index: p for c in level if c.backend == "recompute" for p in c.planned if p.round == "query"}
    assert all(p.round == "query" for c in by_block[1] for p in c.planned)
    leadin_misses = 0
    for block, group in by_block.items():
        if block == 1:
            continue
        heads = {c.planned[0] for c in group}
        assert len(heads) == 1  # the same lead-in for every cell
        head = heads.pop()
        first = group[0].planned[1]
        previous = plan[first.index - 1]
        assert head.round == "leadin" and sum(p.round == "leadin" for p in group[0].planned) == 1
        assert (head.index, head.doc_id, head.miss) == (previous.index, previous.doc_id, previous.miss)
        if head.miss:  # a prefix of its own: what the previous block stored under the old one cannot hit
            leadin_misses += 1
            assert head.prompt != previous.prompt and head.prompt.endswith(previous.prompt.split(" ", 1)[1])
        else:
            assert head.prompt == previous.prompt
    # Valkey's bound has room for the lead-ins that miss (the swept corpus's only), each stored by every codec
    from kvbench.serve.stage import store_bound_mb

    whole, _ = _default_cells(3, blocks=1)
    assert s.load["corpora"] == ["realistic"]
    # by hand: 42 requests in 6 blocks of 7 start at 7, 14, 21, 28, 35; of their predecessors only 27 misses (3:1)
    assert (len(plan), s.hit_miss_ratio, leadin_misses) == (42, "3:1", 1)
    assert store_bound_mb(s, 10**6) - store_bound_mb(whole, 10**6) == pytest.approx(
        leadin_misses * len(s.codecs) * (s.doc_tokens // s.block_size + 1) * 1.1 * 10**6 / 2**20, abs=1
    )
    miss = Planned("query", 7, "d", "123 text", True)
    assert lead_in(miss, {"d": "text"}, 1) == lead_in(miss, {"d": "text"}, 1) != lead_in(miss, {"d": "text"}, 2)
    assert lead_in(replace(miss, miss=False, prompt="text"), {"d": "text"}, 1).prompt == "text"


def test_lead_ins_fill_every_slot_of_a_level_above_one_in_flight():
    """At K in flight a block starts behind the plan's K requests before it, so that its first
    request starts as one of them frees a slot, as in a whole round."""
    config = default_config()
    config["serve"]["load"]["concurrency"] = [2, 4]
    check_config(config, SCHEMA)
    from kvbench.serve.stage import ServeSettings, main_cells

    s = ServeSettings.of(config["serve"])
    docs = {c: {f"{c}{i}": f"text {c} {i}" for i in range(s.docs_per_corpus)} for c in s.corpora}
    cells = main_cells("main", ["recompute", "prefix", "valkey"], s, docs, 3)
    level = [c for c in cells if c.corpus == "realistic" and c.planned[-1].round == "query" and c.concurrency == 2]
    for cell in level:
        leads = [p for p in cell.planned if p.round == "leadin"]
        first = next(p for p in cell.planned if p.round == "query")
        assert [p.index for p in leads] == ([] if cell.block == 1 else [first.index - 2, first.index - 1])


def test_only_the_load_sweeps_first_level_is_interleaved():
    """Off the sweep a corpus's level has too few misses for an interval: its cells run whole."""
    s, cells = _default_cells(3)
    other = [c for c in cells if c.corpus not in s.load["corpora"] and c.planned[-1].round == "query"]
    assert other and {c.block for c in other} == {0}
    assert not any(p.round == "leadin" for c in other for p in c.planned)


def test_the_prefix_warm_up_runs_before_and_after_the_valkey_warm_up_each_pass_every_document():
    """The warm-up pairs' reference brackets Valkey's warm-up in time: each document cold in both
    passes (the pass before under a salt of its own, so that the pass after prefills too); with
    interleaving off the query rounds run whole, one per cell and level, in a seeded order."""
    s, cells = _default_cells(3)
    for corpus in s.corpora:
        warm = [c for c in cells if c.corpus == corpus and c.planned[0].round == "warmup"]
        assert [c.backend for c in warm] == ["prefix", "valkey", "prefix"]
        docs = [p.doc_id for p in warm[1].planned]
        for cell, phase in ((warm[0], "before"), (warm[2], "after")):
            assert [p.doc_id for p in cell.planned] == docs and {p.phase for p in cell.planned} == {phase}
        # a corpus's warm-ups come right before its query rounds (its prefix documents still cached)
        first = cells.index(warm[0])
        assert all(c.corpus == corpus for c in cells[first : first + 4])
    _, plain = _default_cells(3, blocks=1)
    query = [c for c in plain if c.planned[0].round == "query" and c.corpus == "realistic" and c.concurrency == 1]
    assert len(query) == 2 + len(s.codecs) and len({len(c.planned) for c in query}) == 1
    assert not any(p.round == "leadin" for c in plain for p in c.planned)


def test_the_prefix_warm_ups_passes_have_salts_of_their_own_and_the_pass_after_is_the_queries():
    from kvbench.serve.protocol import Planned
    from kvbench.serve.stage import Rounds

    rounds = Rounds.__new__(Rounds)
    rounds.run_id, rounds.connector = "r1", False
    make = rounds.params("prefix", None, [])
    salt = {
        phase: make(Planned("warmup", 0, "d", "x", False, phase), "tag", "realistic")["cache_salt"]
        for phase in ("before", "after", None)
    }
    assert salt["before"] != salt["after"] == salt[None]


def test_a_level_with_one_cell_runs_whole():
    """Interleaving one cell buys nothing and costs a flush and a lead-in per block."""
    from kvbench.serve.stage import main_cells

    s, _ = _default_cells(3)
    docs = {c: {f"{c}{i}": f"text {c} {i}" for i in range(s.docs_per_corpus)} for c in s.corpora}
    dummy = main_cells("dummy", ["valkey"], s, docs, 3)
    query = [c for c in dummy if c.planned[-1].round == "query"]
    assert len(query) == len(s.corpora) and {c.block for c in query} == {0}
    assert not any(p.round == "leadin" for c in dummy for p in c.planned)


def test_plan_blocks_cover_the_plan_once_without_empty_slices():
    from kvbench.serve.protocol import Planned
    from kvbench.serve.stage import plan_blocks

    plan = [Planned("query", i, "d", "x", False) for i in range(7)]
    for count in (1, 3, 6, 7, 9):
        parts = plan_blocks(plan, count)
        assert [p for part in parts for p in part] == plan and all(parts)
        assert len(parts) == min(count, 7) and max(map(len, parts)) - min(map(len, parts)) <= 1
    assert plan_blocks([], 6) == []


def test_open_loop_levels_follow_the_closed_ones_with_one_plan_and_its_arrivals_per_level():
    from kvbench.serve.stage import ServeSettings, main_cells, reference_cells, store_bound_mb

    config = default_config()
    config["serve"]["load"] |= {"rates": [0.5, 2.0]}
    check_config(config, SCHEMA)
    s = ServeSettings.of(config["serve"])
    docs = {c: {f"{c}{i}": f"text {c} {i}" for i in range(s.docs_per_corpus)} for c in s.corpora}
    cells = [c for c in main_cells("main", ["recompute", "prefix", "valkey"], s, docs, seed=3) if c.rate_rps]
    swept = [c for c in s.corpora if c in s.load["corpora"]]
    assert sorted({(c.corpus, c.rate_rps) for c in cells}) == sorted((c, r) for c in swept for r in (0.5, 2.0))
    for rate in (0.5, 2.0):
        level = [c for c in cells if c.rate_rps == rate]
        assert len({id(c.planned) for c in level}) == 1 and len({c.arrivals for c in level}) == 1  # paired
        first = level[0]
        assert first.concurrency == 0 and len(first.planned) == len(first.arrivals)  # 0: no cap in flight
        assert sorted(c.codec for c in level if c.backend == "valkey") == sorted(set(s.codecs) & set(s.load["codecs"]))
        assert first.arrivals[-1] == pytest.approx((len(first.arrivals) - 1) / rate)
    fast = next(c for c in cells if c.rate_rps == 2.0).arrivals
    slow = next(c for c in cells if c.rate_rps == 0.5).arrivals
    assert slow[-1] > fast[-1]  # the same count of requests spread over longer at the lower rate
    native = [c for c in reference_cells("vllm-fp8", "vllm-fp8", s, docs, seed=3) if c.rate_rps]
    # one level per rate whatever each server's request count (the recommendation pairs by level)
    assert sorted({(c.concurrency, c.rate_rps) for c in native}) == sorted({(c.concurrency, c.rate_rps) for c in cells})
    # Valkey's bound counts the open-loop levels' misses too
    closed = default_config()
    check_config(closed, SCHEMA)
    assert store_bound_mb(s, 10**6) > store_bound_mb(ServeSettings.of(closed["serve"]), 10**6)


# lmcache 0.5.6's own lines (lmcache/v1/storage_backend/remote_backend.py, its RESP adapter and native client)
LMCACHE_UP = "[lmcache] INFO: Creating RESP connector for 127.0.0.1:6400\n[lmcache] INFO: Connection initialized/re-established at resp://127.0.0.1:6400\n"
LMCACHE_DOWN = (
    "[lmcache] INFO: Creating RESP connector for 127.0.0.1:6400\n"
    "[lmcache] WARNING: Failed to initialize/re-establish remote connection: connection refused\n"
    "[lmcache] INFO: Connected to remote storage at resp://127.0.0.1:6400\n"  # logged even so
)


@pytest.mark.parametrize(
    "log, want",
    [
        (LMCACHE_DOWN, "LMCache could not connect to its remote store"),
        (LMCACHE_UP + "[LMCache Connector Worker Error] AUTH failed: -WRONGPASS\n", "RESP client failed"),
        (LMCACHE_UP + "HealthMonitor: System unhealthy, entering degraded mode\n", "stopped storing"),
        ("INFO: vLLM started\n", "never created its RESP connector"),
    ],
)
def test_an_lmcache_server_without_its_store_fails_its_job(tmp_path, log, want):
    from kvbench.serve.backends import require_lmcache_store
    from kvbench.servers import ServerError

    path = tmp_path / "vllm.log"
    path.write_text(log)
    with pytest.raises(ServerError, match=want):
        require_lmcache_store(path, None)


def test_an_lmcache_warm_up_that_stored_nothing_fails_and_one_that_stored_passes(tmp_path):
    # a real Valkey; keys as LMCache's RESP connector writes them (one a chunk, no prefix)
    from kvbench.serve.backends import lmcache_chunks, mask_secret, require_lmcache_store
    from kvbench.serve.valkey_server import valkey_server
    from kvbench.servers import ServerError

    path = tmp_path / "vllm.log"
    path.write_text(LMCACHE_UP)
    with valkey_server(16, tmp_path / "valkey.log") as server:
        client = server.client()
        client.set("kvbench:run:pending", 0)  # not LMCache's
        client.set("test@1@0@0@bfloat16", b"x")  # its health probe's key: not a stored chunk
        with pytest.raises(ServerError, match="warm-up stored no chunk"):
            require_lmcache_store(path, lmcache_chunks(client))
        client.set("resources/models/qwen3-0.6b@1@0@3f2a9c@bfloat16", b"kv")
        require_lmcache_store(path, lmcache_chunks(client))
        assert lmcache_chunks(client) == 1
        path.write_text(f"env LMCACHE_RESP_PASSWORD={server.password}\n")
        assert mask_secret(path, server.password) and server.password not in path.read_text()
        assert not mask_secret(path, server.password)

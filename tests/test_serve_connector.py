"""The connector's scheduler and worker halves without a vLLM server (none can start in these unit
tests): vLLM's request, scheduler-output and config objects are faked with the fields the
connector reads; the store is a real Valkey and the paged cache a real tensor. Covers the
block-id slicing of loads after a local hit, partial hits followed by stores, the split-prefill
guard, a request resumed after preemption, a failed lookup, and stores skipped over a failed load."""

from types import SimpleNamespace

import pandas as pd
import pytest
import torch
from test_servers import wait_gone
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from kvbench.job_secrets import VALKEY_PASSWORD_ENV
from kvbench.methods.kivi import QuantizedBlock
from kvbench.serve.connector import Transfer, ValkeyConnector, ValkeyMetadata
from kvbench.serve.events import read_events
from kvbench.serve.keys import chunk_keys
from kvbench.serve.layout import join_amx, split_amx
from kvbench.serve.transfer import gather, store_chunks
from kvbench.serve.valkey_server import valkey_server
from kvbench.serve.wire import ChunkSpec, wire_format

BS = 32
SPEC = ChunkSpec(layers=2, kv_heads=2, block_size=BS, head_size=16, dtype=torch.float32)
PROMPT = list(range(1000, 1000 + 3 * BS + 5))  # 3 loadable chunks, a 5-token tail
METHODS_KIVI2 = {"kind": "kivi", "bits": 2, "group_size": 32}


def fake_vllm_config(url, events):
    extra = {
        "codecs": {"none": None, "zstd-3": None},
        "default_codec": "none",
        "seed": 0,
        "run": "t",
        "model": "m",
        "url": url,
        "events_dir": str(events),
    }
    return SimpleNamespace(
        scheduler_config=SimpleNamespace(enable_chunked_prefill=False),
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra),
        cache_config=SimpleNamespace(block_size=BS, cache_dtype="auto"),
        model_config=SimpleNamespace(dtype=torch.float32, get_head_size=lambda: SPEC.head_size),
        device_config=SimpleNamespace(device_type="cpu"),
        compilation_config=SimpleNamespace(static_forward_context={}),  # vLLM's layers by name
    )


def fake_request(req_id, prompt=PROMPT, load="none", store=("none",)):
    return SimpleNamespace(
        request_id=req_id,
        prompt_token_ids=prompt,
        kv_transfer_params={"tag": f"tag-{req_id}", "load": load, "store": list(store)},
    )


def fake_output(new=(), scheduled=None, cached=(), resumed=()):
    """new: (req_id, block_ids, prompt, num_computed_tokens); cached: (req_id, new_block_ids)."""
    return SimpleNamespace(
        scheduled_new_reqs=[
            SimpleNamespace(req_id=r, block_ids=(b,), prompt_token_ids=p, num_computed_tokens=c) for r, b, p, c in new
        ],
        num_scheduled_tokens=scheduled or {r: len(p) - c for r, _, p, c in new},
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r for r, _ in cached],
            resumed_req_ids=set(resumed),
            new_block_ids=[(b,) if b is not None else None for _, b in cached],
        ),
    )


def paged_cache(blocks=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(blocks, SPEC.kv_heads, BS, 2 * SPEC.head_size, generator=gen) for _ in range(SPEC.layers)]


@pytest.fixture()
def store(tmp_path, monkeypatch):
    with valkey_server(64, tmp_path / "valkey.log") as server:
        monkeypatch.setenv(VALKEY_PASSWORD_ENV, server.password)  # as the vLLM server's environment has it
        yield server.url, server.client()
    assert wait_gone([server.proc.pid]) == []


def connector(url, tmp_path, role=KVConnectorRole.SCHEDULER):
    return ValkeyConnector(fake_vllm_config(url, tmp_path / "events"), role, None)


def put(client, conn, n, codec="none", prompt=PROMPT):
    keys = chunk_keys(conn.spaces[codec], prompt, BS, n)
    store_chunks(client, wire_format(codec, SPEC), SPEC, keys, gather(paged_cache(), list(range(n))))
    return keys


def schedule(conn, request, local_tokens=0):
    """What vLLM's scheduler does for a waiting request: look up, allocate, tell the connector."""
    ext, is_async = conn.get_num_new_matched_tokens(request, local_tokens)
    conn.update_state_after_alloc(request, None, ext)
    return ext, is_async


def test_a_full_hit_loads_every_loadable_chunk_into_its_blocks_and_stores_nothing(store, tmp_path):
    url, client = store
    conn = connector(url, tmp_path)
    keys = put(client, conn, 3)
    assert schedule(conn, fake_request("a")) == (3 * BS, False)
    meta = conn.build_connector_meta(fake_output(new=[("a", [7, 8, 9, 10], PROMPT, 3 * BS)]))
    assert [(t.tag, t.codec, t.keys, t.block_ids) for t in meta.loads] == [("tag-a", "none", keys, [7, 8, 9])]
    assert meta.stores == []  # the 5-token tail is no whole chunk


def test_a_partial_hit_after_a_local_hit_loads_the_middle_and_stores_the_rest(store, tmp_path):
    url, client = store
    conn = connector(url, tmp_path)
    keys = put(client, conn, 2)
    # vLLM's own cache holds the first block: the connector adds the second, not the first
    assert schedule(conn, fake_request("a", store=["none", "zstd-3"]), local_tokens=BS) == (BS, False)
    meta = conn.build_connector_meta(fake_output(new=[("a", [4, 5, 6, 7], PROMPT, 2 * BS)]))
    assert [(t.keys, t.block_ids) for t in meta.loads] == [(keys[1:2], [5])]
    assert [(t.codec, t.block_ids) for t in meta.stores] == [("none", [6]), ("zstd-3", [6])]
    assert meta.stores[0].keys == chunk_keys(conn.spaces["none"], PROMPT, BS, 3)[2:]
    assert meta.stores[1].keys == chunk_keys(conn.spaces["zstd-3"], PROMPT, BS, 3)[2:]


def test_a_prefill_split_across_steps_is_not_stored(store, tmp_path):
    url, _ = store
    conn = connector(url, tmp_path)
    assert schedule(conn, fake_request("a")) == (0, False)
    meta = conn.build_connector_meta(fake_output(new=[("a", [0, 1, 2, 3], PROMPT, 0)], scheduled={"a": 2 * BS}))
    assert meta.loads == [] and meta.stores == []
    events = read_events(tmp_path / "events")
    assert events[events.event == "store"].error.tolist() == ["prefill split across steps: not stored"]


def test_a_request_resumed_after_preemption_loads_again_into_its_new_blocks(store, tmp_path):
    url, client = store
    conn = connector(url, tmp_path)
    keys = put(client, conn, 3)
    schedule(conn, fake_request("a"))
    first = conn.build_connector_meta(fake_output(new=[("a", [0, 1, 2, 3], PROMPT, 3 * BS)]))
    assert [t.block_ids for t in first.loads] == [[0, 1, 2]]
    # preempted: its blocks were freed, num_computed_tokens reset; vLLM looks it up again and
    # schedules it among the cached requests, with all of its (new) block ids
    assert schedule(conn, fake_request("a")) == (3 * BS, False)
    other = conn.build_connector_meta(fake_output(cached=[("a", [5, 6, 7, 8])], resumed=[]))
    assert other.loads == []  # not resumed in this step: nothing to load yet
    resumed = conn.build_connector_meta(fake_output(cached=[("a", [5, 6, 7, 8])], resumed=["a"]))
    assert [(t.keys, t.block_ids) for t in resumed.loads] == [(keys, [5, 6, 7])]
    assert resumed.stores == [] and conn._plans == {}


def test_a_failed_lookup_loads_nothing_and_is_recorded(tmp_path):
    conn = connector("redis://127.0.0.1:1/0", tmp_path)  # nothing listens on port 1
    assert schedule(conn, fake_request("a")) == (0, False)
    meta = conn.build_connector_meta(fake_output(new=[("a", [0, 1, 2, 3], PROMPT, 0)]))
    assert meta.loads == [] and [t.block_ids for t in meta.stores] == [[0, 1, 2]]
    lookup = read_events(tmp_path / "events").set_index("event").loc["lookup"]
    assert lookup.hit_chunks == 0 and lookup.load_tokens == 0 and lookup.error.startswith("lookup: ConnectionError")


def test_requests_that_neither_load_nor_store_write_no_lookup_event(store, tmp_path):
    url, _ = store
    conn = connector(url, tmp_path)
    assert schedule(conn, fake_request("a", load=None, store=[])) == (0, False)
    meta = conn.build_connector_meta(fake_output(new=[("a", [0, 1, 2, 3], PROMPT, 0)]))
    assert meta.loads == [] and meta.stores == [] and read_events(tmp_path / "events").empty


def test_chunks_computed_over_a_failed_load_are_not_stored(store, tmp_path):
    url, client = store
    sched = connector(url, tmp_path)
    keys = put(client, sched, 3)
    client.delete(keys[1])  # gone between lookup and load
    worker = connector(url, tmp_path, KVConnectorRole.WORKER)
    cache = paged_cache(seed=3)
    worker.register_kv_caches({f"model.layers.{i}.self_attn.attn": c for i, c in enumerate(cache)})
    other = chunk_keys(sched.spaces["none"], list(range(3 * BS)), BS, 1)
    meta = ValkeyMetadata(
        loads=[Transfer("tag-a", "none", keys, [0, 1, 2])],
        stores=[Transfer("tag-a", "none", ["over-a-failed-load"], [3]), Transfer("tag-b", "none", other, [4])],
    )
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    worker.wait_for_save()
    assert worker._stores.flush(30)
    assert worker.get_block_ids_with_load_errors() == {1, 2}
    assert client.exists("over-a-failed-load") == 0 and client.exists(other[0]) == 1
    stores = read_events(tmp_path / "events").query("event == 'store'").set_index("tag")
    assert stores.loc["tag-a"].error == "skipped: load failed" and pd.isna(stores.loc["tag-b"].error)
    # the next step starts clean: a store of the same request after a good load goes through
    worker.bind_connector_metadata(ValkeyMetadata(stores=[Transfer("tag-a", "none", ["later"], [3])]))
    worker.start_load_kv(None)
    worker.wait_for_save()
    worker.shutdown()  # flushes the queued store
    assert client.exists("later") == 1


def test_lossy_formats_on_a_cpu_attention_isa_they_cannot_unpack_are_recorded_failed_stores(
    store, tmp_path, monkeypatch
):
    """An attention ISA whose packing the lossy wire formats do not unpack (Arm's `neon`; they
    unpack `vec`, `vec16` and `amx`). The server must run on (no exception at registration),
    lossless stores go through, each lossy store is a recorded failure with the reason, and
    nothing lossy is stored."""
    url, client = store
    monkeypatch.setattr(ValkeyConnector, "_attention_isa", lambda self, head_size: "neon")
    config = fake_vllm_config(url, tmp_path / "events")
    config.kv_transfer_config.kv_connector_extra_config["codecs"] = {"none": None, "kivi2": METHODS_KIVI2}
    worker = ValkeyConnector(config, KVConnectorRole.WORKER, None)
    worker.register_kv_caches({f"model.layers.{i}.self_attn.attn": c for i, c in enumerate(paged_cache())})
    lossless = chunk_keys(worker.spaces["none"], PROMPT, BS, 1)
    lossy = chunk_keys(worker.spaces["kivi2"], PROMPT, BS, 1)
    worker.bind_connector_metadata(
        ValkeyMetadata(stores=[Transfer("tag-a", "none", lossless, [0]), Transfer("tag-a", "kivi2", lossy, [0])])
    )
    worker.wait_for_save()
    worker.shutdown()
    assert client.exists(lossless[0]) == 1 and client.exists(lossy[0]) == 0
    stores = read_events(tmp_path / "events").query("event == 'store'").set_index("codec")
    assert pd.isna(stores.loc["none"].error) and "unsupported" in stores.loc["kivi2"].error
    assert "'neon'" in stores.loc["kivi2"].error


def amx_config(url, tmp_path, head=32):
    """A bf16 server whose layers vLLM's builder set to the `amx` ISA (CPUs with AMX tiles)."""
    config = fake_vllm_config(url, tmp_path / "events")
    config.kv_transfer_config.kv_connector_extra_config["codecs"] = {"none": None, "kivi2": METHODS_KIVI2}
    config.model_config = SimpleNamespace(dtype=torch.bfloat16, get_head_size=lambda: head)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(SPEC.layers)]
    config.compilation_config.static_forward_context = {name: SimpleNamespace(isa="amx") for name in names}
    return config, names


def test_an_amx_packed_cache_has_its_own_keys_and_lossy_loads_unpack_its_tiles(store, tmp_path, monkeypatch):
    """vLLM's `amx` ISA (forced: this CPU may have no AMX tiles): the keys name the `cpu-amx`
    packing, not a `vec` server's, and a kivi2 chunk stored from a cache packed as the AMX kernel
    packs it loads back as KIVI's reconstruction of the true token rows, repacked."""
    url, client = store
    vec = connector(url, tmp_path)  # float32, head 16: vLLM's `vec16`
    monkeypatch.setattr(ValkeyConnector, "_attention_isa", lambda self, head_size: "amx")
    config, names = amx_config(url, tmp_path)
    worker = ValkeyConnector(config, KVConnectorRole.WORKER, None)
    assert ":cpu-amx:" in worker.spaces["none"] and ":cpu-packed:" in vec.spaces["none"]
    gen = torch.Generator().manual_seed(5)
    rows = torch.randn(SPEC.layers, 2, 2, SPEC.kv_heads, BS, 32, generator=gen).to(torch.bfloat16)  # K/V, blocks
    cache = [join_amx(rows[i, 0], rows[i, 1]) for i in range(SPEC.layers)]  # [blocks, heads, BS, 64] each
    worker.register_kv_caches(dict(zip(names, cache)))
    assert worker.spec.layout == "cpu-amx"
    keys = chunk_keys(worker.spaces["kivi2"], PROMPT, BS, 1)
    worker.bind_connector_metadata(ValkeyMetadata(stores=[Transfer("tag-a", "kivi2", keys, [0])]))
    worker.wait_for_save()
    assert worker._stores.flush(30) and client.exists(keys[0]) == 1
    worker.bind_connector_metadata(ValkeyMetadata(loads=[Transfer("tag-b", "kivi2", keys, [1])]))
    worker.start_load_kv(None)
    worker.shutdown()
    true_keys, true_values = rows[:, 0, 0].float(), rows[:, 1, 0].float()  # block 0 of every layer
    expected_k = QuantizedBlock(true_keys, 2, 32, True).dequantize().to(torch.bfloat16)
    expected_v = QuantizedBlock(true_values, 2, 32, False).dequantize().to(torch.bfloat16)
    loaded = [split_amx(layer[1]) for layer in cache]
    assert torch.equal(torch.stack([k for k, _ in loaded]), expected_k)
    assert torch.equal(torch.stack([v for _, v in loaded]), expected_v)


def test_a_cache_vllm_packed_for_another_isa_than_the_keys_name_is_refused(store, tmp_path, monkeypatch):
    url, _ = store
    monkeypatch.setattr(ValkeyConnector, "_attention_isa", lambda self, head_size: "vec")
    config, names = amx_config(url, tmp_path)  # vLLM's builder set `amx` on the layers
    worker = ValkeyConnector(config, KVConnectorRole.WORKER, None)
    cache = [torch.zeros(4, SPEC.kv_heads, BS, 64, dtype=torch.bfloat16) for _ in names]
    with pytest.raises(
        ValueError, match="vLLM packs this CPU cache for attention ISA 'amx', the connector's keys name 'vec'"
    ):
        worker.register_kv_caches(dict(zip(names, cache)))

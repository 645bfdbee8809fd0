"""`ValkeyConnector`: vLLM V1 KV connector that offloads whole blocks to Valkey through our codecs.

Loaded by vLLM with
  --kv-transfer-config '{"kv_connector": "ValkeyConnector",
                         "kv_connector_module_path": "kvbench.serve.connector",
                         "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                         "kv_connector_extra_config": {...}}'   (see backends.valkey_transfer)

The scheduler half (engine-core process) looks up the leading run of stored chunks of a prompt;
the worker half loads them into the paged cache before the forward pass, and after it copies the
chunks the prefill computed out of the cache and hands them to background threads that encode,
seal and SET them (async_store.py): a miss pays for a copy, not for its store. A chunk is one
block of every layer (`--block-size` tokens, 256 as LMCache's chunks), under a key chained from
the hash of its token prefix (keys.py), sealed with its length and checksum (integrity.py): a
chunk that is truncated, corrupt or stored under another key fails its load, and vLLM recomputes
it. The two halves share state through the store only (the tally of chunks queued for storing).

Each request picks its wire formats with `kv_transfer_params`: {"tag": ..., "load": <codec or
null>, "store": [<codecs>]}; without them it loads and stores with `default_codec` (the
serve-only mode's clients). A request resumed after preemption is looked up and loaded again (as
vLLM's ExampleConnector does); chunks computed in a step whose load failed are never stored (vLLM
recomputes that step). Every lookup, load and store is written to a per-process event file
(events.py) that the stage joins to its requests by tag.

The cache may be vLLM's CPU layout or a CUDA backend's (layout.py): the logic is the same, the
copies between device and host are staging.py's.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import valkey
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvbench.job_secrets import VALKEY_PASSWORD_ENV
from kvbench.serve.async_store import AsyncStore, StoreJob
from kvbench.serve.events import EventLog
from kvbench.serve.keys import chunk_keys, namespace, pending_key
from kvbench.serve.layout import CPU_ISA_LAYOUTS, SPLIT, layout_of
from kvbench.serve.staging import PinnedPool, copy_out
from kvbench.serve.transfer import STORE_ERRORS, load_chunks, lookup
from kvbench.serve.valkey_server import connect
from kvbench.serve.wire import ChunkSpec, WireFormat, unpacks, wire_format

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

QUEUE_MB = 512  # chunk copies waiting for their store, at most
SHUTDOWN_FLUSH_S = 120.0


@dataclass
class Transfer:
    tag: str
    codec: str
    keys: list[str]
    block_ids: list[int]


@dataclass
class ValkeyMetadata(KVConnectorMetadata):
    loads: list[Transfer] = field(default_factory=list)
    stores: list[Transfer] = field(default_factory=list)


@dataclass
class Plan:
    tag: str
    load: str | None
    store: list[str]
    local_chunks: int = 0
    hit_chunks: int = 0
    queued_chunks: int = 0
    load_tokens: int = 0
    keys: list[str] = field(default_factory=list)
    lookup_s: float = 0.0
    error: str | None = None


class ValkeyConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig") -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        if vllm_config.scheduler_config.enable_chunked_prefill:
            raise ValueError(
                "ValkeyConnector stores a prompt's chunks in the step that computes them: "
                "start vLLM with --no-enable-chunked-prefill"
            )
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.block_size = vllm_config.cache_config.block_size
        self.codecs: dict[str, Any] = dict(extra["codecs"])
        self.default_codec = str(extra["default_codec"])
        self.seed = int(extra.get("seed", 0))
        self.queue_bytes = int(float(extra.get("queue_mb", QUEUE_MB)) * 2**20)
        self.store_threads = int(extra.get("store_threads", 1))
        # None: yield where the forward pass runs on the encoders' cores (a CPU cache)
        self.store_yield: bool | None = extra.get("store_yield")
        cache_dtype = vllm_config.cache_config.cache_dtype
        self.dtype = (
            str(vllm_config.model_config.dtype).removeprefix("torch.") if cache_dtype == "auto" else cache_dtype
        )
        # The CPU backend packs each attention ISA's blocks its own way: keys name the packing, so a
        # chunk never loads into a cache packed for another ISA (the worker checks vLLM's own choice)
        on_cpu = vllm_config.device_config.device_type == "cpu"
        self.isa = self._attention_isa(vllm_config.model_config.get_head_size()) if on_cpu else None
        layout = layout_of("cpu" if on_cpu else "cuda", self.isa)
        self.spaces = {
            name: namespace(extra["run"], extra["model"], self.dtype, self.block_size, name, layout)
            for name in self.codecs
        }
        self.pending_key = pending_key(extra["run"])
        self.url = extra["url"]
        self.client = self._client()
        self.events = EventLog(extra["events_dir"], "scheduler" if role == KVConnectorRole.SCHEDULER else "worker")
        # scheduler side
        self._plans: dict[str, Plan] = {}
        # worker side
        self._layers: list[torch.Tensor] = []
        self._wires: dict[str, WireFormat] = {}
        self._failed_blocks: set[int] = set()
        self._failed_tags: set[str] = set()  # requests of this step whose load failed
        self._unsupported: dict[str, str] = {}  # wire formats this server's cache layout cannot serve: why
        self._stores: AsyncStore | None = None

    def _client(self) -> valkey.Valkey:
        # the password comes from the server's environment: the URL is in vLLM's command line
        return connect(self.url, os.environ.get(VALKEY_PASSWORD_ENV))

    # ---------------------------------------------------------------- scheduler side

    def _plan(self, request: "Request") -> Plan:
        params = request.kv_transfer_params or {}
        tag = str(params.get("tag", request.request_id))
        load = params.get("load", self.default_codec)
        store = list(params.get("store", [self.default_codec]))
        unknown = [c for c in [load, *store] if c is not None and c not in self.codecs]
        if unknown:
            return Plan(tag, None, [], error=f"unknown codec(s) {unknown}; this server has {sorted(self.codecs)}")
        return Plan(tag, load, store)

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        plan = self._plan(request)
        plan.local_chunks = num_computed_tokens // self.block_size
        prompt = request.prompt_token_ids or []
        loadable = (len(prompt) - 1) // self.block_size  # the last prompt token is always computed
        if plan.load is not None and loadable > plan.local_chunks:
            plan.keys = chunk_keys(self.spaces[plan.load], prompt, self.block_size, loadable)
            start = time.perf_counter()
            try:
                plan.hit_chunks, plan.queued_chunks = lookup(self.client, plan.keys, self.pending_key)
            except STORE_ERRORS as err:
                plan.error = f"lookup: {type(err).__name__}: {err}"
            plan.lookup_s = time.perf_counter() - start
        self._plans[request.request_id] = plan
        return max(0, plan.hit_chunks * self.block_size - num_computed_tokens), False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        plan = self._plans.get(request.request_id)
        if plan is None:
            return
        plan.load_tokens = num_external_tokens
        if plan.load is None and plan.error is None:
            return  # nothing looked up (recompute, prefix and warm requests): no event
        self.events.write(
            event="lookup",
            tag=plan.tag,
            codec=plan.load,
            chunks=len(plan.keys),
            hit_chunks=plan.hit_chunks,
            queued_chunks=plan.queued_chunks,
            local_chunks=plan.local_chunks,
            load_tokens=num_external_tokens,
            seconds=plan.lookup_s,
            error=plan.error,
            time=time.time(),
        )

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = ValkeyMetadata()
        for new in scheduler_output.scheduled_new_reqs:
            plan = self._plans.pop(new.req_id, None)
            if plan is None:
                continue
            block_ids = list(new.block_ids[0])
            prompt = new.prompt_token_ids or []
            self._plan_load(meta, plan, block_ids)
            computed = new.num_computed_tokens  # local and loaded tokens
            whole = len(prompt) // self.block_size
            if computed + scheduler_output.num_scheduled_tokens.get(new.req_id, 0) < whole * self.block_size:
                self.events.write(
                    event="store",
                    tag=plan.tag,
                    codec=None,
                    error="prefill split across steps: not stored",
                    time=time.time(),
                )
                continue
            first = computed // self.block_size
            for codec in plan.store if whole > first else []:
                keys = chunk_keys(self.spaces[codec], prompt, self.block_size, whole)
                meta.stores.append(Transfer(plan.tag, codec, keys[first:], block_ids[first:whole]))
        # A request preempted and scheduled again was looked up again (its blocks were freed): it
        # arrives among the cached requests with all its new block ids, and its load is planned
        # here as ExampleConnector does. Its prompt's chunks were stored by its first prefill.
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, new_block_ids in zip(cached.req_ids, cached.new_block_ids):
            if req_id in cached.resumed_req_ids and req_id in self._plans:
                plan = self._plans.pop(req_id)
                self._plan_load(meta, plan, list(new_block_ids[0]) if new_block_ids else [])
        return meta

    def _plan_load(self, meta: ValkeyMetadata, plan: Plan, block_ids: list[int]) -> None:
        """The blocks vLLM counts as loaded (after the local hit) get their chunks before the
        forward pass."""
        if plan.load_tokens:
            first = plan.local_chunks
            last = first + plan.load_tokens // self.block_size
            meta.loads.append(Transfer(plan.tag, plan.load, plan.keys[first:last], block_ids[first:last]))

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._plans.pop(request.request_id, None)
        return False, None  # the worker copied the chunks out in the step that computed them

    # ---------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.model_executor.models.utils import extract_layer_index

        names = sorted(kv_caches, key=extract_layer_index)
        self._layers = [kv_caches[name] for name in names]
        first = self._layers[0]
        if first.dim() != 4 or first.shape[2] != self.block_size or first.shape[3] % 2:
            raise ValueError(
                f"ValkeyConnector reads vLLM's cache layout [blocks, kv_heads, block_size, 2*head_size]; "
                f"got {tuple(first.shape)} on {first.device}"
            )
        heads, head_size = first.shape[1], first.shape[3] // 2
        isa = self._layers_isa(names) if first.device.type == "cpu" else None
        if isa != self.isa:
            raise ValueError(
                f"ValkeyConnector: vLLM packs this CPU cache for attention ISA {isa!r}, the connector's keys "
                f"name {self.isa!r} (kvbench.serve.connector's choice no longer follows this vLLM's)"
            )
        spec = ChunkSpec(
            len(self._layers), heads, self.block_size, head_size, first.dtype, layout_of(first.device, isa)
        )
        if spec.layout not in SPLIT:
            # e.g. Arm's `neon`: the formats that unpack K and V have their stores recorded as failed
            # with the reason (their loads then find nothing), the server runs on
            self._unsupported = {
                name: f"store: unsupported: KIVI and TurboQuant wire formats unpack K and V for the CPU "
                f"attention ISAs {', '.join(CPU_ISA_LAYOUTS)}; this server uses {isa!r}"
                for name, method in self.codecs.items()
                if unpacks(name, method)
            }
        self._wires = {
            name: wire_format(name, spec, method, self.seed)
            for name, method in self.codecs.items()
            if name not in self._unsupported
        }
        self.spec = spec
        # CUDA: the staging copies' pinned buffers, allocated once and reused (staging.PinnedPool)
        self._pool = PinnedPool() if first.device.type == "cuda" else None
        self._stores = AsyncStore(
            self._client,
            spec,
            self.pending_key,
            self.events.write,
            self.queue_bytes,
            self.store_threads,
            yield_to_forward=first.device.type == "cpu" if self.store_yield is None else self.store_yield,
        )

    def _attention_isa(self, head_size: int) -> str:
        """The ISA vLLM's CPU attention builder picks for this config (its own function)."""
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        config = self._vllm_config
        return _get_attn_isa(config.model_config.dtype, self.block_size, head_size, config.cache_config.cache_dtype)

    def _layers_isa(self, names: list[str]) -> str | None:
        """The ISA vLLM's builder set on these attention layers (`layer.isa`, before it registers
        their caches), or the connector's own choice where this vLLM sets none."""
        context = getattr(self._vllm_config.compilation_config, "static_forward_context", {})
        found = {getattr(context.get(name), "isa", None) for name in names} - {None}
        if len(found) > 1:
            raise ValueError(f"ValkeyConnector: vLLM packs the layers' caches for different ISAs {sorted(found)}")
        return found.pop() if found else self.isa

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Called before every forward step (start_load_kv may run after it: vLLM starts a step's
        loads after the forward pass when none of them is synchronous)."""
        super().bind_connector_metadata(connector_metadata)
        if self._stores is not None:
            self._stores.forward_started()

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, ValkeyMetadata)
        self._failed_tags = set()
        for load in meta.loads:
            self._load(load)

    def _load(self, load: Transfer) -> None:
        stats = load_chunks(
            self.client, self._wires[load.codec], self.spec, load.keys, load.block_ids, self._layers, pool=self._pool
        )
        failed = stats.pop("failed_blocks")
        self._failed_blocks.update(failed)
        if failed:
            self._failed_tags.add(load.tag)
        self.events.write(
            event="load", tag=load.tag, codec=load.codec, failed_chunks=len(failed), **stats, time=time.time()
        )

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # every layer is copied out at once in wait_for_save, after the forward pass

    def wait_for_save(self) -> None:
        """Copy each stored request's new chunks out of the cache (once, whatever the number of
        codecs) and queue their stores; the blocks are free for vLLM when this returns."""
        if self._stores is not None:
            self._stores.forward_ended()
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, ValkeyMetadata) and self._stores is not None
        copies: dict[tuple[int, ...], tuple[Any, float]] = {}
        for store in meta.stores:
            # computed while attending to blocks the load never filled, vLLM discards the step
            # and recomputes: those chunks must not reach the store either
            skipped = self._unsupported.get(store.codec) or (
                "skipped: load failed" if store.tag in self._failed_tags else None
            )
            if skipped:
                self.events.write(
                    event="store",
                    tag=store.tag,
                    codec=store.codec,
                    chunks=len(store.keys),
                    error=skipped,
                    time=time.time(),
                )
                continue
            blocks = tuple(store.block_ids)
            if blocks not in copies:
                start = time.perf_counter()
                copies[blocks] = (copy_out(self._layers, blocks, self._pool), time.perf_counter() - start)
            copy, gather_s = copies[blocks]
            job = StoreJob(
                store.tag, store.codec, self._wires[store.codec], store.keys, copy, info={"gather_s": gather_s}
            )
            self._stores.submit(job)
        for copy, _ in copies.values():
            copy.release()  # the worker's hold: the store jobs hold what they still read

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def shutdown(self) -> None:
        if self._stores is not None:
            self._stores.close(SHUTDOWN_FLUSH_S)
        self.events.close()

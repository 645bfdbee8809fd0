"""Stores off the critical path: the worker half copies a request's new chunks out of the paged
cache (fast) and hands them here; background threads encode, seal and SET them, as LMCache
stores asynchronously.

- Bounded: chunk copies waiting for their store hold at most `queue_bytes` (a copy counts once,
  however many codecs store it); a full queue makes the next submit wait (its wait is recorded), so memory stays bounded and no store is dropped.
- Counted in the store: each submit adds its chunks to a tally key (`pending_key`) in the same
  store, and each finished store takes them off in its SET round trip. The scheduler half and
  the benchmark client run in other processes: the tally is how they see that stores are still
  in flight (`pending`), and why a lookup found a chunk "missing" that is only not stored yet.
  A chunk is visible to lookups only once its SET is complete, so it is never loaded before it
  is stored.
- Failures counted: every job ends in one `store` event with its error (or none).
- Flushed at shutdown: `close()` waits for the queue, then stops the threads; jobs it could not
  finish in time are recorded as failed.
- Low priority: the threads run under SCHED_IDLE (Linux, per thread; nice 19 where that is
  refused), so a woken normal thread of the process preempts them at once; at nice 19 a store
  thread slowed a prefill on the same cores (bench/store_priority.py; docs/serve.md says what
  that does not show, and what SCHED_IDLE costs the stores). Where the forward pass runs on
  the same cores (a CPU server), they also yield to it: a chunk's encoding starts only between
  forward steps (`forward_started` / `forward_ended`, called by the connector's worker half),
  or after YIELD_MAX_S (a step that never ends: an error between the two calls). This decides
  when an encoding starts only: one that has started runs on into the next step. Under
  back-to-back steps the stores still advance a chunk per step; `submit` comes after the step
  (in wait_for_save), so a full queue never waits on a step.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import valkey

from kvbench.serve.staging import HostCopy
from kvbench.serve.transfer import STORE_ERRORS, store_chunks
from kvbench.serve.wire import ChunkSpec, WireFormat

NICE = 19  # where SCHED_IDLE is not available
YIELD_MAX_S = 1.0  # the longest a chunk's encoding waits for a step to end


@dataclass
class StoreJob:
    tag: str
    codec: str
    wire: WireFormat
    keys: list[str]
    copy: HostCopy
    submitted: float = field(default_factory=time.perf_counter)
    info: dict[str, Any] = field(default_factory=dict)  # copied into the job's event (e.g. gather_s)

    def nbytes(self) -> int:
        return self._nbytes

    def __post_init__(self) -> None:
        self._nbytes = self.copy.nbytes()  # fixed at submit: a released copy holds no chunks


def lower_priority() -> str:
    """Put the calling thread, and the threads it creates afterwards (with libgomp, the OpenMP
    workers of its own torch ops), at the lowest CPU priority Linux gives it; returns which:
    `idle` (SCHED_IDLE), `nice 19` or `normal` (elsewhere, or both refused)."""
    if not sys.platform.startswith("linux"):
        return "normal"  # a thread id is no pid there: setpriority would target a process
    tid = threading.get_native_id()
    try:
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        return "idle"
    except OSError:
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, tid, NICE)
        return f"nice {NICE}"
    except OSError:
        return "normal"


def pending(client: valkey.Valkey, pending_key: str) -> int:
    """Chunks submitted and not yet stored (0 when the tally is gone: a restarted store)."""
    return max(0, int(client.get(pending_key) or 0))


class AsyncStore:
    def __init__(
        self,
        make_client: Callable[[], valkey.Valkey],
        spec: ChunkSpec,
        pending_key: str,
        write_event: Callable[..., None],
        queue_bytes: int,
        threads: int = 1,
        secret: bytes = b"",
        yield_to_forward: bool = False,
    ) -> None:
        self.spec, self.pending_key, self.write_event = spec, pending_key, write_event
        self.queue_bytes, self.secret = queue_bytes, secret
        self.yield_to_forward = yield_to_forward
        self._between_steps = threading.Event()
        self._between_steps.set()
        self.client = make_client()  # submits' tally updates (the critical path's one round trip)
        self._jobs: queue.Queue[StoreJob | None] = queue.Queue()
        self._room = threading.Condition()
        self._queued = 0  # bytes of chunk copies waiting or being stored
        self._jobs_of: dict[int, int] = {}  # id(copy) -> its jobs not finished (codecs share a copy)
        self.counts = {"submitted": 0, "stored": 0, "failed": 0}
        self.priority = ""  # what the threads got (lower_priority), once they run
        self._threads = [
            threading.Thread(target=self._run, args=(make_client(),), daemon=True, name=f"kvbench-store-{i}")
            for i in range(threads)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, job: StoreJob) -> float:
        """Queue a job; returns the seconds it waited for room (0 unless the queue was full)."""
        start = time.perf_counter()
        with self._room:
            # a copy counts once, however many codecs store it
            size = 0 if id(job.copy) in self._jobs_of else job.nbytes()
            # a job larger than the whole queue still goes once the queue is empty
            self._room.wait_for(lambda: self._queued == 0 or self._queued + size <= self.queue_bytes)
            self._queued += size
            self._jobs_of[id(job.copy)] = self._jobs_of.get(id(job.copy), 0) + 1
            job.copy.acquire()  # released when the job finishes
        waited = time.perf_counter() - start
        try:
            self.client.incrby(self.pending_key, len(job.keys))
        except STORE_ERRORS as err:
            job.info["tally_error"] = f"{type(err).__name__}: {err}"
        job.info["queue_wait_s"] = waited
        self.counts["submitted"] += 1
        self._jobs.put(job)
        return waited

    def forward_started(self) -> None:
        self._between_steps.clear()

    def forward_ended(self) -> None:
        self._between_steps.set()

    def _wait_between_steps(self) -> float:
        """Wait until no forward step runs (only when yielding to it); the seconds waited."""
        if not self.yield_to_forward or self._between_steps.is_set():
            return 0.0
        start = time.perf_counter()
        self._between_steps.wait(YIELD_MAX_S)
        return time.perf_counter() - start

    def _run(self, client: valkey.Valkey) -> None:
        self.priority = lower_priority()
        while (job := self._jobs.get()) is not None:
            started = time.perf_counter()
            try:
                job.copy.wait()
                counted = None if "tally_error" in job.info else self.pending_key  # never below what was added
                stats = store_chunks(
                    client,
                    job.wire,
                    self.spec,
                    job.keys,
                    job.copy.chunks,
                    self.secret,
                    counted,
                    self._wait_between_steps,
                )
            except Exception as err:  # an encoder's bug must not kill the thread and strand the queue
                stats = {"chunks": len(job.keys), "error": f"store: {type(err).__name__}: {err}"}
                self._untally(client, job)
            self._finish(job, stats, started)
            self._jobs.task_done()
        self._jobs.task_done()

    def _untally(self, client: valkey.Valkey, job: StoreJob) -> None:
        """Take a job that never reached its SETs off the store's tally, or every later flush
        would wait for chunks that will never come."""
        if "tally_error" not in job.info:
            try:
                client.decrby(self.pending_key, len(job.keys))
            except STORE_ERRORS:
                pass  # the store is gone; a restarted one starts with no tally

    def _finish(self, job: StoreJob, stats: dict[str, Any], started: float) -> None:
        self.counts["failed" if stats.get("error") else "stored"] += 1
        self.write_event(
            event="store",
            tag=job.tag,
            codec=job.codec,
            queue_s=started - job.submitted,
            priority=self.priority,
            **job.info,
            **stats,
            time=time.time(),
        )
        with self._room:
            left = self._jobs_of.pop(id(job.copy)) - 1
            if left:
                self._jobs_of[id(job.copy)] = left
            else:
                self._queued -= job.nbytes()
            self._room.notify_all()
        job.copy.release()  # this job's hold (submit's); the last one hands a pooled buffer back

    def flush(self, timeout_s: float) -> bool:
        """Wait until every submitted job has finished; False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._room:
            return self._room.wait_for(lambda: self._queued == 0, timeout=max(0.0, deadline - time.monotonic()))

    def close(self, timeout_s: float = 60.0) -> None:
        """Flush, stop the threads; jobs still queued after `timeout_s` are recorded as failed."""
        self._between_steps.set()  # no more steps: a step that never ended must not hold the flush
        self.flush(timeout_s)
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                self._finish(
                    job, {"chunks": len(job.keys), "error": "store: not done at shutdown"}, time.perf_counter()
                )
            self._jobs.task_done()
        for _ in self._threads:
            self._jobs.put(None)
        for thread in self._threads:
            thread.join(timeout=5.0)

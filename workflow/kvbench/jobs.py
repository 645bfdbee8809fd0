"""What every Snakemake script needs: its log, a clean exit when killed, provenance for its tables."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import traceback
from typing import Any, Iterator, Mapping, TextIO

from kvbench.hub import PrefetchError, hub_env, missing, missing_message, noted_configfiles
from kvbench.servers import terminate_servers

# Python's default SIGTERM ends the process without running `finally`: servers a job started
# would outlive it. These signals raise instead, so every `with`/`finally` cleans up.
EXIT_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
PARENT_POLL_S = 1.0


def usable_cpus() -> list[int]:
    """The CPU ids this process may run on: a SLURM job's cpuset or a taskset, not the whole node."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def cpu_list(cpus: list[int]) -> str:
    """`[0, 1, 2, 5, 7, 8]` -> `"0-2,5,7-8"` (the cpu-list syntax of taskset and libnuma)."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


class JobTerminated(SystemExit):
    """The job got SIGTERM/SIGHUP (scheduler limit, preemption, `kill`) or lost its parent."""


def _terminate(signum: int, _frame: object) -> None:
    for sig in EXIT_SIGNALS:  # a second signal must not interrupt the cleanup it triggered
        signal.signal(sig, signal.SIG_IGN)
    # Servers first: worker threads blocked on a request then fail at once, so the unwinding
    # below is not held up by a thread pool waiting for requests in flight.
    terminate_servers()
    raise JobTerminated(128 + signum)


def _noted_parent() -> int:
    """The parent noted by the scripts' first import (kvbench.jobstart) when it
    was this process's; otherwise (a child that inherited the variable, a test) the current one."""
    pid, _, parent = os.environ.get("KVBENCH_JOB_PARENT", "").partition(":")
    return int(parent) if pid == str(os.getpid()) else os.getppid()


def _watch_parent(stop: threading.Event) -> None:
    """SIGTERM ourselves when the process that started us (snakemake, the jobstep) dies, even by
    SIGKILL: an orphaned job would otherwise race the rerun for its outputs and the CPU."""
    parent = _noted_parent()
    while os.getppid() == parent and not stop.wait(PARENT_POLL_S):
        pass
    if not stop.is_set():
        os.kill(os.getpid(), signal.SIGTERM)


@contextlib.contextmanager
def job_log(path: str | os.PathLike, config: Mapping[str, Any]) -> Iterator[TextIO]:
    """Send prints and tracebacks to the rule's log (line-buffered, so progress is live).

    Also points the job at the hub cache and keeps it off the hub when the config says so (every
    stage, every machine; kvbench.jobstart does so before the heavy imports), fails
    it with the prefetch command when something the config reads from the hub is not in that cache
    as this node sees it, and turns SIGTERM/SIGHUP, or the death of the parent process, into an
    exception that unwinds every `finally` (servers are stopped) before the job exits with 128 + signal.
    """
    os.environ.update(hub_env(config))
    main_thread = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, _terminate) for sig in EXIT_SIGNALS} if main_thread else {}
    stop = threading.Event()
    try:
        with open(path, "w", buffering=1) as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            try:
                if main_thread:  # once the log is open: a parent already gone is reported there
                    threading.Thread(target=_watch_parent, args=(stop,), daemon=True, name="watch-parent").start()
                if stripped := os.environ.get("KVBENCH_STRIPPED_CUDA_ENV"):  # kvbench.jobstart
                    print(f"kvbench: the login node's CUDA toolkit left out of this GPU job ({stripped}): the "
                          "wheels bring CUDA 13; KVBENCH_KEEP_CUDA_ENV=1 keeps it", file=log)  # fmt: skip
                if lines := missing(config):
                    raise PrefetchError(missing_message(config, lines, noted_configfiles()))
                yield log
            except PrefetchError as err:  # the message is the whole story: no traceback
                print(f"kvbench: {err}", file=log)
                sys.__stderr__.write(f"kvbench: {err}\n")
                raise
            except JobTerminated as err:
                traceback.print_exc(file=log)
                print(f"kvbench: job terminated by signal {int(err.code) - 128}; cleaned up", file=log)
                sys.__stderr__.write(f"kvbench: job terminated, see {path}\n")
                raise
            except BaseException:
                traceback.print_exc(file=log)
                sys.__stderr__.write(f"kvbench: job failed, see {path}\n")
                raise
    finally:
        stop.set()
        for sig, handler in previous.items():
            signal.signal(sig, handler)

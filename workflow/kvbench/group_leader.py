"""Run a server as the child of a process that leads its process group, and end the whole group
(the server and everything it spawned, e.g. vLLM's engine-core process) when:

- the process that started us dies, even by SIGKILL (Linux parent-death signal), or
- we get SIGTERM / SIGINT / SIGHUP, or
- the server exits on its own (stragglers it left behind are ended too).

Usage: python group_leader.py PARENT_PID GRACE_S -- CMD...  (started with start_new_session=True,
so our pid is the group id). Standalone on purpose: no kvbench import, so it starts fast and
under any interpreter.

The values of the environment variables KVBENCH_REDACT_ENV names (comma-separated) never reach
our output, the server's log: its output passes through us with each of them masked (LMCache
prints its configuration, the store's password in it, at startup).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import IO

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36  # orphaned descendants are reparented to us, so we can reap them
REDACT_ENV = "KVBENCH_REDACT_ENV"
MASK = b"<redacted>"
RELAY_DRAIN_S = 5.0


class _Stop(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _on_signal(signum: int, _frame: object) -> None:
    # Once: a second signal (the parent's death can arrive next to a SIGTERM) must not interrupt
    # the group's ending that the first one starts.
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    raise _Stop(signum)


def group_members(pgid: int) -> list[int]:
    """Pids in process group `pgid` (zombies included until reaped), read from /proc."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # fields after the command: state, ppid, pgrp, ...
            members.append(int(entry))
    return members


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def end_group(grace_s: float) -> None:
    """SIGTERM every other member of our group, wait up to `grace_s`, then SIGKILL the rest."""
    me = os.getpid()
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        others = [p for p in group_members(me) if p != me]
        for pid in others:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            _reap()
            if not [p for p in group_members(me) if p != me]:
                return
            time.sleep(0.05)


def secrets_of(env: dict[str, str]) -> list[bytes]:
    """The values to mask: those of the variables REDACT_ENV names that are set and not empty, each
    also as JSON escapes it (a configuration printed as JSON), longest first (a secret inside
    another must not leave the rest of that one showing). A value with a line break in it is not
    masked (the relay reads lines)."""
    names = [name for name in env.get(REDACT_ENV, "").split(",") if name]
    values = {env[name] for name in names if env.get(name)}
    forms = {form.encode() for value in values for form in (value, json.dumps(value)[1:-1])}
    return sorted(forms, key=len, reverse=True)


def relay(source: IO[bytes], sink: IO[bytes], secrets: list[bytes]) -> None:
    """Copy `source` to `sink` line by line (a secret never spans lines), every secret masked.
    After a failed write (a full disk) it reads on and drops the rest: a server whose output
    nobody reads would block."""
    writable = True
    for line in iter(source.readline, b""):
        if not writable:
            continue
        for secret in secrets:
            line = line.replace(secret, MASK)
        try:
            sink.write(line)
            sink.flush()
        except OSError:
            writable = False


def start(cmd: list[str]) -> tuple[subprocess.Popen, threading.Thread | None]:
    """The server, its output relayed through a masking thread when there are secrets to mask."""
    secrets = secrets_of(dict(os.environ))
    if not secrets:
        return subprocess.Popen(cmd), None
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    thread = threading.Thread(target=relay, args=(child.stdout, sys.stdout.buffer, secrets), daemon=True)
    thread.start()
    return child, thread


def main(argv: list[str]) -> int:
    parent, grace_s, sep, cmd = int(argv[1]), float(argv[2]), argv[3], argv[4:]
    if sep != "--" or not cmd:
        print("usage: group_leader.py PARENT_PID GRACE_S -- CMD...", file=sys.stderr)
        return 2
    for sig in STOP_SIGNALS:
        signal.signal(sig, _on_signal)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1)
    code, relaying = 0, None
    try:
        if os.getppid() != parent:  # the parent died before the death signal was armed
            return 1
        child, relaying = start(cmd)
        code = child.wait()
        code = 128 - code if code < 0 else code  # killed by a signal: the shell's convention
    except _Stop as stop:
        code = 128 + stop.signum
    finally:
        try:
            end_group(grace_s)
        except _Stop:  # a signal as the server's own exit began the ending: now all are ignored
            end_group(grace_s)
        if relaying is not None:  # what the group printed while it ended (its last lines) reaches the log
            relaying.join(timeout=RELAY_DRAIN_S)
            if relaying.is_alive():  # a process outside the group holds the pipe: leave without it
                os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv))

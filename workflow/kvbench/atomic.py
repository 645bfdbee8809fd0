"""Write files so that a killed job never leaves a half-written output behind."""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


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
        if is_dir and final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp) if tmp.is_dir() else tmp.unlink()

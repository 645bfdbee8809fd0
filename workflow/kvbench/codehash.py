"""Hash of the library code a workflow script runs, so that a change to it reruns what it affects.

Snakemake reruns a job when its script changes, not when a library module behind it does. Rules
pass `code_hash(script)` as a param: the kvbench modules the script imports, transitively (read
from the source, nothing is imported), plus modules a rule names by hand (`extra`: what another
program imports by name, e.g. the connector vLLM loads for serve_server), plus the package's data
files when one of those modules names the `data` folder (the fact-sheet vocabularies), plus C
sources a module names next to itself (the decode kernels native.py builds).
"""

from __future__ import annotations

import ast
import hashlib
from functools import lru_cache
from pathlib import Path

PACKAGE = "kvbench"
LIBRARY = Path(__file__).resolve().parent  # .../workflow/kvbench


def _module_file(name: str) -> Path | None:
    parts = name.split(".")
    if parts[0] != PACKAGE:
        return None
    base = LIBRARY.joinpath(*parts[1:])
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _package_inits(name: str) -> list[Path]:
    """__init__.py of every package on the way to `name` (each runs on import)."""
    parts = name.split(".")
    return [f for i in range(1, len(parts)) if (f := _module_file(".".join(parts[:i]))) is not None]


@lru_cache(maxsize=None)
def _direct_imports(path: Path) -> tuple[tuple[str, ...], bool, tuple[Path, ...]]:
    """kvbench modules `path` imports (anywhere in it, lazy imports too), whether it names the
    package's `data` folder, and the C sources it names next to itself."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: list[str] = []
    uses_data = False
    sources: list[Path] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
            names += [f"{node.module}.{alias.name}" for alias in node.names]  # submodules, if any
        elif isinstance(node, ast.Constant) and node.value == "data":
            uses_data = True
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.endswith(".c"):
            sources += [f for f in [path.parent / node.value] if f.is_file()]
    return tuple(n for n in names if n.split(".")[0] == PACKAGE), uses_data, tuple(sources)


def library_files(script: str | Path, extra: tuple[str, ...] = ()) -> list[Path]:
    """The library files `script` depends on (and the modules named in `extra`, with theirs), sorted."""
    seen: set[Path] = set()
    data = False
    todo = [Path(script).resolve()]
    while todo:
        path = todo.pop()
        names, uses_data, sources = _direct_imports(path)
        if path == Path(script).resolve():
            names += extra
        data |= uses_data and path != Path(script).resolve()
        seen.update(sources)
        for name in names:
            for found in [*_package_inits(name), _module_file(name)]:
                if found is not None and found not in seen:
                    seen.add(found)
                    todo.append(found)
    if data:
        seen |= {f for f in (LIBRARY / "data").rglob("*") if f.is_file()}
    return sorted(seen)


def code_hash(script: str | Path, extra: tuple[str, ...] = ()) -> str:
    """16 hex digits over the paths (relative to the library) and contents of `library_files`."""
    digest = hashlib.sha256()
    for path in library_files(script, extra):
        digest.update(str(path.relative_to(LIBRARY)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]

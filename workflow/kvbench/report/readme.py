"""Writes and checks the generated regions of the docs (`make readme`, `make readme-check`).

    python -m kvbench.report.readme [--check] [--results results] [ROOT]

Writing snapshots the tables the docs' regions read, from results/ into docs/data/ (a table that
results/ lacks keeps its earlier snapshot; each table carries its config hash and commit in its
provenance columns, and every block names them), then renders every region from the snapshot.

--check renders every region from the snapshot alone, as CI does where no `make run` wrote
results/, and fails on a stale region, a region no registry declares, a block placed nowhere or
twice, a snapshot table no region reads, and a figure typed by hand outside the generated regions
(kvbench.report.numbers).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from kvbench.report.blocks import Block, registry, render
from kvbench.report.numbers import GENERATED, hand_typed

DOCUMENTS = ("README.md", "config/README.md", "bench/README.md", "docs/*.md")
# Where findings are quoted: no number at all in their prose (kvbench.report.numbers).
RESULTS_DOCUMENTS = ("README.md", "bench/README.md", "docs/results.md")
SNAPSHOT = Path("docs") / "data"


def documents(root: Path) -> list[Path]:
    return [p for pattern in DOCUMENTS for p in sorted(root.glob(pattern))]


def placed(root: Path) -> dict[str, list[Path]]:
    """Block name -> the documents that hold a region of it."""
    found: dict[str, list[Path]] = {}
    for doc in documents(root):
        for match in GENERATED.finditer(doc.read_text()):
            found.setdefault(match.group("name"), []).append(doc)
    return found


def rendered(text: str, blocks: dict[str, Block], data: Path) -> tuple[str, list[str]]:
    """The text with every region rendered from `data`, and the names of the regions that changed
    (regions of unknown blocks are left as they are)."""
    changed = []

    def one(match) -> str:
        name = match.group("name")
        if name not in blocks:
            return match.group(0)
        body = render(blocks[name], data)
        if body != match.group("body"):
            changed.append(name)
        return f"<!-- generated:{name} -->{body}<!-- end generated:{name} -->"

    return GENERATED.sub(one, text), changed


def take_snapshot(results: Path, data: Path, patterns: set[str]) -> list[str]:
    """Copy the tables of `patterns` from results/ into the snapshot, replacing earlier copies;
    drop snapshot tables no pattern reads. Returns the patterns results/ lacks (kept as they were)."""
    kept = []
    for pattern in sorted(patterns):
        fresh = sorted(results.glob(pattern))
        if not fresh:
            kept.append(pattern)
            continue
        for old in data.glob(pattern):
            old.unlink()
        for path in fresh:
            target = data / path.relative_to(results)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)
    for stray in unread(data, patterns):
        stray.unlink()
    return kept


def unread(data: Path, patterns: set[str]) -> list[Path]:
    read = {p for pattern in patterns for p in data.glob(pattern)}
    return sorted(p for p in data.rglob("*.parquet") if p not in read)


def check(root: Path, blocks: dict[str, Block]) -> list[str]:
    """Every problem of the docs, one line each (see the module doc)."""
    problems = []
    where = placed(root)
    data = root / SNAPSHOT
    for name, docs in sorted(where.items()):
        if name not in blocks:
            problems.append(
                f"{', '.join(map(str, docs))}: region `{name}` is declared by no registry (kvbench.report.blocks)"
            )
        elif len(docs) > 1:
            problems.append(f"block `{name}` is placed twice: {', '.join(map(str, docs))}")
    problems += [f"block `{name}` is placed in no document" for name in sorted(set(blocks) - set(where))]
    for doc in documents(root):
        text = doc.read_text()
        stale = rendered(text, blocks, data)[1]
        rel = doc.relative_to(root).as_posix()
        if stale:
            problems.append(f"{rel}: stale generated region(s) {', '.join(stale)} (run `make readme`)")
        results = rel in RESULTS_DOCUMENTS
        for line, figure in hand_typed(text, results):
            where_ = (
                "results documents quote figures only through generated regions"
                if results
                else "a time, speed or ratio typed by hand is a measurement: generate it or put a setting in `code`"
            )
            problems.append(f"{rel}:{line}: hand-typed number {figure!r} ({where_})")
    patterns = {p for name in where if name in blocks for p in blocks[name].tables}
    problems += [
        f"{p.relative_to(root)}: no generated region reads this snapshot table (run `make readme`)"
        for p in unread(data, patterns)
    ]
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", nargs="?", default=Path("."), type=Path, help="the repository (default: .)")
    parser.add_argument("--results", type=Path, help="where the tables are (default: ROOT/results)")
    parser.add_argument("--check", action="store_true", help="render from the snapshot and report, change nothing")
    args = parser.parse_args(argv)
    root = args.root
    blocks = registry(root)
    if args.check:
        problems = check(root, blocks)
        for problem in problems:
            print(problem, file=sys.stderr)
        return 1 if problems else 0
    where = placed(root)
    patterns = {p for name in where if name in blocks for p in blocks[name].tables}
    kept = take_snapshot(args.results or root / "results", root / SNAPSHOT, patterns)
    for doc in documents(root):
        text, changed = rendered(doc.read_text(), blocks, root / SNAPSHOT)
        if changed:
            doc.write_text(text)
            print(f"{doc.relative_to(root)}: rewrote {', '.join(changed)}")
    if kept:
        print(f"not in results/, kept as snapshotted before (or not measured yet): {', '.join(kept)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

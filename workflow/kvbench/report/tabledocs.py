"""The output-table reference (docs/tables.md) checked against real tables, so it cannot drift:
every Parquet table a run wrote must have a section there, and every column must be named in it.

A section is a `###` heading naming one or more table paths in `code` (`{wildcards}` match any
name); the `## Provenance` section's names count for every table. A column is named when it
appears in `code` in its section, where `a_x|y` stands for `a_x` and `a_y`, `a_{x,y}` likewise, and
`*` or `<column>` for any text (`*_std`, `<column>_rel`).
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq

CODE = re.compile(r"`([^`]+)`")  # a span may wrap onto the next line


@dataclass(frozen=True)
class Section:
    tables: tuple[str, ...]  # fnmatch patterns of paths relative to the run's folder
    columns: tuple[str, ...]  # fnmatch patterns of column names


def _names(token: str) -> list[str]:
    """The column names (or patterns) one code span stands for."""
    token = re.sub(r"<[^>]+>", "*", token.strip())
    if not re.fullmatch(r"[\w*{},|]+", token):
        return []  # code, not a column name: `text[char_start:char_end]`, `doc@context`
    braces = re.search(r"\{([^}]*)\}", token)
    if braces:
        return [
            n
            for alt in braces.group(1).split(",")
            for n in _names(token[: braces.start()] + alt + token[braces.end() :])
        ]
    first, *more = token.split("|")
    stem = first.rsplit("_", 1)[0] + "_" if "_" in first else ""
    return [first, *(stem + alt for alt in more)]


def sections(text: str) -> tuple[tuple[str, ...], list[Section]]:
    """The provenance columns, and every table section of the reference."""
    provenance: list[str] = []
    found: list[Section] = []
    for block in re.split(r"^(?=#{2,3} )", text, flags=re.M):
        heading, _, body = block.partition("\n")
        names = tuple(n for span in CODE.findall(body) for n in _names(span))
        if heading.startswith("## Provenance"):
            provenance += names
        elif heading.startswith("### "):
            tables = tuple(re.sub(r"\{[^}]*\}", "*", t) for t in CODE.findall(heading))
            found.append(Section(tables, names))
    return tuple(provenance), found


def undocumented(run: Path, reference: str) -> list[str]:
    """`table: problem` for each table under run/results without a section, and each column its
    section does not name."""
    provenance, found = sections(reference)
    problems = []
    for path in sorted((run / "results").rglob("*.parquet")):
        rel = path.relative_to(run).as_posix()
        mine = [s for s in found if any(fnmatch.fnmatchcase(rel, t) for t in s.tables)]
        if not mine:
            problems.append(f"{rel}: no section in the table reference")
            continue
        named = provenance + tuple(c for s in mine for c in s.columns)
        for column in pq.read_schema(path).names:
            if not any(fnmatch.fnmatchcase(column, n) for n in named):
                problems.append(f"{rel}: column `{column}` is not documented")
    return problems

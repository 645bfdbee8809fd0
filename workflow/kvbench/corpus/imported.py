"""A user's own documents: a folder of .txt/.md/.jsonl/.parquet files, or LongBench-format JSONL."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import pandas as pd

SUPPORTED = (".txt", ".md", ".jsonl", ".parquet")


class CorpusInputError(ValueError):
    """An imported file or folder that cannot become documents; the message names it."""


def _decode(path: Path) -> str:
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise CorpusInputError(f"{path}: not valid UTF-8 (bad byte at offset {err.start})") from None
    if not text.strip():
        raise CorpusInputError(f"{path}: file is empty")
    return text


def _jsonl_docs(path: Path) -> Iterator[dict[str, Any]]:
    """Plain {"text": ...} lines, or LongBench lines (context, input, answers, dataset, all_classes)."""
    for lineno, line in enumerate(_decode(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            raise CorpusInputError(f"{path}:{lineno}: invalid JSON ({err.msg})") from None
        text = obj.get("text", obj.get("context")) if isinstance(obj, dict) else None
        if not isinstance(text, str) or not text.strip():
            raise CorpusInputError(f"{path}:{lineno}: no non-empty 'text' or 'context' field")
        answers, classes = obj.get("answers"), obj.get("all_classes")
        yield {
            "doc_id": str(obj.get("_id", obj.get("id", f"{path.stem}-{lineno:05d}"))),
            "doc_type": str(obj.get("dataset", path.stem)),
            "text": text,
            "question": obj.get("input") or None,
            "answers": json.dumps(answers) if answers is not None else None,
            "all_classes": json.dumps(classes) if classes else None,
        }


def _parquet_docs(path: Path) -> Iterator[dict[str, Any]]:
    frame = pd.read_parquet(path)
    if "text" not in frame.columns:
        raise CorpusInputError(f"{path}: parquet file has no 'text' column (has {list(frame.columns)})")
    if frame.empty:
        raise CorpusInputError(f"{path}: file is empty")
    for i, row in enumerate(frame.to_dict("records")):
        text = row["text"]
        if not isinstance(text, str) or not text.strip():
            raise CorpusInputError(f"{path}: row {i} has an empty 'text'")
        yield {
            "doc_id": str(row.get("doc_id", f"{path.stem}-{i:05d}")),
            "doc_type": str(row.get("doc_type", path.stem)),
            "text": text,
        }


def document_files(folder: str | Path) -> list[Path]:
    """The files of `folder` that become documents (the workflow tracks them as inputs)."""
    return sorted(p for p in Path(folder).rglob("*") if p.is_file() and p.suffix.lower() in SUPPORTED)


def read_folder(folder: str | Path, domain: str) -> pd.DataFrame:
    root = Path(folder)
    if not root.is_dir():
        raise CorpusInputError(f"corpus.imported.path: folder {str(root)!r} does not exist")
    files = document_files(root)
    if not files:
        raise CorpusInputError(f"corpus.imported.path: folder {str(root)!r} has no {'/'.join(SUPPORTED)} files")
    rows: list[dict[str, Any]] = []
    for path in files:
        suffix = path.suffix.lower()
        if suffix in (".txt", ".md"):
            docs: Iterator[dict[str, Any]] = iter(
                [{"doc_id": path.stem, "doc_type": suffix[1:], "text": _decode(path)}]
            )
        elif suffix == ".jsonl":
            docs = _jsonl_docs(path)
        else:
            docs = _parquet_docs(path)
        for doc in docs:
            rows.append({"domain": domain, "source": str(path.relative_to(root)), **doc})
    frame = pd.DataFrame(rows)
    dup = frame["doc_id"][frame["doc_id"].duplicated()]
    if not dup.empty:
        raise CorpusInputError(f"corpus.imported.path: duplicate doc_id {dup.iloc[0]!r}")
    return frame

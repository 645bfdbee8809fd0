import json

import pandas as pd
import pytest

from kvbench.corpus.build import build_imported
from kvbench.corpus.imported import CorpusInputError, read_folder


def test_reads_every_supported_format(tmp_path):
    (tmp_path / "a.txt").write_text("Plain text document.")
    (tmp_path / "b.md").write_text("# Title\n\nMarkdown body.")
    (tmp_path / "c.jsonl").write_text(
        json.dumps({"text": "json doc"}) + "\n\n" + json.dumps({"id": "x9", "text": "second"}) + "\n"
    )
    longbench = {"input": "Who?", "context": "A long context.", "answers": ["Ana"], "dataset": "qasper", "_id": "lb1"}
    (tmp_path / "d.jsonl").write_text(json.dumps(longbench) + "\n")
    pd.DataFrame({"text": ["from parquet"], "doc_type": ["memo"]}).to_parquet(tmp_path / "e.parquet")
    (tmp_path / "ignored.csv").write_text("not read")
    frame = build_imported(str(tmp_path), "mine")
    assert list(frame.doc_id) == ["a", "b", "c-00001", "x9", "lb1", "e-00000"]
    assert set(frame.domain) == {"mine"} and set(frame.corpus) == {"imported"}
    lb = frame.set_index("doc_id").loc["lb1"]
    assert (lb.text, lb.doc_type, lb.question, json.loads(lb.answers)) == ("A long context.", "qasper", "Who?", ["Ana"])
    assert frame.set_index("doc_id").loc["e-00000"].doc_type == "memo"


@pytest.mark.parametrize(
    "setup, message",
    [
        (lambda d: None, "has no .txt/.md/.jsonl/.parquet files"),
        (lambda d: (d / "empty.txt").write_text("  \n"), "empty.txt: file is empty"),
        (
            lambda d: (d / "latin.txt").write_bytes("caf\xe9".encode("latin-1")),
            "latin.txt: not valid UTF-8 (bad byte at offset 3)",
        ),
        (lambda d: (d / "bad.jsonl").write_text('{"text": "ok"}\n{oops\n'), "bad.jsonl:2: invalid JSON"),
        (
            lambda d: (d / "nokey.jsonl").write_text('{"body": "x"}\n'),
            "nokey.jsonl:1: no non-empty 'text' or 'context'",
        ),
        (
            lambda d: pd.DataFrame({"body": ["x"]}).to_parquet(d / "p.parquet"),
            "p.parquet: parquet file has no 'text' column",
        ),
    ],
)
def test_bad_input_names_the_file(tmp_path, setup, message):
    setup(tmp_path)
    with pytest.raises(CorpusInputError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        read_folder(tmp_path, "x")


def test_missing_folder_names_the_key(tmp_path):
    with pytest.raises(CorpusInputError, match=r"corpus\.imported\.path: folder .*nope.* does not exist"):
        read_folder(tmp_path / "nope", "x")

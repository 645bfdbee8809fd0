"""Two runs' tables compared (kvbench.runcompare, used by the kill/resume and refactor benches):
volatile columns (timings, run ids, timestamps), the report's timing-derived columns and ignored
columns may differ, nothing else; row order does not matter; numeric differences are measured."""

import json
import re

import numpy as np
import pandas as pd

from kvbench.runcompare import compare_runs, compare_table


def requests(run_id, ttfts, outputs, port=6379):
    return pd.DataFrame(
        {
            "run_id": [run_id] * 2,
            "doc_id": ["a", "b"],
            "ttft_s": ttfts,
            "start": [1.0, 2.0],
            "output": outputs,
            "cached_tokens": [0, 128],
            "tag": [f"{run_id}.valkey.none.realistic.query.0", f"{run_id}.valkey.none.realistic.query.1"],
            "cache_salt": [f"prefix-{run_id}-realistic", None],
            "error": [None, f"lookup: ConnectionError: Error 111 connecting to 127.0.0.1:{port}."],
        }
    )


def test_timings_run_ids_ports_and_row_order_may_differ():
    a = requests("837d2079f4", [0.1, 0.2], ["x", "y"])
    b = requests("9890b5740a", [0.3, 0.1], ["x", "y"], port=50123).iloc[::-1]  # another run, rows swapped
    row = compare_table("results/serve/requests.parquet", a, b)
    assert row["equal"] and set(row["volatile_differing"].split(",")) == {"run_id", "ttft_s"}


def test_a_tag_of_another_request_is_a_difference():
    a, b = requests("837d2079f4", [0.1, 0.2], ["x", "y"]), requests("9890b5740a", [0.1, 0.2], ["x", "y"])
    b.loc[1, "tag"] = "9890b5740a.valkey.none.realistic.query.7"
    assert compare_table("results/serve/requests.parquet", a, b)["differing_columns"] == "tag"


def test_a_deterministic_column_that_differs_is_named():
    a, b = requests("837d2079f4", [0.1, 0.2], ["x", "y"]), requests("837d2079f4", [0.1, 0.2], ["x", "z"])
    row = compare_table("results/serve/requests.parquet", a, b)
    assert not row["equal"] and row["differing_columns"] == "output"


def test_report_columns_computed_from_timings_may_differ_in_the_report_only():
    picks = lambda best: pd.DataFrame({"scenario": ["fast"], "best": [best], "description": ["d"]})  # noqa: E731
    assert compare_table("results/report/recommendations.parquet", picks("kivi2"), picks("fp8"))["equal"]
    assert not compare_table("results/other.parquet", picks("kivi2"), picks("fp8"))["equal"]


def scores(kl, commit):
    return pd.DataFrame({"method": ["kivi2", "snapkv", "full"], "kl": kl, "tokens": [4, 4, 4], "git_commit": commit})


def test_a_float_one_ulp_apart_differs_and_its_size_is_measured():
    a = scores([0.25, 1.5, 0.0], "aaa")
    b = scores([0.25, np.nextafter(1.5, 2.0), 0.0], "aaa").iloc[[2, 0, 1]]  # rows matched by method, not position
    row = compare_table("results/quality/smol/summary.parquet", a, b)
    assert not row["equal"] and row["differing_columns"] == "kl"
    assert json.loads(row["numeric_differences"]) == {"kl": np.nextafter(1.5, 2.0) - 1.5}


def test_a_value_missing_on_one_side_is_an_infinite_difference():
    row = compare_table("results/t.parquet", scores([0.25, 1.5, 0.0], "a"), scores([0.25, float("nan"), 0.0], "a"))
    assert json.loads(row["numeric_differences"]) == {"kl": float("inf")}


def test_ignored_columns_may_differ():
    a, b = scores([0.25, 1.5, 0.0], "aaa"), scores([0.25, 1.5, 0.0], "bbb")
    assert not compare_table("results/t.parquet", a, b)["equal"]
    row = compare_table("results/t.parquet", a, b, ignore=("git_commit",))
    assert row["equal"] and row["ignored_differing"] == "git_commit"


def test_runs_compare_every_table_of_either_run(tmp_path):
    for run, kl in (("one", 0.5), ("two", 0.75)):
        (tmp_path / run / "results" / "q").mkdir(parents=True)
        scores([kl, 1.5, 0.0], run).to_parquet(tmp_path / run / "results" / "q" / "summary.parquet")
        scores([0.1, 0.2, 0.3], run).to_parquet(tmp_path / run / "results" / "same.parquet")
    scores([1.0, 1.0, 1.0], "two").to_parquet(tmp_path / "two" / "results" / "extra.parquet")
    rows = {r["table"]: r for r in compare_runs(tmp_path / "one", tmp_path / "two", ignore=("git_commit",))}
    assert rows["results/same.parquet"]["equal"]
    assert not rows["results/q/summary.parquet"]["equal"]
    assert json.loads(rows["results/q/summary.parquet"]["numeric_differences"]) == {"kl": 0.25}
    assert rows["results/extra.parquet"]["differing_columns"] == "only in one run"


def test_masked_text_may_differ_and_nothing_else_in_the_cell():
    sources = lambda commit, tables: pd.DataFrame(  # noqa: E731
        {"corpus": ["realistic"], "sources": [json.dumps({"stats": {"git_commit": [commit], "tables": tables}})]}
    )
    masks = ((re.compile("aaa111|bbb222"), "COMMIT"),)
    assert not compare_table("results/t.parquet", sources("aaa111", 2), sources("bbb222", 2))["equal"]
    assert compare_table("results/t.parquet", sources("aaa111", 2), sources("bbb222", 2), masks=masks)["equal"]
    assert not compare_table("results/t.parquet", sources("aaa111", 2), sources("bbb222", 3), masks=masks)["equal"]

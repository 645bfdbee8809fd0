"""The kill/resume bench's table comparison: volatile columns (timings, run ids, timestamps) and
the report's timing-derived columns may differ, nothing else; row order does not matter."""

import importlib.util

import pandas as pd
import pytest

from kvbench.tinyrun import REPO


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("kill_resume", REPO / "bench" / "kill_resume.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def requests(run_id, ttfts, outputs, port=6379):
    return pd.DataFrame({"run_id": [run_id] * 2, "doc_id": ["a", "b"], "ttft_s": ttfts, "start": [1.0, 2.0],
                         "output": outputs, "cached_tokens": [0, 128],
                         "tag": [f"{run_id}.valkey.none.realistic.query.0", f"{run_id}.valkey.none.realistic.query.1"],
                         "cache_salt": [f"prefix-{run_id}-realistic", None],
                         "error": [None, f"lookup: ConnectionError: Error 111 connecting to 127.0.0.1:{port}."]})


def test_timings_run_ids_ports_and_row_order_may_differ(bench):
    a = requests("837d2079f4", [0.1, 0.2], ["x", "y"])
    b = requests("9890b5740a", [0.3, 0.1], ["x", "y"], port=50123).iloc[::-1]  # another run, rows swapped
    row = bench.compare_table("results/serve/requests.parquet", a, b)
    assert row["equal"] and set(row["volatile_differing"].split(",")) == {"run_id", "ttft_s"}


def test_a_tag_of_another_request_is_a_difference(bench):
    a, b = requests("837d2079f4", [0.1, 0.2], ["x", "y"]), requests("9890b5740a", [0.1, 0.2], ["x", "y"])
    b.loc[1, "tag"] = "9890b5740a.valkey.none.realistic.query.7"
    assert bench.compare_table("results/serve/requests.parquet", a, b)["differing_columns"] == "tag"


def test_a_deterministic_column_that_differs_is_named(bench):
    a, b = requests("837d2079f4", [0.1, 0.2], ["x", "y"]), requests("837d2079f4", [0.1, 0.2], ["x", "z"])
    row = bench.compare_table("results/serve/requests.parquet", a, b)
    assert not row["equal"] and row["differing_columns"] == "output"


def test_report_columns_computed_from_timings_may_differ_in_the_report_only(bench):
    picks = lambda best: pd.DataFrame({"scenario": ["fast"], "best": [best], "description": ["d"]})  # noqa: E731
    assert bench.compare_table("results/report/recommendations.parquet", picks("kivi2"), picks("fp8"))["equal"]
    assert not bench.compare_table("results/other.parquet", picks("kivi2"), picks("fp8"))["equal"]

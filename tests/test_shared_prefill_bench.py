"""The shared-prefill bench's pure parts (no model): which samples it takes, the path order per round,
the per-sample comparison with the per-method path, and the README block rendered from its table
(after a Parquet round trip, as the README generator reads it)."""

import importlib.util

import pandas as pd
import pytest

from kvbench.quality.engine import Prompt
from kvbench.tinyrun import REPO


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("shared_prefill", REPO / "bench" / "shared_prefill.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_samples_are_taken_one_from_each_task_in_turn(bench):
    groups = [["a1", "a2", "a3"], ["b1"], ["c1", "c2"]]
    assert bench.pick(groups, 4) == ["a1", "b1", "c1", "a2"]
    assert bench.pick(groups, 10) == ["a1", "b1", "c1", "a2", "c2", "a3"]


def test_every_path_runs_in_every_place_and_two_paths_alternate(bench):
    orders = [bench.rotation(bench.PATHS, r) for r in range(3)]
    assert all(sorted(order) == sorted(bench.PATHS) for order in orders)
    assert all({order[place] for order in orders} == set(bench.PATHS) for place in range(3))
    assert bench.rotation(bench.PATHS, 3) == orders[0]
    assert [bench.rotation(["a", "b"], r) for r in range(3)] == [["a", "b"], ["b", "a"], ["a", "b"]]


def _table(bench) -> pd.DataFrame:
    prompts = [Prompt("t/s1", [1] * 100, None, 4), Prompt("t/s2", [1] * 50, None, 4)]
    fidelity = {
        "first_divergence": 2,
        "same_output_as_reference": False,
        "kl_first": 0.0,
        "kl_max": 0.5,
        "top1_agreement": 0.75,
        "fidelity_positions": 3,
    }

    def outcomes(kl_s1: float, tokens_s2: list[int]) -> dict:
        return {
            ("full", "t/s1"): {"tokens": [5, 6, 7], "kv_bytes_prefill": 800, "kv_bytes_end": 824},
            ("full", "t/s2"): {"tokens": [5, 6], "kv_bytes_prefill": 400, "kv_bytes_end": 416},
            ("kivi2", "t/s1"): {
                "tokens": [5, 6, 9],
                "kv_bytes_prefill": 100,
                "kv_bytes_end": 110,
                "kl_mean": kl_s1,
                **fidelity,
            },
            ("kivi2", "t/s2"): {
                "tokens": tokens_s2,
                "kv_bytes_prefill": 50,
                "kv_bytes_end": 60,
                "kl_mean": 0.25,
                **fidelity,
            },
        }

    per_method, shared = outcomes(0.125, [5, 8]), outcomes(0.25, [5, 6])
    outputs = {
        bench.PER_METHOD: [per_method, per_method],
        bench.SHARED: [shared, {**shared, ("kivi2", "t/s1"): {"tokens": [1]}}],
    }
    walls = [{bench.PER_METHOD: 10.0, bench.SHARED: 2.0}, {bench.SHARED: 4.0, bench.PER_METHOD: 12.0}]
    rounds = [
        {
            "record": "round",
            "round": r,
            "place": place,
            "path": path,
            "wall_s": wall,
            "cpu_s": wall * 2,
            "prefill_s": 1.0,
            "fork_s": 0.0,
            "decode_s": 1.0,
            "decode_steps": 3,
            "row_steps": 3,
            "samples": 2,
            "methods": 2,
            "prompt_tokens": 150,
            "threads": 2,
        }
        for r, order in enumerate(walls)
        for place, (path, wall) in enumerate(order.items())
    ]
    table = pd.DataFrame(rounds + bench.sample_rows(outputs, prompts, ["full", "kivi2"]))
    per_sample = table.record == "sample"
    return pd.concat([table[~per_sample], bench.compare(table[per_sample].reset_index(drop=True))], ignore_index=True)


def test_each_path_is_compared_with_the_per_method_path_on_the_same_method_and_sample(bench):
    samples = _table(bench).query("record == 'sample'").set_index(["path", "method", "sample"])
    shared = samples.loc[bench.SHARED]
    differing = shared.index[~shared.same_tokens_as_per_method.astype(bool)].tolist()
    assert differing == [("kivi2", "t/s2")]  # [5, 6] vs [5, 8]
    assert shared.same_prefill_bytes_as_per_method.all()
    assert shared.loc[("kivi2", "t/s1"), "kl_mean_minus_per_method"] == 0.125
    assert pd.isna(shared.loc[("full", "t/s1"), "kl_mean_minus_per_method"])  # the reference has no KL
    assert shared.index[~shared.same_every_round.astype(bool)].tolist() == [("kivi2", "t/s1")]  # round 2 changed it
    assert samples.loc[bench.PER_METHOD].same_tokens_as_per_method.all()


def test_the_readme_block_pairs_rounds_and_reports_the_checks(bench, tmp_path):
    path = tmp_path / "shared_prefill.parquet"
    _table(bench).to_parquet(path, index=False)
    text = bench.render(pd.read_parquet(path))
    # per round per-method / shared: 10 / 2 = 5 and 12 / 4 = 3; the median and the spread over rounds
    gain = "| per-method / shared | the quality stage's gain (both levers) | 4.00x [3.00, 5.00] | 4.00x [3.00, 5.00] |"
    assert f"{gain} 2 |" in text
    assert "shared-one-row" not in text.split("Checks")[0].split("| path")[1]  # a path not run is not shown
    assert (
        "- shared: bytes after the prefill equal in 4/4, same output tokens in 3/4, max |kl_mean difference| 0.125 "
        "over 2 rows"
    ) in text
    assert "no: shared kivi2 t/s1" in text

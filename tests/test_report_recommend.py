"""Recommendation on hand-built tables (tests/report_frames.py): limits, preference, runner-up,
"none qualifies", failed samples, and that a different scenario gives a different answer."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import yaml
from report_frames import fidelity, quality, report, system
from scipy import stats

from kvbench.report.joined import MEASURED
from kvbench.report.recommend import NONE, Scenario
from kvbench.tinyrun import REPO

# kv_bytes: full 1e6; quality per method in one category. Made-up numbers.
SYSTEM = system(
    {
        "full": {"kv_bytes_end": 1.0e6, "ttft_s": 1.00, "tpot_s": 0.10, "ratio_end": 1.0},
        "kivi2": {"kv_bytes_end": 0.25e6, "ttft_s": 1.02, "tpot_s": 0.14, "ratio_end": 4.0},
        "kivi4": {"kv_bytes_end": 0.40e6, "ttft_s": 1.01, "tpot_s": 0.11, "ratio_end": 2.5},
        "snapkv": {"kv_bytes_end": 0.26e6, "ttft_s": 1.03, "tpot_s": 0.09, "ratio_end": 3.9},
        "turboquant3": {"kv_bytes_end": 0.20e6, "ttft_s": 1.20, "tpot_s": 0.40, "ratio_end": 5.0},
    },
    prompts=6,
)
QUALITY = quality(
    {
        m: {"single_doc_qa": q}
        for m, q in {"full": 0.50, "kivi2": 0.49, "kivi4": 0.50, "snapkv": 0.40, "turboquant3": 0.485}.items()
    },
    samples=6,
)
MEMORY = {
    "limits": {"kv_bytes": {"max": 0.30, "relative": True}, "quality": {"min": 0.95, "relative": True}},
    "prefer": {"max": "quality"},
}
LATENCY = {
    "limits": {"ttft_s": {"max": 1.05, "relative": True}, "tpot_s": {"max": 1.20, "relative": True}},
    "prefer": {"max": "ratio"},
}


def recs(scenarios, frames=None):
    return report(frames or {"system": SYSTEM, "quality_scores": QUALITY}, scenarios=scenarios).recommendations


def test_memory_bound_picks_the_best_quality_within_the_limits():
    (row,) = recs({"memory-bound": MEMORY}).to_dict("records")
    # kivi2 (0.25x, 0.98x) and turboquant3 (0.20x, 0.97x) qualify; snapkv fails quality, kivi4 bytes.
    assert (row["best"], row["runner_up"], row["qualifying"], row["candidates"]) == ("kivi2", "turboquant3", 2, 5)
    assert row["best_value"] == pytest.approx(0.49)
    assert "kv_bytes 0.25 MB (0.25x full [0.25, 0.25]), n = 6 prompts" in row["numbers"]
    assert "quality 0.49 [0.47, 0.51] (0.98x full [0.979, 0.981]), n = 6 samples" in row["numbers"]
    assert "runner-up turboquant3" in row["why"] and (row["best_n"], row["best_ci_low"]) == (6, pytest.approx(0.47))


def test_changing_the_scenario_changes_the_answer():
    both = recs({"memory-bound": MEMORY, "latency-bound": LATENCY}).set_index("scenario")
    # latency: full (1x), kivi4 (2.5x) and snapkv (3.9x) meet TTFT/TPOT (kivi2's TPOT is 1.4x); highest ratio wins
    assert both.loc["memory-bound", "best"] == "kivi2"
    assert both.loc["latency-bound", "best"] == "snapkv" and both.loc["latency-bound", "runner_up"] == "kivi4"
    tighter = dict(LATENCY, limits={**LATENCY["limits"], "ttft_s": {"max": 1.02, "relative": True}})
    (row,) = recs({"latency-tight": tighter}).to_dict("records")
    assert (row["best"], row["runner_up"]) == ("kivi4", "full")


def test_none_qualifies_names_the_closest_method_and_its_misses():
    strict = {"limits": {"kv_bytes": {"max": 0.1, "relative": True}}, "prefer": {"min": "kv_bytes"}}
    (row,) = recs({"strict": strict}).to_dict("records")
    assert row["best"] == NONE and row["qualifying"] == 0
    assert "closest turboquant3 misses kv_bytes <= 0.1x full (0.2 [0.2, 0.2])" in row["why"]


def test_an_unmeasured_column_cannot_be_met():
    (row,) = recs({"memory-bound": MEMORY}, frames={"system": SYSTEM}).to_dict("records")
    assert row["best"] == NONE and "quality >= 0.95x full (not measured)" in row["why"]
    assert row["category"] == "system prompts"


def test_a_method_that_failed_on_a_sample_does_not_qualify():
    failing = system(
        {"full": {"kv_bytes_end": 1e6}, "kivi2": {"kv_bytes_end": 0.25e6}, "snapkv": {"kv_bytes_end": 0.26e6}},
        errors={"kivi2": 1},
        prompts=6,
    )
    cheap = {"limits": {"kv_bytes": {"max": 0.5, "relative": True}}, "prefer": {"min": "kv_bytes"}}
    (row,) = recs({"cheap": cheap}, frames={"system": failing}).to_dict("records")
    assert row["best"] == "snapkv"


def test_one_answer_per_model_category_and_bucket():
    long = system({"full": {}, "kivi2": {"kv_bytes_end": 0.2e6}}, target=6000, prompts=6)
    frames = {"system": pd.concat([SYSTEM, long])}
    rows = recs({"latency-bound": LATENCY}, frames=frames)
    assert sorted(rows.bucket) == ["0-4k", "4-8k"]


def test_scenario_config_errors_name_the_key():
    with pytest.raises(ValueError, match=r"report.scenarios.x.limits: unknown column 'ttft'"):
        Scenario.from_config("x", {"limits": {"ttft": {"max": 1}}, "prefer": {"max": "ratio"}})


def test_schema_columns_are_the_joined_table_columns():
    schema = yaml.safe_load((REPO / "workflow/schemas/config.schema.yaml").read_text())
    scenario = schema["properties"]["report"]["properties"]["scenarios"]["additionalProperties"]["properties"]
    assert scenario["limits"]["propertyNames"]["enum"] == MEASURED
    assert scenario["prefer"]["properties"]["max"]["enum"] == MEASURED


def test_default_scenarios_parse():
    from kvbench.report.recommend import scenarios_from_config

    config = yaml.safe_load((REPO / "config/config.yaml").read_text())
    names = [s.name for s in scenarios_from_config(config["report"]["scenarios"])]
    assert names == ["memory-bound", "latency-bound", "long-context-throughput"]


def test_an_unknown_baseline_is_refused_with_the_key_named():
    from kvbench.checks import check_config
    from kvbench.config import ConfigError

    config = yaml.safe_load((REPO / "config/config.yaml").read_text())
    config["report"]["baseline"] = "nope"
    with pytest.raises(ConfigError, match=r"report.baseline: 'nope' is not a key of methods"):
        check_config(config, REPO / "workflow" / "schemas" / "config.schema.yaml")


def test_a_method_only_the_system_stage_ran_can_be_named_and_is_said_to_lack_quality():
    sys_rows = system(
        {"full": {"kv_bytes_end": 1e6}, "kivi4": {"kv_bytes_end": 0.4e6}, "cam": {"kv_bytes_end": 0.25e6}}, prompts=6
    )
    # kivi4 differs from full on every sample (equal on all would leave its relative quality undecided)
    scores = quality({"full": {"qa": 0.5}, "kivi4": {"qa": 0.49}}, samples=6)
    frames = {"system": sys_rows, "quality_scores": scores}
    small = {"limits": {"kv_bytes": {"max": 0.5, "relative": True}}, "prefer": {"min": "kv_bytes"}}
    (row,) = recs({"small": small}, frames=frames).to_dict("records")
    assert (row["best"], row["runner_up"]) == ("cam", "kivi4")
    (row,) = recs(
        {"memory-bound": dict(MEMORY, limits={**MEMORY["limits"], "kv_bytes": {"max": 0.5, "relative": True}})},
        frames=frames,
    ).to_dict("records")
    assert row["best"] == "kivi4" and "quality not measured for cam" in row["why"]


def test_a_method_whose_preferred_column_was_not_measured_is_never_named():
    # decode_tok_s comes from the system stage only: snapkv50 (quality only) has none
    frames = {
        "system": SYSTEM,
        "quality_scores": pd.concat([QUALITY, quality({"snapkv50": {"single_doc_qa": 0.5}}, samples=6)]),
    }
    fast = {"limits": {"quality": {"min": 0.99, "relative": True}}, "prefer": {"max": "decode_tok_s"}}
    (row,) = recs({"fast": fast}, frames=frames).to_dict("records")
    assert "snapkv50" not in (row["best"], row["runner_up"]) and row["best"] in ("full", "kivi4")
    # snapkv50 alone meets the limit: without a decode_tok_s it is still not named
    only = {"limits": {"quality": {"min": 1.1, "relative": True}}, "prefer": {"max": "decode_tok_s"}}
    frames = {
        "system": system({"full": {}}, prompts=6),
        "quality_scores": quality({"full": {"q": 0.5}, "snapkv50": {"q": 0.6}}, samples=6),
    }
    (row,) = recs({"only": only}, frames=frames).to_dict("records")
    assert row["best"] == NONE and row["qualifying"] == 0


def test_ties_are_broken_by_a_second_measured_column_or_reported():
    tied = system(
        {
            "full": {"kv_bytes_end": 1e6, "decode_tok_s": 10.0},
            "kivi4": {"kv_bytes_end": 0.4e6, "decode_tok_s": 10.0},
            "snapkv": {"kv_bytes_end": 0.4e6, "decode_tok_s": 10.0},
        },
        prompts=6,
    )
    fast = {"limits": {"ttft_s": {"max": 2.0, "relative": True}}, "prefer": {"max": "decode_tok_s"}}
    (row,) = recs({"fast": fast}, frames={"system": tied}).to_dict("records")
    assert row["best"] == "tie: kivi4 = snapkv" and row["runner_up"] == "full"
    assert "a tie on decode_tok_s and kv_bytes" in row["why"]
    broken = tied.assign(kv_bytes_end=tied.method.map({"full": 1e6, "kivi4": 0.4e6, "snapkv": 0.3e6}))
    (row,) = recs({"fast": fast}, frames={"system": broken}).to_dict("records")
    assert row["best"] == "snapkv" and row["runner_up"] == "kivi4"
    assert "tied on decode_tok_s with kivi4, full; the smaller kv_bytes decides" in row["why"]


def test_a_limit_is_met_only_by_the_intervals_unfavourable_end():
    # kivi4 scores 0.96x full on average, but samples spread +-0.15: its interval holds 0.95
    rng = np.random.default_rng(0)
    scores = quality({m: {"qa": q} for m, q in {"full": 0.5, "kivi4": 0.48, "kivi2": 0.3}.items()}, samples=8)
    scores.loc[scores.method == "kivi4", "score"] += rng.normal(0, 0.15, 8)
    sys_rows = system(
        {"full": {"kv_bytes_end": 1e6}, "kivi4": {"kv_bytes_end": 0.25e6}, "kivi2": {"kv_bytes_end": 0.15e6}}, prompts=6
    )
    (row,) = recs({"memory-bound": MEMORY}, frames={"system": sys_rows, "quality_scores": scores}).to_dict("records")
    assert row["best"] == "undecided at n = 8 samples" and row["undecided"] == "kivi4" and row["qualifying"] == 0
    assert "quality >= 0.95x full" in row["why"] and "n = 8 samples" in row["why"]
    # the same mean without the spread: decided, with the pick's interval and n
    steady = quality({m: {"qa": q} for m, q in {"full": 0.5, "kivi4": 0.49, "kivi2": 0.3}.items()}, samples=8)
    (row,) = recs({"memory-bound": MEMORY}, frames={"system": sys_rows, "quality_scores": steady}).to_dict("records")
    assert row["best"] == "kivi4" and row["best_n"] == 8 and row["best_ci_low"] <= 0.49 <= row["best_ci_high"]


def test_a_better_method_still_undecided_is_named_next_to_the_pick():
    rng = np.random.default_rng(1)
    scores = quality({m: {"qa": q} for m, q in {"full": 0.5, "kivi4": 0.49, "kivi2": 0.499}.items()}, samples=8)
    scores.loc[scores.method == "kivi2", "score"] += rng.normal(0, 0.15, 8)
    sys_rows = system(
        {"full": {"kv_bytes_end": 1e6}, "kivi4": {"kv_bytes_end": 0.25e6}, "kivi2": {"kv_bytes_end": 0.15e6}}, prompts=6
    )
    small = {"limits": {"quality": {"min": 0.95, "relative": True}}, "prefer": {"min": "kv_bytes"}}
    (row,) = recs({"small": small}, frames={"system": sys_rows, "quality_scores": scores}).to_dict("records")
    assert row["best"] == "kivi4" and "kivi2 might do better but is undecided at n = 8 samples" in row["why"]


def rel_interval(scores: pd.DataFrame, method: str) -> tuple[float, float]:
    row = report({"quality_scores": scores}).methods.set_index("method").loc[method]
    return row.quality_rel_low, row.quality_rel_high


def test_a_relative_quality_that_differs_from_the_baseline_on_few_samples_gets_an_exact_bound():
    # 0/1 scores, the baseline right on half of 100 samples; kivi4 loses 4 of them (0.92x full).
    # The bootstrap would call that precise; the exact bound (the share of samples that differ is
    # at most its Clopper-Pearson bound p, each costing at most 1) is 1 +- p / 0.5: a 0.85 limit
    # stays undecided, a 0.75 one is met.
    scores = quality({"full": {"qa": 1.0}, "kivi4": {"qa": 1.0}}, samples=100, spread=0.0)
    scores.loc[scores["sample"] % 2 == 1, "score"] = 0.0
    scores.loc[(scores.method == "kivi4") & (scores["sample"] < 8) & (scores["sample"] % 2 == 0), "score"] = 0.0
    p = stats.beta.ppf(0.975, 5, 96)
    assert rel_interval(scores, "kivi4") == pytest.approx((1 - p / 0.5, 1 + p / 0.5))
    for limit, decided in ((0.85, False), (0.75, True)):
        keep = {"limits": {"quality": {"min": limit, "relative": True}}, "prefer": {"min": "quality"}}
        (row,) = recs({"keep": keep}, frames={"quality_scores": scores}).to_dict("records")
        assert (row["undecided"] is None) == decided and row["qualifying"] == (2 if decided else 1)
    # from 6 changed samples on, the bootstrap's interval (read from the differences seen) again
    scores.loc[(scores.method == "kivi4") & (scores["sample"] < 12) & (scores["sample"] % 2 == 0), "score"] = 0.0
    low, high = rel_interval(scores, "kivi4")
    assert high < 1 and high - low < 2 * stats.beta.ppf(0.975, 7, 94) / 0.5


def test_a_method_equal_to_the_baseline_on_every_sample_is_decided_once_n_bounds_it():
    # no sample differs: at a baseline mean of 0.5, 20 samples bound the ratio only to 1 +- 0.34, 400
    # to 1 +- 0.018
    keep = {"limits": {"quality": {"min": 0.95, "relative": True}}, "prefer": {"max": "quality"}}
    for n, decided in ((20, False), (400, True)):
        scores = quality({"full": {"qa": 0.5}, "kivi4": {"qa": 0.5}}, samples=n, spread=0.5)
        (row,) = recs({"keep": keep}, frames={"quality_scores": scores}).to_dict("records")
        assert (row["qualifying"] == 2) == decided and (row["undecided"] is None) == decided
        p = stats.beta.ppf(0.975, 1, n)
        assert rel_interval(scores, "kivi4") == pytest.approx((1 - p / 0.5, 1 + p / 0.5))


def test_the_exact_bound_counts_documents_where_the_cell_resamples_them():
    # 40 samples from 10 documents; kivi4 differs on 2 samples of one document: 1 changed of 10 units
    scores = quality({"full": {"qa": 0.5}, "kivi4": {"qa": 0.5}}, samples=40, spread=0.5)
    scores["doc_ids"] = [f'["doc{s % 10}"]' for s in scores["sample"]]  # a JSON list, as the stage writes it
    changed = (scores.method == "kivi4") & scores["sample"].isin([3, 13])
    scores.loc[changed, "score"] = 1 - scores.loc[changed, "score"]
    p = stats.beta.ppf(0.975, 2, 9)
    assert rel_interval(scores, "kivi4") == pytest.approx((1 - p / 0.5, 1 + p / 0.5))


def test_too_few_units_leave_every_answer_undecided():
    (row,) = recs(
        {"memory-bound": MEMORY},
        frames={
            "system": system({"full": {"kv_bytes_end": 1e6}, "kivi2": {"kv_bytes_end": 0.25e6}}, prompts=3),
            "quality_scores": quality({"full": {"qa": 0.5}, "kivi2": {"qa": 0.5}}, samples=3),
        },
    ).to_dict("records")
    assert row["best"].startswith("undecided at n = 3") and "no interval" in row["why"]


def test_each_protocol_gets_its_own_answer_and_says_which_it_read():
    qa = quality({m: {"qa": q} for m, q in {"full": 0.5, "kivi2": 0.49, "turboquant3": 0.40}.items()}, samples=6)
    co = quality({m: {"qa": q} for m, q in {"full": 0.5, "kivi2": 0.30, "turboquant3": 0.49}.items()}, samples=6)
    frames = {
        "system": SYSTEM,
        "quality_scores": pd.concat([qa.assign(protocol="query-aware"), co.assign(protocol="context-only")]),
    }
    rows = recs({"memory-bound": MEMORY}, frames=frames).set_index("protocol").best
    assert rows.to_dict() == {"context-only": "turboquant3", "query-aware": "kivi2"}


def test_a_pick_not_separated_from_its_runner_up_is_undecided_and_both_are_named():
    # kivi2 leads turboquant3 by 0.01 on average, but the per-sample differences swing +-0.1: the
    # paired interval holds 0, so neither is the answer at this n (the old rule named kivi2).
    scores = quality({"kivi2": {"qa": 0.5}, "turboquant3": {"qa": 0.49}}, samples=12)
    noise = np.random.default_rng(3).normal(0, 0.1, 12)
    scores.loc[scores.method == "kivi2", "score"] += noise - noise.mean()
    only = {"limits": {"quality": {"min": 0.3}}, "prefer": {"max": "quality"}}
    (row,) = recs({"only": only}, frames={"quality_scores": scores}).to_dict("records")
    assert row["best"] == "undecided at n = 12 samples: kivi2 or turboquant3" and row["best_candidate"] == "kivi2"
    assert row["versus_runner_up"] == pytest.approx(0.01) and row["versus_runner_up_n"] == 12
    assert row["versus_runner_up_low"] < 0 < row["versus_runner_up_high"]
    assert "includes no-effect" in row["why"] and "paired difference of means" in row["versus_runner_up_test"]


def test_a_pick_separated_by_the_paired_difference_is_named_although_the_intervals_overlap():
    # Both methods swing +-0.2 from sample to sample, the same way; kivi2 is 0.03 above turboquant3 on
    # every sample: the two intervals overlap, the paired difference does not hold 0.
    swing = np.random.default_rng(4).normal(0, 0.2, 10)
    scores = quality({m: {"qa": q} for m, q in {"full": 0.6, "kivi2": 0.6, "turboquant3": 0.57}.items()}, samples=10)
    for method in ("full", "kivi2", "turboquant3"):
        scores.loc[scores.method == method, "score"] += swing
    only = {"limits": {"quality": {"min": 0.3}}, "prefer": {"max": "quality"}}
    frames = {"quality_scores": scores[scores.method != "full"]}
    (row,) = recs({"only": only}, frames=frames).to_dict("records")
    assert (row["best"], row["runner_up"], row["best_candidate"]) == ("kivi2", "turboquant3", "kivi2")
    assert row["best_ci_low"] < row["runner_up_value"]  # the runner-up's value lies inside the pick's interval
    assert row["versus_runner_up"] == pytest.approx(0.03) and row["versus_runner_up_low"] > 0
    assert "(separated)" in row["why"]


def test_methods_tied_on_the_preferred_column_are_compared_on_the_tie_break():
    # Equal quality on every sample: the smaller KV decides, and is what the paired test compares.
    scores = quality({m: {"qa": 0.5} for m in ("full", "kivi4", "kivi2")}, samples=6)
    sys_rows = system(
        {"full": {"kv_bytes_end": 1e6}, "kivi4": {"kv_bytes_end": 0.4e6}, "kivi2": {"kv_bytes_end": 0.25e6}}, prompts=6
    )
    keep = {"limits": {"kv_bytes": {"max": 0.5, "relative": True}}, "prefer": {"max": "quality"}}
    (row,) = recs({"keep": keep}, frames={"system": sys_rows, "quality_scores": scores}).to_dict("records")
    assert (row["best"], row["runner_up"]) == ("kivi2", "kivi4")
    assert (
        "kivi2 / kivi4 on kv_bytes: 0.625" in row["versus_runner_up_test"] and "prompts" in row["versus_runner_up_test"]
    )


def test_a_fidelity_preference_is_compared_by_the_position_weighted_difference():
    # kivi4 agrees better than kivi2 on long continuations, worse on short ones: weighted by positions
    # (as the joined table pools fidelity) kivi4 leads; unweighted the difference would be 0.
    scores = quality({m: {"qa": 0.5} for m in ("kivi4", "kivi2")}, samples=6)
    agree = fidelity({"kivi4": {"qa": 0.9}, "kivi2": {"qa": 0.9}}, samples=6)
    positions = np.array([40, 4, 40, 4, 40, 4])
    agree["positions"] = np.tile(positions, 2)
    agree.loc[agree.method == "kivi4", "top1_agreement"] += np.tile([0.05, -0.05], 3)
    faithful = {"limits": {"quality": {"min": 0.2}}, "prefer": {"max": "top1_agreement"}}
    frames = {"quality_scores": scores, "quality_fidelity": agree}
    (row,) = recs({"faithful": faithful}, frames=frames).to_dict("records")
    weighted = np.average(np.tile([0.05, -0.05], 3), weights=positions)
    assert (row["runner_up"], row["best_candidate"]) == ("kivi2", "kivi4")
    assert row["versus_runner_up"] == pytest.approx(weighted) and weighted > 0.03


def test_system_stage_comparisons_pair_each_method_with_its_own_jobs_baseline():
    # kivi2 and kivi4 ran in separate jobs, each beside its own `full`; kivi2's job ran 30 % slower
    # throughout (its full too). By raw medians kivi4 (10 tok/s) leads full (8.5, both jobs pooled)
    # by 1.18x; paired with the full of its own job it equals full, so the two are not separated.
    rows = []
    for job, method, speed, drift in (("j1", "kivi2", 11.0, 0.7), ("j2", "kivi4", 10.0, 1.0)):
        both = system({"full": {"decode_tok_s": 10.0}, method: {"decode_tok_s": speed}}, prompts=6, noise=0.01)
        both["decode_tok_s"] *= drift
        rows.append(both.assign(job=job))
    fast = {"limits": {}, "prefer": {"max": "decode_tok_s"}}
    (row,) = recs({"fast": fast}, frames={"system": pd.concat(rows, ignore_index=True)}).to_dict("records")
    assert (row["best_candidate"], row["runner_up"]) == ("kivi4", "full")
    assert row["versus_runner_up"] == pytest.approx(1.0, abs=0.02) and row["versus_runner_up_n"] == 6
    assert row["best"] == "undecided at n = 6 prompts: kivi4 or full"
    assert "geometric mean of paired ratios" in row["versus_runner_up_test"]


def test_a_paired_comparison_that_favours_the_runner_up_says_so():
    # kivi4 leads on the median decode speed (5 vs 4 tok/s) but is half kivi2's speed on 40 % of the
    # prompts: the paired geometric mean kivi4 / kivi2 is 0.87, its interval below 1.
    speeds = {"kivi4": [1.0] * 40 + [5.0] * 60, "kivi2": [2.0] * 40 + [4.0] * 60}
    sys_rows = system({"full": {"decode_tok_s": 3.0}, "kivi4": {}, "kivi2": {}}, prompts=100)
    for method, values in speeds.items():
        sys_rows.loc[sys_rows.method == method, "decode_tok_s"] = values
    fast = {"limits": {}, "prefer": {"max": "decode_tok_s"}}
    (row,) = recs({"fast": fast}, frames={"system": sys_rows}).to_dict("records")
    assert (row["best_candidate"], row["runner_up"]) == ("kivi4", "kivi2")
    assert row["versus_runner_up"] == pytest.approx(math.exp(0.4 * math.log(0.5) + 0.6 * math.log(1.25)))
    assert row["versus_runner_up_high"] < 1 and row["best"].startswith("undecided at n = 100 prompts")
    assert "favours kivi2" in row["why"]

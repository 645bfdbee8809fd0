"""The report's engine-quality table (kvbench.report.engine) on hand-built served and harness rows:
paired differences against vLLM's 16-bit server and against the harness's nearest method, their
verdicts, and what is counted."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from report_frames import fidelity, quality, served, tables

from kvbench.report.engine import engine_table
from kvbench.report.samples import paired_quality

REF = "vllm-bfloat16"
NOISE = [0.05, -0.03, 0.02, -0.04, 0.01, 0.03, -0.02, -0.01, 0.04, -0.05]


HARNESS = {"compute_dtype": "bfloat16", "reference_top_k": 1024, "fidelity_positions": 16}


def _table(frames, n_boot=400):
    built = tables(**frames)
    return engine_table(built, paired_quality(built, "full"), "full", n_boot, seed=3, level=0.95, harness=HARNESS)


def _row(table, server, against, quantity):
    found = table[(table.server == server) & (table.against == against) & (table.quantity == quantity)]
    assert len(found) == 1, (server, against, quantity)
    return found.iloc[0]


def test_a_score_drop_on_every_sample_is_lower_with_its_interval_and_n():
    base = 0.5 + np.array(NOISE)
    table = _table({"quality_served": served({REF: base, "vllm-fp8": base - 0.1 + np.array(NOISE[::-1]) / 5})})
    row = _row(table, "vllm-fp8", REF, "score")
    assert row.difference == pytest.approx(-0.1, abs=1e-9) and row.n == 10 and row.samples == 10
    assert row.ci_high < 0 and row.verdict == "lower"
    assert row.against_value == pytest.approx(base.mean()) and row.value == pytest.approx(base.mean() - 0.1)
    assert row.against_kind == "engine reference" and REF not in set(table.server)


def test_equal_scores_get_no_interval_and_a_null_mean_difference_is_inconclusive():
    base = 0.5 + np.array(NOISE)
    table = _table({"quality_served": served({REF: base, "vllm-fp8": base, "vllm-int8-per-token-head": base[::-1]})})
    assert _row(table, "vllm-fp8", REF, "score").verdict == "no interval at n = 10"  # no sample differs
    swapped = _row(table, "vllm-int8-per-token-head", REF, "score")
    assert swapped.difference == pytest.approx(0, abs=1e-12) and swapped.ci_low < 0 < swapped.ci_high
    assert swapped.verdict == "inconclusive at n = 10: the interval holds 0"


def test_fidelity_is_paired_with_the_reference_servers_own_noise_and_weighted_by_positions():
    kl = [0.1 + 0.01 * i for i in range(10)]
    frame = served({REF: [0.5] * 10, "vllm-fp8": [0.5] * 10}, kl={"vllm-fp8": kl})
    frame.loc[(frame.server == "vllm-fp8") & (frame["sample"] == 0), "positions"] = 160  # 10x the others
    table = _table({"quality_served": frame})
    row = _row(table, "vllm-fp8", REF, "kl_mean")
    weights = np.array([10] + [1] * 9)
    assert row.value == pytest.approx(np.average(kl, weights=weights)) and row.against_value == 0
    assert row.verdict == "higher" and row.ci_low > 0
    # a server no further from the 16-bit server than that server's second run is from its first
    noisy = served({REF: [0.5] * 10, "vllm-fp8": [0.5] * 10}, kl={"vllm-fp8": kl, REF: kl[::-1]})
    same = _row(_table({"quality_served": noisy}), "vllm-fp8", REF, "kl_mean")
    assert same.against_value == pytest.approx(np.mean(kl)) and same.ci_low < 0 < same.ci_high
    assert same.verdict.startswith("inconclusive")
    top1 = _row(table, "vllm-fp8", REF, "top1_agreement")
    assert top1.against_value == 1 and top1.verdict == "lower"
    assert _row(table, "vllm-fp8", REF, "kl_first").value == pytest.approx(np.mean(kl) / 2)
    assert _row(table, "vllm-fp8", REF, "decode_kl_mean").value == pytest.approx(2 * np.mean(kl))


def test_the_engine_is_checked_against_its_harness_method_each_against_its_own_reference():
    # the harness: 8 samples, turboquant4-mse loses 0.05 against full and has KL 0.1;
    # the engine: 10 samples, vllm-turboquant-4bit loses 0.2 against bf16 and has KL 0.3
    noise = np.array(NOISE)
    harness = quality({"full": {"qa": 0.5}, "turboquant4-mse": {"qa": 0.45}}, samples=8, spread=0.0)
    harness.loc[harness.method == "turboquant4-mse", "score"] += noise[:8] / 10
    kl = 0.3 + noise / 10
    frame = served(
        {REF: 0.6 + noise, "vllm-turboquant-4bit": 0.4 + noise + noise[::-1] / 10}, kl={"vllm-turboquant-4bit": kl}
    )
    table = _table(
        {
            "quality_served": frame,
            "quality_scores": harness,
            "quality_fidelity": fidelity({"full": {"qa": 1.0}, "turboquant4-mse": {"qa": 0.9}}, samples=8),
        }
    )
    change = _row(table, "vllm-turboquant-4bit", "turboquant4-mse", "score_change")
    engine_change = (noise[::-1] / 10 - 0.2)[:8].mean()
    harness_change = (noise[:8] / 10 - 0.05).mean()
    assert change.n == 8 and change.difference == pytest.approx(engine_change - harness_change)
    assert change.against_kind == "harness method" and change.verdict == "lower"
    kl_row = _row(table, "vllm-turboquant-4bit", "turboquant4-mse", "kl_mean")
    assert kl_row.value == pytest.approx(kl[:8].mean()) and kl_row.against_value == pytest.approx(0.1)
    assert kl_row.verdict == "higher" and "computed in bfloat16" in kl_row.note and "top-1024" in kl_row.note
    assert "decode_kl_mean" not in set(table[table.against == "turboquant4-mse"].quantity)  # the prefill reads it
    assert _row(table, "vllm-turboquant-4bit", REF, "score").against_kind == "engine reference"


def test_a_cache_the_prefill_skips_is_checked_at_its_decode_steps_against_query_aware():
    """vLLM's TurboQuant attends to the raw K/V in a request's first prefill chunk (`fidelity_note`):
    its forced positions say nothing of the cache; its decode steps do, as the harness's
    query-aware protocol reads its cache after a full-precision prefill."""
    noise = np.array(NOISE[:8])
    aware = quality({"full": {"qa": 0.5}, "turboquant4-mse": {"qa": 0.5}}, samples=8, spread=0.0)
    harness = pd.concat([aware.assign(protocol="query-aware"), aware.assign(protocol="context-only")])
    fid = fidelity({"full": {"qa": 1.0}, "turboquant4-mse": {"qa": 0.9}}, samples=8).assign(protocol="query-aware")
    frame = served({REF: [0.5] * 8, "vllm-turboquant-4bit": [0.5] * 8}, kl={"vllm-turboquant-4bit": 0.2 + noise})
    frame["fidelity_note"] = np.where(frame.server == REF, None, "prefill skips the compressed cache")
    table = _table({"quality_served": frame, "quality_scores": harness, "quality_fidelity": fid})
    cross = table[table.against == "turboquant4-mse"].set_index("quantity")
    assert set(cross.index) == {"score_change", "decode_kl_mean"} and set(cross.protocol) == {"query-aware"}
    decode = cross.loc["decode_kl_mean"]  # the engine's decode-time KL (2x its forced) vs the harness's KL
    assert decode.value == pytest.approx(2 * (0.2 + noise).mean()) and decode.against_value == pytest.approx(0.1)
    assert "prefill skips the compressed cache" in decode.note
    assert "prefill skips" in _row(table, "vllm-turboquant-4bit", REF, "kl_mean").note


def test_failed_rows_are_counted_and_a_server_without_harness_method_has_only_its_reference_rows():
    frame = served({REF: [0.5] * 6, "vllm-int8-per-token-head": [0.5, 0.4, float("nan"), 0.3, 0.5, 0.2]})
    table = _table({"quality_served": frame})
    rows = table[table.server == "vllm-int8-per-token-head"]
    assert set(rows.against) == {REF} and set(rows.failed) == {1}
    assert _row(table, "vllm-int8-per-token-head", REF, "score").n == 5


def test_no_served_table_gives_an_empty_table_with_its_columns():
    from kvbench.report.engine import ENGINE_COLUMNS

    table = _table({"quality_scores": quality({"full": {"qa": 0.5}})})
    assert table.empty and list(table.columns) == ENGINE_COLUMNS


def test_the_harness_side_is_its_context_only_protocol_where_it_ran():
    # the engine quantizes K/V as written: the question reads the quantized context, as under context-only
    noise = np.array(NOISE[:8])
    aware = quality({"full": {"qa": 0.5}, "fp8": {"qa": 0.5}}, samples=8, spread=0.0).assign(protocol="query-aware")
    only = aware.assign(protocol="context-only")
    only.loc[only.method == "fp8", "score"] = 0.3 + noise
    frame = served({REF: [0.5] * 8, "vllm-fp8": 0.3 + noise})
    both = {"quality_served": frame, "quality_scores": pd.concat([aware, only], ignore_index=True)}
    change = _row(_table(both), "vllm-fp8", "fp8", "score_change")
    assert change.protocol == "context-only" and change.difference == pytest.approx(0, abs=1e-12)
    assert "the question through it" in change.note
    aware_only = _row(_table({**both, "quality_scores": aware}), "vllm-fp8", "fp8", "score_change")
    assert aware_only.protocol == "query-aware" and aware_only.difference == pytest.approx(-0.2 + noise.mean())

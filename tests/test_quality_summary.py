"""The quality summary on a hand-made table: paired comparison with the reference, pooling, the `all` row,
errors, the time outside forward passes."""

import math

import pandas as pd
import pytest

from kvbench.quality.summary import summarize


def row(
    method,
    category,
    sample,
    score,
    kl=None,
    positions=None,
    divergence=None,
    error=None,
    ttft=1.0,
    protocol="query-aware",
):
    return {
        "method": method,
        "kind": method,
        "params": "[]",
        "protocol": protocol,
        "task": f"kvbench_{category}",
        "category": category,
        "sample_id": sample,
        "question_tokens": 20,
        "kl_first": None if kl is None else 0.0,
        "bucket": "0-4k",
        "context_tokens": 100,
        "new_tokens": 4,
        "score": score,
        "error": error,
        "kl_mean": kl,
        "kl_max": kl,
        "fidelity_reference": None if kl is None else "whole vocabulary",
        "top1_agreement": None if kl is None else 1 - kl,
        "fidelity_positions": positions,
        "first_divergence": divergence,
        "same_output_as_reference": None if kl is None else divergence is None,
        "ratio_end": 1.0 if method == "full" else 4.0,
        "kv_bytes_end": 100,
        "ttft_s": ttft,
        "tpot_s": 0.1,
        "forward_s": 2.0,
        "job_wall_s": 10.0 if method == "full" else 20.0,
        "job_forward_s": 8.0 if method == "full" else 17.0,
        "job_methods": method,
    }


@pytest.fixture
def tables():
    table = pd.DataFrame(
        [
            row("full", "qa", "s1", 0.5),
            row("full", "qa", "s2", 1.0),
            row("full", "summary", "s3", 0.2),
            row("full", "summary", "s4", None, error="RuntimeError: out of memory"),  # the reference failed on s4
            row("kivi2", "qa", "s1", 0.5, kl=0.1, positions=10, divergence=3, ttft=1.0),
            row("kivi2", "qa", "s2", None, error="RuntimeError: out of memory"),  # the method failed on s2
            row("kivi2", "summary", "s3", 0.1, kl=0.4, positions=30, divergence=None, ttft=2.0),
            row("kivi2", "summary", "s4", 0.0, error="empty output", ttft=6.0),  # scored, but no reference
        ]
    )
    return summarize(table, "full")


def test_scores_are_compared_with_the_reference_on_paired_samples(tables):
    summary = tables["summary"].set_index(["method", "category"])
    qa, summ = summary.loc[("kivi2", "qa")], summary.loc[("kivi2", "summary")]
    # kivi2 failed on s2: its 0.5 on s1 is compared with full's 0.5 on s1, not with full's 0.75 over s1 and s2
    assert qa.samples == 2 and qa.errors == 1 and qa.score_mean == 0.5 and qa.score_mean_failures_zero == 0.25
    assert qa.paired_samples == 1 and qa.reference_score_mean == 0.5 and qa.score_delta == 0 and qa.score_relative == 1
    # full failed on s4: kivi2's score there counts in its own mean, not in the comparison
    assert summ.score_mean == pytest.approx(0.05) and summ.paired_samples == 1
    assert summ.reference_score_mean == pytest.approx(0.2) and summ.score_relative == pytest.approx(0.5)
    assert summary.loc[("full", "all")].score_delta == 0 and summary.loc[("full", "all")].paired_samples == 3


def test_fidelity_pools_positions_and_the_all_row_pools_samples(tables):
    summary = tables["summary"].set_index(["method", "category"])
    summ, overall = summary.loc[("kivi2", "summary")], summary.loc[("kivi2", "all")]
    assert summ.kl_mean == pytest.approx(0.4) and summ.empty_outputs == 1
    assert summ.identical_outputs == 1 and math.isnan(summ.first_divergence_median)
    assert overall.categories == 2 and overall.samples == 4 and overall.errors == 1 and overall.empty_outputs == 1
    assert overall.score_mean == pytest.approx(0.6 / 3) and overall.score_mean_failures_zero == pytest.approx(0.15)
    assert overall.paired_samples == 2 and overall.score_delta == pytest.approx(0.3 - 0.35)
    # pooled over every decode position (not the mean of the categories' 0.1 and 0.4), counts summed
    assert overall.kl_mean == pytest.approx((0.1 * 10 + 0.4 * 30) / 40) and overall.fidelity_positions == 40
    assert overall.top1_agreement == pytest.approx((0.9 * 10 + 0.6 * 30) / 40) and overall.identical_outputs == 1
    # the median over the samples (1, 2, 6), not the mean of the categories' medians (1 and 4)
    assert overall.ttft_s_median == 2.0 and overall.first_divergence_median == 3


def test_tables_split_scores_and_fidelity(tables):
    assert "kl_mean" not in tables["scores"] and len(tables["scores"]) == 8
    assert set(tables["fidelity"].method) == {"kivi2"} and len(tables["fidelity"]) == 4
    jobs = tables["jobs"].set_index("job_methods")
    assert jobs.loc["kivi2", "outside_forward_share"] == pytest.approx(3 / 20) and jobs.loc["kivi2", "errors"] == 1
    assert "job_wall_s" not in tables["scores"] and "job_methods" not in tables["scores"]


def test_a_job_of_several_methods_is_one_row_of_the_jobs_table():
    rows = [row("full", "qa", "s1", 0.5), row("kivi2", "qa", "s1", 0.5, kl=0.1, positions=10)]
    table = pd.DataFrame(rows).assign(job_methods="full,kivi2", job_wall_s=30.0, job_forward_s=27.0)
    [job] = summarize(table, "full")["jobs"].to_dict("records")
    assert job["job_methods"] == "full,kivi2" and job["methods"] == 2 and job["rows"] == 2
    assert job["outside_forward_s"] == pytest.approx(3.0) and job["outside_forward_share"] == pytest.approx(0.1)


def test_figures_are_written(tables, tmp_path):
    from kvbench.plots import quality_fidelity_figure, quality_ratio_figure, quality_score_figure

    quality_score_figure(tables["summary"], "full", tmp_path / "scores.png")
    quality_fidelity_figure(tables["summary"], tmp_path / "fidelity.png")
    quality_ratio_figure(tables["summary"], "full", tmp_path / "ratio.png")
    for name in ("scores", "fidelity", "ratio"):
        assert (tmp_path / f"{name}.png").read_bytes()[:4] == b"\x89PNG"


def test_each_protocol_is_compared_with_the_reference_under_the_same_protocol():
    rows = [
        row("full", "qa", "s1", 1.0),
        row("full", "qa", "s1", 0.0, protocol="context-only"),
        row("kivi2", "qa", "s1", 0.5, kl=0.1, positions=4),
        row("kivi2", "qa", "s1", 0.5, kl=0.3, positions=4, protocol="context-only"),
    ]
    summary = summarize(pd.DataFrame(rows), "full")["summary"].set_index(["method", "protocol", "category"])
    assert summary.loc[("kivi2", "query-aware", "qa")].score_delta == pytest.approx(-0.5)
    assert summary.loc[("kivi2", "context-only", "qa")].score_delta == pytest.approx(0.5)
    assert summary.loc[("kivi2", "context-only", "all")].kl_mean == pytest.approx(0.3)

"""The quality summary on a hand-made table: pooling, the `all` row, errors, the time outside forward passes."""

import math

import pandas as pd
import pytest

from kvbench.quality.summary import summarize


def row(method, category, score, kl=None, positions=None, divergence=None, error=None):
    return {"method": method, "kind": method, "task": f"kvbench_{category}", "category": category, "sample_id": "s",
            "bucket": "0-4k", "context_tokens": 100, "new_tokens": 4, "score": score, "error": error,
            "kl_mean": kl, "kl_max": kl, "top1_agreement": None if kl is None else 1 - kl, "fidelity_positions": positions,
            "first_divergence": divergence, "ratio_end": 1.0 if method == "full" else 4.0, "kv_bytes_end": 100,
            "ttft_s": 1.0, "tpot_s": 0.1, "forward_s": 2.0, "job_wall_s": 10.0 if method == "full" else 20.0,
            "job_forward_s": 8.0 if method == "full" else 17.0}


@pytest.fixture
def tables():
    table = pd.DataFrame([
        row("full", "qa", 0.5), row("full", "qa", 1.0), row("full", "summary", 0.2),
        row("kivi2", "qa", 0.5, kl=0.1, positions=10, divergence=3),
        row("kivi2", "qa", None, error="RuntimeError: out of memory"),
        row("kivi2", "summary", 0.1, kl=0.4, positions=30, divergence=None),
        row("kivi2", "summary", 0.0, kl=0.0, positions=10, divergence=None, error="empty output"),
    ])
    return summarize(table, "full")


def test_summary_pools_positions_and_counts_failures(tables):
    summary = tables["summary"].set_index(["method", "category"])
    qa, summ = summary.loc[("kivi2", "qa")], summary.loc[("kivi2", "summary")]
    assert qa.samples == 2 and qa.errors == 1 and qa.score_mean == 0.5
    assert qa.reference_score_mean == 0.75 and qa.score_delta == -0.25 and qa.score_relative == pytest.approx(2 / 3)
    assert summ.kl_mean == pytest.approx((0.4 * 30 + 0.0 * 10) / 40) and summ.empty_outputs == 1
    assert summ.identical_outputs == 2 and math.isnan(summ.first_divergence_median)
    overall = summary.loc[("kivi2", "all")]
    assert overall.score_mean == pytest.approx((0.5 + 0.05) / 2) and overall.samples == 4 and overall.errors == 1
    assert (summary.loc["full"].score_delta == 0).all()


def test_tables_split_scores_and_fidelity(tables):
    assert "kl_mean" not in tables["scores"] and len(tables["scores"]) == 7
    assert set(tables["fidelity"].method) == {"kivi2"} and len(tables["fidelity"]) == 4
    jobs = tables["jobs"].set_index("method")
    assert jobs.loc["kivi2", "outside_forward_share"] == pytest.approx(3 / 20) and jobs.loc["kivi2", "errors"] == 1


def test_figures_are_written(tables, tmp_path):
    from kvbench.plots import quality_fidelity_figure, quality_ratio_figure, quality_score_figure

    quality_score_figure(tables["summary"], "full", tmp_path / "scores.png")
    quality_fidelity_figure(tables["summary"], tmp_path / "fidelity.png")
    quality_ratio_figure(tables["summary"], "full", tmp_path / "ratio.png")
    for name in ("scores", "fidelity", "ratio"):
        assert (tmp_path / f"{name}.png").read_bytes()[:4] == b"\x89PNG"

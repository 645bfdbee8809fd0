"""The report's tables with intervals and its figures, on hand-built stage tables
(tests/report_frames.py): method-vs-reference differences, paired system ratios, the joined
table's intervals, the power table, the first page, and what the figures draw."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from report_frames import METHODS, fidelity, quality, report, system, tables

from kvbench.report import build as rb
from kvbench.report.differences import quality_differences, system_ratios
from kvbench.report.joined import method_table
from kvbench.report.samples import paired_quality, system_units


def _scores(protocols=("query-aware",), samples=6, noise=0.0) -> pd.DataFrame:
    rng = np.random.default_rng(0)
    frames = []
    for p in protocols:
        q = quality(
            {
                "full": {"qa": 0.6, "summarization": 0.3},
                "kivi2": {"qa": 0.5, "summarization": 0.2},
                "kivi4": {"qa": 0.6, "summarization": 0.3},
            },
            samples=samples,
        )
        q["score"] = q.score + rng.normal(0, noise, len(q))
        q["ratio"] = q.method.map({"full": 1.0, "kivi2": 6.0, "kivi4": 3.5})
        frames.append(q.assign(protocol=p) if p else q)
    return pd.concat(frames, ignore_index=True)


def _row(table: pd.DataFrame, **key) -> pd.Series:
    rows = table[np.logical_and.reduce([table[k] == v for k, v in key.items()])]
    assert len(rows) == 1, rows
    return rows.iloc[0]


def test_differences_pair_each_sample_with_the_reference():
    scores = _scores()
    failed = (scores.method == "kivi2") & (scores["sample"] == 0) & (scores.category == "qa")
    scores.loc[failed, ["score", "error"]] = [math.nan, "OOM"]
    diff = quality_differences(paired_quality(tables(quality_scores=scores), "full"), "full", 500, 1, 0.95)
    row = _row(diff, method="kivi2", category="qa", bucket="0-4k", quantity="score")
    assert row.difference == pytest.approx(-0.1)
    # 5 pairs, all 0.1 apart: even an exact sign test could not decide (p = 2 / 2^5), so no interval
    assert math.isnan(row.ci_low) and math.isnan(row.ci_high) and math.isnan(row.p_value)
    assert (row.n, row.failed) == (5, 1)  # the failed sample is counted, and left out of the pairs
    # over the 5 paired samples (sample 0, +0.02 for both, left out)
    assert row.reference_value == pytest.approx(0.596) and row.value == pytest.approx(0.496)
    pooled = _row(diff, method="kivi2", category="all", bucket="all", quantity="score")
    assert pooled.n == 11 and pooled.difference == pytest.approx(-0.1)
    assert (pooled.ci_low, pooled.ci_high) == (pytest.approx(-0.1),) * 2  # 11 pairs: the bootstrap reads them
    assert set(diff.protocol) == {"query-aware"} and "full" not in set(diff.method)
    assert (diff.level == 0.95).all() and (diff.bootstrap_seed == 1).all()
    assert diff[(diff.method == "kivi2") & (diff.category != "qa")].p_value.notna().all()
    # kivi4 scores as full on every sample: a difference of 0 everywhere has no interval to read
    assert diff[(diff.method == "kivi4") & (diff.quantity == "score")].ci_low.isna().all()


def test_a_difference_on_four_samples_of_a_hundred_gets_no_interval():
    # 0/1 scores that change on 4 samples of 100, all the same way: a bootstrap interval would exclude 0
    # (the chance of drawing none of the 4 is about e^-4), an exact sign test gives p = 0.125.
    scores = quality({"full": {"qa": 1.0}, "kivi2": {"qa": 1.0}}, samples=100)
    drop = (scores.method == "kivi2") & (scores["sample"] < 4)
    scores.loc[drop, "score"] = 0.0
    diff = quality_differences(paired_quality(tables(quality_scores=scores), "full"), "full", 500, 1, 0.95)
    row = _row(diff, method="kivi2", category="qa", bucket="0-4k", quantity="score")
    assert row.difference == pytest.approx(-0.04) and row.n == 100
    assert math.isnan(row.ci_low) and math.isnan(row.p_value)


def test_a_table_without_protocol_is_one_group_and_two_protocols_are_two():
    one = quality_differences(paired_quality(tables(quality_scores=_scores((None,))), "full"), "full", 200, 1, 0.95)
    assert set(one.protocol) == {"query-aware"}
    two = quality_differences(
        paired_quality(tables(quality_scores=_scores(("query-aware", "context-only"))), "full"), "full", 200, 1, 0.95
    )
    assert set(two.protocol) == {"query-aware", "context-only"} and len(two) == 2 * len(one)


def test_fidelity_differences_are_pooled_over_positions_and_kl_first_kept():
    scores = _scores()
    fid = fidelity({"kivi2": {"qa": 0.8, "summarization": 0.8}}, samples=6).assign(kl_first=0.2)
    fid.loc[fid.index[:3], ["top1_agreement", "positions"]] = [0.5, 48]  # three long, worse continuations
    diff = quality_differences(
        paired_quality(tables(quality_scores=scores, quality_fidelity=fid), "full"), "full", 200, 1, 0.95
    )
    top1 = _row(diff, category="qa", quantity="top1_agreement")
    assert top1.value == pytest.approx((3 * 48 * 0.5 + 3 * 16 * 0.8) / (3 * 48 + 3 * 16))
    assert top1.difference == pytest.approx(top1.value - 1) and top1.reference_value == 1
    assert _row(diff, category="qa", quantity="kl_first").value == pytest.approx(0.2)
    fd = _row(diff, category="qa", quantity="first_divergence")
    assert fd.value == 5 and fd.reference_value == pytest.approx((48 * 3 + 16 * 3) / 6)


def _runs(drift: float, overhead: float, prompts: int = 6, repeats: int = 3, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    rows = []
    for p in range(prompts):
        for r in range(repeats):
            shared = rng.lognormal(0, drift)
            for m, o in (("full", 1.0), ("kivi2", overhead)):
                rows.append(
                    {
                        "model": "m",
                        "method": m,
                        "prompt_id": f"doc{p}@1024",
                        "corpus": "realistic",
                        "repeat": r,
                        "ttft_s": o * shared,
                        "tpot_s": 0.1 * shared,
                        "decode_tok_s": 10 / shared,
                        "e2e_s": 2 * shared,
                        "kv_bytes_end": 1e6,
                        "ratio_end": 1.0,
                        "error": None,
                    }
                )
    return pd.DataFrame(rows)


def test_system_ratios_pair_runs_of_one_round():
    runs = _runs(drift=0.5, overhead=1.07)
    metrics = system({"full": {}, "kivi2": {}}, prompts=6)  # bucket and length per prompt
    units, source, paired = system_units(tables(system_runs=runs, system=metrics), "full")
    table = system_ratios(units, source, paired, "full", 500, 1, 0.95)
    ttft = _row(table, bucket="0-4k", metric="ttft_s")
    # a 50 % drift between rounds, cancelled: the paired ratio is exact
    assert ttft.ratio == pytest.approx(1.07) and ttft.ci_high - ttft.ci_low < 1e-9
    assert (ttft.prompts, ttft.pairs, ttft.failed) == (6, 18, 0) and "one process" in ttft.pairing
    assert ttft.source == "results/system/runs.parquet"
    assert _row(table, bucket="all", metric="tpot_s").ratio == 1
    # unpaired (another prompt's rounds, as separate jobs would be), the same drift swamps 7 %
    shuffled = runs.assign(
        prompt_id=np.where(
            runs.method == "kivi2", runs.prompt_id.map(lambda p: f"doc{(int(p[3]) + 1) % 6}@1024"), runs.prompt_id
        )
    )
    units, *_ = system_units(tables(system_runs=shuffled, system=metrics), "full")
    loose = _row(system_ratios(units, source, paired, "full", 500, 1, 0.95), bucket="0-4k", metric="ttft_s")
    assert loose.ci_low < 1.0 < loose.ci_high and loose.ratio == pytest.approx(1.07, rel=0.3)


def test_failed_runs_are_counted_not_paired():
    runs = _runs(0.1, 1.1)
    runs.loc[(runs.method == "kivi2") & (runs.repeat == 0), ["ttft_s", "error"]] = [math.nan, "RuntimeError: OOM"]
    units, source, paired = system_units(tables(system_runs=runs), "full")
    row = _row(system_ratios(units, source, paired, "full", 200, 1, 0.95), bucket="-", metric="ttft_s")
    assert (row.pairs, row.failed, row.prompts) == (12, 6, 6)


def test_the_joined_table_carries_intervals_and_n_for_every_measured_column():
    frames = {
        "quality_scores": _scores(noise=0.05),
        "system": system({"full": {}, "kivi2": {"ttft_s": 1.2}}, prompts=6),
    }
    table = method_table(tables(**frames), "full", 500, 1, 0.95)
    row = _row(table, method="kivi2", category="qa")
    assert row.quality_low < row.quality < row.quality_high and row.quality_n == 6
    assert row.quality_rel_low < row.quality_rel < row.quality_rel_high
    assert row.ttft_s_rel == pytest.approx(1.2) and row.ttft_s_n == 6 and row.timing_source.endswith("metrics.parquet")
    assert row.protocol == "query-aware" and _row(table, method="full", category="qa").quality_rel == 1.0


def test_quality_buckets_the_system_stage_did_not_run_read_its_pooled_numbers():
    scores = _scores().assign(bucket="~3K")  # a label of the quality stage's own
    frames = {"quality_scores": scores, "system": system({"full": {}, "kivi2": {"decode_tok_s": 12.0}}, prompts=6)}
    row = _row(method_table(tables(**frames), "full", 200, 1, 0.95), method="kivi2", category="qa")
    assert row.decode_tok_s == 12.0 and row.system_bucket == "all" and row.bucket == "~3K"


def test_power_tables_cover_both_stages():
    built = report({"quality_scores": _scores(noise=0.05), "system_runs": _runs(0.2, 1.1)})
    power = built.power
    assert set(power.stage) == {"quality", "system"}
    quality_rows = power[(power.stage == "quality") & (power.quantity == "score")]
    assert quality_rows.n.max() == 12 and (quality_rows.effect == 0.05).all() and quality_rows.n_needed.notna().all()
    system_rows = power[power.stage == "system"]
    assert set(system_rows.quantity) == {"log ttft_s", "log tpot_s"}
    assert system_rows.effect.iloc[0] == pytest.approx(math.log1p(0.05))


def test_the_first_page_shows_the_recommendation_and_which_claims_are_decided():
    scenarios = {"small": {"limits": {"kv_bytes": {"max": 0.5, "relative": True}}, "prefer": {"max": "quality"}}}
    built = report(
        {
            "quality_scores": _scores(("query-aware", "context-only")),
            "system": system({"full": {}, "kivi2": {"kv_bytes_end": 0.2e6}}, prompts=6),
        },
        scenarios=scenarios,
    )
    page = rb.overview_page(built)
    tables_ = pd.read_html(__import__("io").StringIO(page))
    glance, claims = tables_[0], tables_[1]
    assert list(glance.protocol[:2]) == ["context-only", "context-only"]  # the cache-reuse case first
    assert set(glance.best) == {"kivi2"} and glance.best_interval.str.contains(r"\[").all()
    decided = int(built.claims.verdict.isin(["confirmed", "contradicted"]).sum())
    assert f"Claims: {decided} of {len(built.claims)} decided" in page and len(claims) == len(built.claims)
    assert "Holm-adjusted p-value" in page


def _errorbar_points(ax, axis: str = "y") -> int:
    """Points with an interval bar on `axis` (one segment each in the `interval-<axis>` collections)."""
    return sum(len(c.get_segments()) for c in ax.collections if c.get_gid() == f"interval-{axis}")


def test_the_frontier_marks_the_pareto_front_joins_sweeps_and_draws_every_interval(tmp_path, monkeypatch):
    import kvbench.report.figures as F

    drawn = {}
    monkeypatch.setattr(F, "save", lambda fig, png, svg: drawn.setdefault("fig", fig))
    scores = _scores(noise=0.05)
    fid = fidelity(
        {"kivi2": {"qa": 0.7, "summarization": 0.7}, "kivi4": {"qa": 0.9, "summarization": 0.9}}, samples=6
    ).assign(task=lambda f: f.category + "_task")
    built = report({"quality_scores": scores, "quality_fidelity": fid})
    methods = {**METHODS, "kivi2": {"kind": "kivi", "bits": 2}, "kivi4": {"kind": "kivi", "bits": 4}}
    F.frontier_figure(built.differences, methods, tmp_path / "f.png", tmp_path / "f.svg")
    axes = drawn["fig"].axes
    assert len(axes) == 3 * 3  # score, KL, top-1 x (qa, summarization, all)
    for ax in axes:
        assert _errorbar_points(ax, "x") == _errorbar_points(ax, "y") == 2  # kivi2 and kivi4, each with both
        lines = [ln for ln in ax.lines if ln.get_linestyle() == "-" and ln.get_color() == "#9aa5b1"]
        assert len(lines) == 1 and len(lines[0].get_xdata()) == 2  # kivi2 and kivi4: one sweep over bits
    # kivi2 compresses more but agrees less: both are on the frontier of the top-1 row
    assert F.pareto(np.array([6.0, 3.5]), np.array([0.7, 0.9]), higher=True).all()
    assert list(F.pareto(np.array([6.0, 3.5, 3.0]), np.array([0.9, 0.9, 0.8]), higher=True)) == [True, False, False]
    assert list(F.pareto(np.array([6.0, 3.5]), np.array([0.3, 0.1]), higher=False)) == [True, True]


def test_the_tradeoff_figure_draws_every_interval_and_names_methods_in_a_legend_only(tmp_path, monkeypatch):
    import kvbench.report.figures as F

    drawn = {}
    monkeypatch.setattr(F, "save", lambda fig, png, svg: drawn.setdefault("fig", fig))
    built = report(
        {
            "quality_scores": _scores(noise=0.05),
            "system": system({"full": {}, "kivi2": {"ttft_s": 1.2}, "kivi4": {}}, prompts=6, noise=0.05),
        }
    )
    F.tradeoff_figure(built.methods, "full", tmp_path / "t.png", tmp_path / "t.svg", METHODS)
    fig = drawn["fig"]
    quality_ax, ttft_ax = fig.axes[0], fig.axes[1]
    with_interval = built.methods[built.methods.quality_rel_low.notna() & built.methods.ratio.notna()]
    assert _errorbar_points(quality_ax) == len(with_interval) == 6  # 3 methods x 2 categories
    assert _errorbar_points(ttft_ax) == 3
    assert not any(ax.texts for ax in fig.axes)  # no text next to points: nothing to overlap
    labels = {t.get_text() for legend in fig.legends for t in legend.get_texts()}
    assert {"full", "kivi2", "kivi4"} <= labels


def test_a_pooled_cell_of_one_sample_categories_is_not_falsely_narrow():
    # the default run's shape: 7 categories of one sample each, method - reference from -0.34 to +1
    diffs = [-0.34, 0.05, -0.05, 0.5, 1.0, 0.02, 0.5]
    rows = []
    for i, d in enumerate(diffs):
        for method, score in (("full", 0.3), ("fp8", 0.3 + d)):
            rows.append(
                {
                    "model": "m",
                    "method": method,
                    "task": f"t{i}",
                    "category": f"c{i}",
                    "metric": "qa_f1",
                    "bucket": "0-4k",
                    "context_tokens": 1000,
                    "sample": 0,
                    "score": score,
                    "error": None,
                    "ttft_s": math.nan,
                    "tpot_s": math.nan,
                    "kv_bytes": math.nan,
                    "ratio": math.nan,
                }
            )
    diff = quality_differences(paired_quality(tables(quality_scores=pd.DataFrame(rows)), "full"), "full", 2000, 1, 0.95)
    pooled = _row(diff, category="all", bucket="all", quantity="score")
    # resampled within each one-sample category it would be [0.24, 0.24]; the samples vary by 0.46 (sd)
    assert pooled.n == 7 and pooled.ci_low < 0.0 and pooled.ci_high > 0.5


def test_large_categories_are_resampled_within_each():
    from kvbench.report.cells import STRATUM_MIN, quality_panel

    scores = quality(
        {"full": {"qa": 0.5, "summarization": 0.3}, "kivi2": {"qa": 0.4, "summarization": 0.3}}, samples=STRATUM_MIN
    )
    cell = next(quality_panel(paired_quality(tables(quality_scores=scores), "full"), 100, 1).cells(("all",)))
    qa = (cell.units.category == "qa").to_numpy()
    assert (cell.resample.counts[:, qa].sum(axis=1) == STRATUM_MIN).all()  # every draw: 20 qa samples
    small = quality({"full": {"qa": 0.5, "summarization": 0.3}}, samples=STRATUM_MIN - 1)
    cell = next(quality_panel(paired_quality(tables(quality_scores=small), "full"), 100, 1).cells(("all",)))
    qa = (cell.units.category == "qa").to_numpy()
    assert cell.resample.counts[:, qa].sum(axis=1).std() > 0  # resampled together


def test_pooled_cells_resample_documents_and_count_them_leaves_of_one_sample_per_document_do_not_change():
    # The qa and summarization samples s come from one document each (d0..d9), shared by both
    # categories: the pooled cell has 20 samples from 10 documents. Its n is 10 documents (samples
    # kept beside it); each leaf (one sample per document) is as without documents.
    scores = _scores(samples=10, noise=0.05)
    plain = quality_differences(paired_quality(tables(quality_scores=scores), "full"), "full", 400, 7, 0.95)
    scores["doc_ids"] = [f'["d{s}", "x{s}"]' for s in scores["sample"]]
    paired = paired_quality(tables(quality_scores=scores), "full")
    diff = quality_differences(paired, "full", 400, 7, 0.95)
    pooled = _row(diff, method="kivi2", category="all", bucket="all", quantity="score")
    assert (pooled.n, pooled.samples) == (10, 20)
    leaves = diff[diff.category != "all"].reset_index(drop=True)
    before = plain[plain.category != "all"].reset_index(drop=True)
    pd.testing.assert_frame_equal(leaves.drop(columns="samples"), before.drop(columns="samples"))
    # system prompts doc@length: two lengths of one document are one cluster in the pooled bucket
    runs = pd.concat(
        [system({"full": {}, "kivi2": {"ttft_s": 1.1}}, prompts=6, target=t, noise=0.05) for t in (1024, 6000)]
    )
    runs["doc_id"] = runs.prompt_id.str.split("@").str[0]
    units, source, in_process = system_units(tables(system=runs), "full")
    ratios = system_ratios(units, source, in_process, "full", 400, 7, 0.95)
    over = _row(ratios, method="kivi2", bucket="all", metric="ttft_s")
    assert (over.prompts, over.documents) == (12, 6)

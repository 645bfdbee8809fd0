"""Each seed claim on hand-built tables (tests/report_frames.py), once per verdict it can give."""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

import pandas as pd
import pytest

from kvbench.report import claims as C
from report_frames import (METHODS, corpus_stats, fidelity, kv_compressibility, kv_summary, quality, report, serve_offload,
                           system)

# The seed documents (not shipped in the repository): the seed numbers are checked where they exist.
SEEDS = Path(os.environ.get("KVBENCH_SEEDS", "/work/shared/seeds"))
QUALITY_OK = {"full": 0.5, "kivi2": 0.45, "kivi4": 0.49, "turboquant3": 0.44, "snapkv": 0.40, "cam": 0.42}


def verdict(frames, claim_id, **kw):
    claims = report(frames, **kw).claims
    rows = claims[claims.claim_id == claim_id]
    assert len(rows) == 1, rows
    return rows.iloc[0]


def test_every_claim_has_a_row_and_names_its_source_even_with_no_stage():
    claims = report({}).claims
    assert list(claims.claim_id) == list(C.CLAIMS)
    assert set(claims.verdict) == {C.NOT_RUN}
    assert claims.source.str.contains("results/").all() and claims.rule.str.len().gt(20).all()


@pytest.mark.parametrize("stats, expected", [
    (corpus_stats(), C.CONFIRMED),  # the seed's own figures
    (corpus_stats(realistic_tokens=1000, realistic_diversity={"medical": 5.0}), C.CONTRADICTED),  # 25x
    (corpus_stats(realistic_tokens=150, realistic_diversity={"medical": 80.0}), C.NOT_MEASURABLE),  # too short
])
def test_token_diversity(stats, expected):
    row = verdict({"corpus_stats": stats}, "token-diversity")
    assert row.verdict == expected
    assert "unique tokens" in row.ours and "results/corpus/stats.parquet" in row.source


def test_token_diversity_fold_is_at_equal_length():
    # 2 unique tokens of 10,000 vs 9.4 % of 10,000: 940 / 2 = 470x
    row = verdict({"corpus_stats": corpus_stats()}, "token-diversity")
    assert row.ours_value == pytest.approx(470)


@pytest.mark.parametrize("claim_id, dummy, synthetic, expected", [
    ("dummy-weights-inflate", 32.0, 1.0, C.CONFIRMED),
    ("dummy-weights-inflate", 1.5, 1.0, C.CONTRADICTED),
    ("repetitive-input-inflates", 32.0, 1.27, C.CONFIRMED),
    ("repetitive-input-inflates", 32.0, 1.05, C.CONTRADICTED),
])
def test_inflation_claims(claim_id, dummy, synthetic, expected):
    row = verdict({"kv_summary": kv_summary(dummy, synthetic)}, claim_id)
    assert row.verdict == expected
    assert row.ours_value == pytest.approx(dummy if claim_id.startswith("dummy") else synthetic)


def test_inflation_without_the_reports_dtype_is_not_measurable():
    assert verdict({"kv_summary": kv_summary(30, 2, dtype="fp16")}, "dummy-weights-inflate").verdict == C.NOT_MEASURABLE


CODECS = ["zstd-1", "zstd-3", "lz4", "zstd-3+byteplane"]


@pytest.mark.parametrize("synthetic, expected, tau", [
    ([1.1, 1.2, 1.01, 1.3], C.CONTRADICTED, 1.0),   # same order on both corpora
    ([3.0, 2.0, 4.0, 1.5], C.CONFIRMED, -1.0),      # reversed
])
def test_hi_ranks_wrong_from_the_kv_stage(synthetic, expected, tau):
    kv = kv_compressibility({"realistic": dict(zip(CODECS, [1.1, 1.2, 1.01, 1.3])),
                             "synthetic": dict(zip(CODECS, synthetic))})
    row = verdict({"kv_compressibility": kv}, "hi-ranks-wrong")
    assert row.verdict == expected and row.ours_value == pytest.approx(tau)
    assert "serve: not run" in row.ours


def test_hi_ranks_wrong_decides_on_ratios_and_only_shows_hit_ttft():
    kv = kv_compressibility({c: dict(zip(CODECS, [1.1, 1.2, 1.01, 1.3])) for c in ("realistic", "synthetic")})
    rows = []
    for codec, r, s in zip(CODECS, [1.1, 1.2, 1.01, 1.3], [1.3, 1.01, 1.2, 1.1]):
        rows += [("valkey", codec, "realistic", r, 1.0 + r), ("valkey", codec, "synthetic", s, 3.0 - r)]
    row = verdict({"kv_compressibility": kv, "serve_offload": serve_offload(rows)}, "hi-ranks-wrong")
    assert row.verdict == C.CONFIRMED and row.ours_value < C.RANKS_AGREE_TAU  # the wire ratios swap
    assert "hit TTFT (serve, not decisive): tau -1 over 4" in row.ours and "wire bytes" not in row.ours
    same = [(b, c, corpus, 1.0 + 0.1 * i, t) for b, c, corpus, _, t in rows for i in [CODECS.index(c)]]
    row = verdict({"kv_compressibility": kv, "serve_offload": serve_offload(same)}, "hi-ranks-wrong")
    assert row.verdict == C.CONTRADICTED  # TTFT order flips, ratios agree: the TTFT noise decides nothing


def test_hi_ranks_wrong_leaves_out_unsupported_serve_rows():
    rows = [("valkey", c, corpus, r, 1.0 + r) for c, r in zip(CODECS, [1.1, 1.2, 1.01, 1.3])
            for corpus in ("realistic", "synthetic")]
    flipped = serve_offload([("lmcache", "kivi", "realistic", 1.0, 9.0), ("lmcache", "kivi", "synthetic", 9.0, 0.1)],
                            status="unsupported: degraded mode on CPU")
    row = verdict({"serve_offload": pd.concat([serve_offload(rows), flipped])}, "hi-ranks-wrong")
    assert row.verdict == C.CONTRADICTED and "sized by the data, by wire ratio (serve): tau 1 over 4" in row.ours


def test_hi_ranks_wrong_with_two_codecs_is_not_measurable():
    kv = kv_compressibility({c: {"zstd-3": 1.2, "lz4": 1.0} for c in ("realistic", "synthetic")})
    assert verdict({"kv_compressibility": kv}, "hi-ranks-wrong").verdict == C.NOT_MEASURABLE


def _quality(means):
    return {"quality_scores": quality({m: {"single_doc_qa": v, "summarization": v} for m, v in means.items()})}


def test_kivi4_most_stable():
    assert verdict(_quality(QUALITY_OK), "kivi4-most-stable").verdict == C.CONFIRMED
    assert verdict(_quality({**QUALITY_OK, "snapkv": 0.5}), "kivi4-most-stable").verdict == C.CONTRADICTED


def test_kivi4_falls_back_to_fidelity_when_full_scores_zero():
    zero = {m: 0.0 for m in QUALITY_OK}
    frames = {**_quality(zero), "quality_fidelity": fidelity(
        {m: {"single_doc_qa": a, "summarization": a} for m, a in
         {"full": 1.0, "kivi2": 0.8, "kivi4": 0.97, "turboquant3": 0.85, "snapkv": 0.7, "cam": 0.72}.items()})}
    row = verdict(frames, "kivi4-most-stable")
    assert row.verdict == C.CONFIRMED and "top1_agreement" in row.ours
    assert verdict(_quality(zero), "kivi4-most-stable").verdict == C.NOT_MEASURABLE


def test_kivi4_claim_needs_the_quality_stage_and_a_kivi4_method():
    assert verdict({"system": system({"full": {}})}, "kivi4-most-stable").verdict == C.NOT_RUN
    methods = {k: v for k, v in METHODS.items() if k != "kivi4"}
    assert verdict(_quality(QUALITY_OK), "kivi4-most-stable", methods=methods).verdict == C.NOT_RUN


def _speeds(snapkv, kivi, target):
    return {"system": system({"full": {"decode_tok_s": 8}, "kivi4": {"decode_tok_s": kivi},
                              "snapkv": {"decode_tok_s": snapkv}, "cam": {"decode_tok_s": 9}}, target=target)}


@pytest.mark.parametrize("snapkv, kivi, target, expected", [
    (12, 7, 8192, C.CONFIRMED),
    (9.5, 11, 8192, C.CONTRADICTED),
    (12, 7, 1024, C.NOT_MEASURABLE),  # below the paper's long-context regime
])
def test_snapkv_long_context_throughput(snapkv, kivi, target, expected):
    row = verdict(_speeds(snapkv, kivi, target), "snapkv-long-context-throughput")
    assert row.verdict == expected and f"at {target} tokens" in row.ours


@pytest.mark.parametrize("tq, snapkv, expected", [
    (1.30, 1.02, C.CONFIRMED),
    (1.05, 1.40, C.CONTRADICTED),
    (1.03, 1.01, C.NOT_MEASURABLE),  # within the 5 % noise floor
])
def test_turboquant_ttft_overhead(tq, snapkv, expected):
    frames = {"system": system({"full": {"ttft_s": 1.0}, "kivi4": {"ttft_s": 1.0}, "turboquant3": {"ttft_s": tq},
                                "snapkv": {"ttft_s": snapkv}})}
    row = verdict(frames, "turboquant-ttft-overhead")
    assert row.verdict == expected
    assert row.ours_value == pytest.approx(tq - 1)


def test_turboquant_noise_comes_from_the_repeats_when_larger():
    values = {"full": {"ttft_s": 1.0, "ttft_s_std": 0.2}, "turboquant3": {"ttft_s": 1.12, "ttft_s_std": 0.2},
              "snapkv": {"ttft_s": 1.0, "ttft_s_std": 0.2}}
    assert verdict({"system": system(values)}, "turboquant-ttft-overhead").verdict == C.NOT_MEASURABLE


def test_cam_seed_number_is_a_quotation_not_a_figure():
    assert C.CLAIMS["cam-ratio-varies"].seed_number.startswith("not quantified")
    assert "14" not in C.CLAIMS["cam-ratio-varies"].seed_number  # the explainer gives no number for CaM


def _cam(ratios, control=None, targets=None):
    rows = system({"cam": {}, "snapkv": {}}, prompts=len(ratios))
    rows["ratio_end"] = [*ratios, *(control or [4.0] * len(ratios))]
    if targets:
        rows["target_context"] = targets * 2
    return {"system": rows}


UNFIXED = {"cam": {"kind": "cam", "merge_budget": 32}, "snapkv": {"kind": "snapkv", "keep_ratio": 0.25}}


def test_cam_ratio_varies_across_prompts_at_one_length_beside_a_fixed_budget_control():
    assert verdict(_cam([1.0, 3.0]), "cam-ratio-varies", methods=UNFIXED).verdict == C.CONFIRMED
    assert verdict(_cam([3.0, 3.2]), "cam-ratio-varies", methods=UNFIXED).verdict == C.CONTRADICTED
    # the control varies as much: the prompts, not CaM, make the spread
    assert verdict(_cam([1.0, 3.0], control=[1.0, 3.0]), "cam-ratio-varies", methods=UNFIXED).verdict == C.CONTRADICTED
    # a spread across context lengths is not a workload effect: only the longest length counts
    row = verdict(_cam([1.0, 3.0], targets=[512, 1024]), "cam-ratio-varies", methods=UNFIXED)
    assert row.verdict == C.CONTRADICTED and row.ours.startswith("at 1024 tokens")


@pytest.mark.parametrize("setting", [{"keep_ratio": 0.25}, {"capacity": 1024}, {"target": 1024}])
def test_cam_ratio_fixed_by_the_config_is_not_measurable(setting):
    methods = {**UNFIXED, "cam": {"kind": "cam", **setting}}
    row = verdict(_cam([1.0, 3.0]), "cam-ratio-varies", methods=methods)
    assert row.verdict == C.NOT_MEASURABLE and "kept size fixed by the config" in row.ours


def test_cam_ratio_without_stage_or_rows():
    assert verdict({}, "cam-ratio-varies").verdict == C.NOT_RUN
    failed = system({"cam": {}}, errors={"cam": 3})
    assert verdict({"system": failed}, "cam-ratio-varies").verdict == C.NOT_MEASURABLE


@pytest.mark.skipif(not SEEDS.is_dir(), reason="seed documents not present (set KVBENCH_SEEDS)")
def test_every_seed_number_quotes_the_seeds():
    seeds = {p.name.split("-")[0]: p.read_text() for p in SEEDS.glob("*.ja.txt")}
    quoted = {"token-diversity": ["0.02%", "14.2%", "9.4%", "数百倍"], "dummy-weights-inflate": ["非常に良好", "一変"],
              "dummy-weights-inflate-on-the-engine": ["Valkey をバックエンドとする KV キャッシュコネクター", "非常に良好", "一変"],
              "snapkv-long-context-throughput": ["SnapKVがチャンピオン"], "turboquant-ttft-overhead": ["長く待たせる"],
              "cam-ratio-varies": ["節約が全くできない"], "summarization-most-fragile": ["ゴミ"],
              "kivi4-most-stable": ["間違いをめったに犯しません"], "ratio-predicts-poorly": ["必ずしもパフォーマンスの向上"],
              "hi-ranks-wrong": ["誰も使わないワークロード"], "repetitive-input-inflates": ["実態以上によく見せて"]}
    assert set(quoted) == set(C.CLAIMS)
    for claim_id, phrases in quoted.items():
        text = seeds[C.CLAIMS[claim_id].seed]
        assert all(p in text for p in phrases), claim_id
        numbers = re.findall(r"\d+(?:\.\d+)?", C.CLAIMS[claim_id].seed_number.replace(",", ""))
        assert all(n in text.replace(",", "") for n in numbers), (claim_id, numbers)


def test_summarization_most_fragile():
    def frames(summ_loss, fewshot_loss):
        means = {m: {"single_doc_qa": 0.5 * (1 - (m != "full") * 0.05),
                     "summarization": 0.3 * (1 - (m != "full") * summ_loss),
                     "few_shot": 0.4 * (1 - (m != "full") * fewshot_loss)} for m in QUALITY_OK}
        return {"quality_scores": quality(means)}

    assert verdict(frames(0.4, 0.1), "summarization-most-fragile").verdict == C.CONFIRMED
    assert verdict(frames(0.1, 0.4), "summarization-most-fragile").verdict == C.CONTRADICTED
    only_qa = {"quality_scores": quality({m: {"single_doc_qa": 0.5} for m in QUALITY_OK})}
    assert verdict(only_qa, "summarization-most-fragile").verdict == C.NOT_MEASURABLE


def _corr(rho, low, high):
    return pd.DataFrame([{"model": "m", "category": c, "outcome": o, "rho": rho, "ci_low": low, "ci_high": high}
                         for c in ("qa", "summarization") for o in ("quality", "ttft_s", "tpot_s")])


@pytest.mark.parametrize("corr, expected", [
    (_corr(-0.95, -1.0, -0.8), C.CONTRADICTED),
    (_corr(-0.3, -0.9, 0.4), C.NOT_MEASURABLE),  # a wide interval cannot rule out |rho| 0.9: no evidence
    (_corr(-0.2, -0.5, 0.3), C.CONFIRMED),        # the interval excludes a strong rank correlation
    (_corr(math.nan, math.nan, math.nan), C.NOT_MEASURABLE),
    (_corr(-0.95, math.nan, math.nan), C.NOT_MEASURABLE),  # a rho without an interval decides nothing
    (_corr(0, 0, 0).iloc[:0], C.NOT_RUN),
])
def test_ratio_predicts_poorly(corr, expected):
    ev = C.Evidence(tables=None, methods={}, baseline="full", kv_dtype="bf16", kv_codec="zstd-3",
                    method_table=pd.DataFrame(), correlations=corr)
    (finding,) = C.CLAIMS["ratio-predicts-poorly"].check(ev)
    assert finding.verdict == expected


def test_model_claims_have_one_row_per_model():
    frames = {"system": pd.concat([system({"cam": {}}, model="a"), system({"cam": {}}, model="b")])}
    rows = report(frames).claims.query("claim_id == 'cam-ratio-varies'")
    assert list(rows.model) == ["a", "b"]


def test_ties_neither_confirm_nor_contradict():
    even = {m: 0.5 for m in QUALITY_OK}  # every method equals the baseline
    assert verdict(_quality(even), "kivi4-most-stable").verdict == C.NOT_MEASURABLE
    assert "tie:" in verdict(_quality(even), "kivi4-most-stable").ours
    tied = {"quality_scores": quality({m: {"qa": 0.5, "few_shot": 0.4, "summarization": 0.3} for m in QUALITY_OK})}
    assert verdict(tied, "summarization-most-fragile").verdict == C.NOT_MEASURABLE
    frames = _speeds(12, 12, 8192)  # kivi4 as fast as snapkv
    assert verdict(frames, "snapkv-long-context-throughput").verdict == C.NOT_MEASURABLE


def _engine(inflation, low, high, dtype="bfloat16", note=None):
    return pd.DataFrame([
        {"weights": "real", "corpus": "realistic", "codec": "zstd-3", "served_dtype": dtype, "dtype_note": note,
         "ratio": 1.3, "inflation": None, "inflation_ci_low": None, "inflation_ci_high": None, "inflation_n": 0,
         "realistic_n": 0},
        {"weights": "dummy", "corpus": "synthetic", "codec": "zstd-3", "served_dtype": dtype, "dtype_note": note,
         "ratio": 1.3 * inflation, "inflation": inflation, "inflation_ci_low": low, "inflation_ci_high": high,
         "inflation_n": 8, "realistic_n": 8},
    ])


@pytest.mark.parametrize("inflation, low, high, expected", [
    (30.0, 25.0, 35.0, C.CONFIRMED),      # far above 2x, the interval too
    (1.5, 1.3, 1.7, C.CONTRADICTED),      # an effect, but not "far better"
    (1.1, 0.9, 1.3, C.INCONCLUSIVE),      # the interval includes no effect
    (2.5, 1.8, 3.2, C.INCONCLUSIVE),      # the interval includes the threshold
])
def test_dummy_weights_inflate_on_the_engine_is_decided_by_its_interval(inflation, low, high, expected):
    row = verdict({"serve_engine": _engine(inflation, low, high)}, "dummy-weights-inflate-on-the-engine")
    assert row.verdict == expected and row.ours_value == pytest.approx(inflation)
    assert f"[{low:.3g}, {high:.3g}]" in row.ours and "n=8 and 8 store events" in row.ours


def test_dummy_weights_on_the_engine_names_a_float32_fallback_and_needs_both_cells():
    row = verdict({"serve_engine": _engine(30, 25, 35, "float32", "bfloat16 requested, but this CPU lacks AVX-512 BF16")},
                  "dummy-weights-inflate-on-the-engine")
    assert "served float32" in row.ours and "lacks AVX-512 BF16" in row.ours
    only_real = _engine(30, 25, 35).iloc[:1]
    assert verdict({"serve_engine": only_real}, "dummy-weights-inflate-on-the-engine").verdict == C.NOT_MEASURABLE
    assert verdict({}, "dummy-weights-inflate-on-the-engine").verdict == C.NOT_RUN


def test_hi_ranks_wrong_leaves_fixed_size_wire_formats_out():
    """kivi2 and fp8 have the same ratio on any input: counted, they would make any two rankings agree."""
    rows = [("valkey", "zstd-3", "realistic", 1.1, 1), ("valkey", "zstd-3", "synthetic", 1.3, 1),
            ("valkey", "lz4", "realistic", 1.2, 1), ("valkey", "lz4", "synthetic", 1.0, 1),
            ("valkey", "zstd-3+byteplane", "realistic", 1.3, 1), ("valkey", "zstd-3+byteplane", "synthetic", 1.1, 1)]
    rows += [("valkey", c, corpus, r, 1) for c, r in (("kivi2", 5.3), ("fp8", 2.0), ("none", 1.0))
             for corpus in ("realistic", "synthetic")]
    row = verdict({"serve_offload": serve_offload(rows)}, "hi-ranks-wrong")
    assert "sized by the data, by wire ratio (serve): tau -0.333 over 3" in row.ours and row.verdict == C.CONFIRMED

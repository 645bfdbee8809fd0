"""Each seed claim on hand-built tables (tests/report_frames.py), once per verdict it can give."""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from report_frames import (
    METHODS,
    corpus_stats,
    fidelity,
    kv_compressibility,
    kv_summary,
    quality,
    report,
    serve_offload,
    system,
)

from kvbench.report import claims as C

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


def test_a_decided_claim_states_its_test_and_no_verdict_holds_the_null():
    claims = report(
        {
            "corpus_stats": corpus_stats(),
            "quality_scores": quality(
                {m: {"single_doc_qa": v, "summarization": v} for m, v in QUALITY_OK.items()}, samples=6
            ),
        }
    ).claims
    tested = claims[claims.p_value.notna()]
    assert len(tested) >= 2 and (tested.family == len(tested)).all()
    assert tested.compared.str.len().gt(5).all() and tested.statistic.str.len().gt(5).all()
    assert (tested.n >= 5).all() and tested.mde.notna().all() and tested.p_holm.ge(tested.p_value).all()
    decided = claims[claims.verdict.isin([C.CONFIRMED, C.CONTRADICTED])]
    assert len(decided) and (decided.p_holm < 0.05).all()
    holds_null = (decided.ci_low <= decided["null"]) & (decided["null"] <= decided.ci_high)
    assert not holds_null.any(), decided


@pytest.mark.parametrize(
    "stats, expected",
    [
        (corpus_stats(), C.CONFIRMED),  # the seed's own figures
        (corpus_stats(realistic_tokens=1000, realistic_diversity={"medical": 5.0}), C.CONTRADICTED),  # 25x
        (corpus_stats(realistic_tokens=150, realistic_diversity={"medical": 80.0}), C.NOT_MEASURABLE),  # too short
        (corpus_stats(docs=4), C.INCONCLUSIVE),  # 4 documents per domain: too few for an interval
    ],
)
def test_token_diversity(stats, expected):
    row = verdict({"corpus_stats": stats}, "token-diversity")
    assert row.verdict == expected
    assert "unique tokens" in row.ours and "results/corpus/stats.parquet" in row.source


def test_token_diversity_fold_is_at_equal_length():
    # 2 unique tokens of 10,000 vs 9.4 % of 10,000: 940 / 2 = 470x
    row = verdict({"corpus_stats": corpus_stats()}, "token-diversity")
    assert row.ours_value == pytest.approx(470) and row["null"] == C.DIVERSITY_FOLD and row.unit == "documents"


def _kv(dummy: float, synthetic: float, docs: int = 5, jitter: float = 0.0) -> pd.DataFrame:
    """Per-document KV rows: realistic with real and dummy weights, synthetic with real weights (the
    dummy and synthetic documents' ratios spread by `jitter`, the real ones the other way)."""
    return pd.concat(
        [
            kv_compressibility({"realistic": {"zstd-3": 1.3}}, docs=docs, jitter=-jitter),
            kv_compressibility({"realistic": {"zstd-3": 1.3 * dummy}}, docs=docs, weights="dummy", jitter=jitter),
            kv_compressibility({"synthetic": {"zstd-3": 1.3 * synthetic}}, docs=docs, jitter=jitter),
        ]
    )


@pytest.mark.parametrize(
    "claim_id, dummy, synthetic, expected",
    [
        ("dummy-weights-inflate", 32.0, 1.0, C.CONFIRMED),
        ("dummy-weights-inflate", 1.5, 1.0, C.CONTRADICTED),
        ("repetitive-input-inflates", 32.0, 1.27, C.CONFIRMED),
        ("repetitive-input-inflates", 32.0, 1.05, C.CONTRADICTED),
    ],
)
def test_inflation_claims(claim_id, dummy, synthetic, expected):
    row = verdict({"kv_compressibility": _kv(dummy, synthetic)}, claim_id)
    assert row.verdict == expected
    assert row.ours_value == pytest.approx(dummy if claim_id.startswith("dummy") else synthetic)
    assert row.n == 5 and row.unit == "documents"  # paired documents (dummy), or the smaller corpus


def test_inflation_near_its_threshold_with_spread_documents_is_inconclusive():
    # dummy / real 2.1x against a 2x threshold, documents 10 % apart each way: the interval holds 2
    row = verdict({"kv_compressibility": _kv(2.1, 1.0, docs=6, jitter=0.1)}, "dummy-weights-inflate")
    assert row.verdict == C.INCONCLUSIVE and row.ci_low < C.WEIGHTS_INFLATION < row.ci_high
    assert "inconclusive at n = 6 documents" in row.ours


def test_inflation_from_the_summary_alone_has_no_interval():
    row = verdict({"kv_summary": kv_summary(30, 2)}, "dummy-weights-inflate")
    assert row.verdict == C.INCONCLUSIVE and "no per-document table" in row.ours and row.ours_value == 30
    assert verdict({"kv_summary": kv_summary(30, 2, dtype="fp16")}, "dummy-weights-inflate").verdict == C.NOT_MEASURABLE


CODECS = ["zstd-1", "zstd-3", "lz4", "zstd-3+byteplane"]


@pytest.mark.parametrize(
    "synthetic, expected, tau",
    [
        ([1.1, 1.2, 1.01, 1.3], C.CONTRADICTED, 1.0),  # same order on both corpora
        ([3.0, 2.0, 4.0, 1.5], C.CONFIRMED, -1.0),  # reversed
    ],
)
def test_hi_ranks_wrong_from_the_kv_stage(synthetic, expected, tau):
    kv = kv_compressibility(
        {"realistic": dict(zip(CODECS, [1.1, 1.2, 1.01, 1.3])), "synthetic": dict(zip(CODECS, synthetic))}
    )
    row = verdict({"kv_compressibility": kv}, "hi-ranks-wrong")
    assert row.verdict == expected and row.ours_value == pytest.approx(tau) and row.n == 5  # per corpus
    assert "serve: not run" in row.ours


def test_hi_ranks_wrong_decides_on_the_kv_stage_and_shows_the_serve_taus():
    kv = kv_compressibility({c: dict(zip(CODECS, [1.1, 1.2, 1.01, 1.3])) for c in ("realistic", "synthetic")})
    rows = []
    for codec, r, s in zip(CODECS, [1.1, 1.2, 1.01, 1.3], [1.3, 1.01, 1.2, 1.1]):
        rows += [("valkey", codec, "realistic", r, 1.0 + r), ("valkey", codec, "synthetic", s, 3.0 - r)]
    row = verdict({"kv_compressibility": kv, "serve_offload": serve_offload(rows)}, "hi-ranks-wrong")
    # the serve stage's wire ratios swap, but one aggregated row per configuration has nothing to resample
    assert row.verdict == C.CONTRADICTED and "sized by the data, by wire ratio (serve): tau -0.333 over 4" in row.ours
    assert "hit TTFT (serve): tau -1 over 4" in row.ours
    unsupported = serve_offload(
        [("lmcache", "kivi", "realistic", 1.0, 9.0), ("lmcache", "kivi", "synthetic", 9.0, 0.1)],
        status="unsupported: degraded mode on CPU",
    )
    row = verdict({"serve_offload": pd.concat([serve_offload(rows), unsupported])}, "hi-ranks-wrong")
    assert row.verdict == C.NOT_MEASURABLE and "over 4" in row.ours  # unsupported rows left out; no kv stage


def test_hi_ranks_wrong_with_two_codecs_is_not_measurable():
    kv = kv_compressibility({c: {"zstd-3": 1.2, "lz4": 1.0} for c in ("realistic", "synthetic")})
    assert verdict({"kv_compressibility": kv}, "hi-ranks-wrong").verdict == C.NOT_MEASURABLE


def _quality(means, samples=6, spread=0.02):
    return {
        "quality_scores": quality(
            {m: {"single_doc_qa": v, "summarization": v} for m, v in means.items()}, samples=samples, spread=spread
        )
    }


def test_kivi4_most_stable():
    row = verdict(_quality(QUALITY_OK), "kivi4-most-stable")
    assert row.verdict == C.CONFIRMED and row.protocol == "query-aware" and row.unit == "samples"
    assert row.ci_low > 0  # kivi4's worst category minus the closest rival's (turboquant3's): 0.98 - 0.9
    assert verdict(_quality({**QUALITY_OK, "snapkv": 0.5}), "kivi4-most-stable").verdict == C.CONTRADICTED


def test_a_quality_claim_resamples_documents_and_counts_them():
    # 6 documents, each serving one sample of both categories: the claim's cell (every category)
    # holds 12 samples from 6 documents and resamples documents; its n (the smallest category's)
    # counts them.
    frames = _quality(QUALITY_OK)
    frames["quality_scores"]["doc_ids"] = [f'["d{s}"]' for s in frames["quality_scores"]["sample"]]
    row = verdict(frames, "kivi4-most-stable")
    assert (row.n, row.unit, row.n_units) == (6, "documents", 6)


def test_kivi4_within_noise_of_a_rival_is_inconclusive():
    noisy = quality(
        {m: {"single_doc_qa": v, "summarization": v} for m, v in {**QUALITY_OK, "kivi2": 0.485}.items()}, samples=6
    )
    rng = np.random.default_rng(0)
    noisy["score"] = (noisy.score + rng.normal(0, 0.1, len(noisy))).clip(0, 1)
    row = verdict({"quality_scores": noisy}, "kivi4-most-stable")
    assert row.verdict == C.INCONCLUSIVE and row.ci_low < 0 < row.ci_high and row.mde > 0


def test_kivi4_falls_back_to_fidelity_when_full_scores_zero():
    zero = {m: 0.0 for m in QUALITY_OK}
    frames = {
        **_quality(zero, spread=0.0),
        "quality_fidelity": fidelity(
            {
                m: {"single_doc_qa": a, "summarization": a}
                for m, a in {"kivi2": 0.8, "kivi4": 0.97, "turboquant3": 0.85, "snapkv": 0.7, "cam": 0.72}.items()
            },
            samples=6,
        ),
    }
    row = verdict(frames, "kivi4-most-stable")
    assert row.verdict == C.CONFIRMED and "top1_agreement" in row.ours
    assert verdict(_quality(zero, spread=0.0), "kivi4-most-stable").verdict == C.NOT_MEASURABLE


def test_kivi4_claim_needs_the_quality_stage_and_a_kivi4_method():
    assert verdict({"system": system({"full": {}})}, "kivi4-most-stable").verdict == C.NOT_RUN
    methods = {k: v for k, v in METHODS.items() if k != "kivi4"}
    assert verdict(_quality(QUALITY_OK), "kivi4-most-stable", methods=methods).verdict == C.NOT_RUN


def test_quality_claims_are_checked_per_protocol():
    qa = quality({m: {"single_doc_qa": v, "summarization": v} for m, v in QUALITY_OK.items()}, samples=6)
    co = quality(
        {m: {"single_doc_qa": v, "summarization": v} for m, v in {**QUALITY_OK, "snapkv": 0.5}.items()}, samples=6
    )
    frames = {"quality_scores": pd.concat([qa.assign(protocol="query-aware"), co.assign(protocol="context-only")])}
    rows = report(frames).claims.query("claim_id == 'kivi4-most-stable'").set_index("protocol").verdict
    assert rows.to_dict() == {"context-only": C.CONTRADICTED, "query-aware": C.CONFIRMED}


def _speeds(snapkv, kivi, target, noise=0.0):
    return {
        "system": system(
            {
                "full": {"decode_tok_s": 8},
                "kivi4": {"decode_tok_s": kivi},
                "snapkv": {"decode_tok_s": snapkv},
                "cam": {"decode_tok_s": 9},
            },
            target=target,
            prompts=6,
            noise=noise,
        )
    }


@pytest.mark.parametrize(
    "snapkv, kivi, target, noise, expected",
    [
        (12, 7, 8192, 0.0, C.CONFIRMED),
        (9.5, 11, 8192, 0.0, C.CONTRADICTED),
        (12, 7, 1024, 0.0, C.NOT_MEASURABLE),  # below the paper's long-context regime
        (9.2, 9.0, 8192, 0.1, C.INCONCLUSIVE),  # 2 % apart, 10 % noise per run
    ],
)
def test_snapkv_long_context_throughput(snapkv, kivi, target, noise, expected):
    row = verdict(_speeds(snapkv, kivi, target, noise), "snapkv-long-context-throughput")
    assert row.verdict == expected and f"at {target} tokens" in row.ours


@pytest.mark.parametrize(
    "tq, snapkv, expected",
    [
        (1.30, 1.02, C.CONFIRMED),
        (1.05, 1.40, C.CONTRADICTED),
        (1.03, 1.01, C.INCONCLUSIVE),  # 2 % apart, 10 % noise per run
    ],
)
def test_turboquant_ttft_overhead(tq, snapkv, expected):
    frames = {
        "system": system(
            {
                "full": {"ttft_s": 1.0},
                "kivi4": {"ttft_s": 1.0},
                "turboquant3": {"ttft_s": tq},
                "snapkv": {"ttft_s": snapkv},
            },
            prompts=8,
            noise=0.1,
        )
    }
    row = verdict(frames, "turboquant-ttft-overhead")
    assert row.verdict == expected and row.unit == "prompts"
    assert row.ours_value == pytest.approx(tq - 1, abs=0.12)  # 8 prompts, 10 % noise per run


def _runs(overheads: dict[str, float], drift: float, prompts: int = 6, repeats: int = 3) -> pd.DataFrame:
    """Interleaved runs: every round (prompt x repeat) has one drift factor shared by all methods."""
    rng = np.random.default_rng(1)
    rows = []
    for p in range(prompts):
        for r in range(repeats):
            shared = rng.lognormal(0, drift)
            rows += [
                {
                    "model": "m",
                    "method": m,
                    "prompt_id": f"doc{p}@1024",
                    "corpus": "realistic",
                    "repeat": r,
                    "ttft_s": 1.0 * o * shared * rng.lognormal(0, 0.01),
                    "tpot_s": 0.1,
                    "decode_tok_s": 10.0,
                    "kv_bytes_end": 1e6,
                    "ratio_end": 1.0,
                    "error": None,
                    "bucket": "0-4k",
                    "target_context": 1024,
                }
                for m, o in overheads.items()
            ]
    return pd.DataFrame(rows)


def test_ttft_pairs_runs_of_one_round_so_drift_cancels():
    overheads = {"full": 1.0, "kivi4": 1.0, "turboquant3": 1.06, "snapkv": 1.0}
    row = verdict({"system_runs": _runs(overheads, drift=0.4)}, "turboquant-ttft-overhead")
    # a drift of 40 % between rounds, a 6 % overhead: decided, because each run divides by its round's baseline
    assert row.verdict == C.CONFIRMED and "results/system/runs.parquet" in row.source
    assert row.estimate == pytest.approx(math.log(1.06), abs=0.01)


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
SPREAD = [1.0, 3.0] * 5


def test_cam_ratio_varies_across_prompts_at_one_length_beside_a_fixed_budget_control():
    assert verdict(_cam(SPREAD), "cam-ratio-varies", methods=UNFIXED).verdict == C.CONFIRMED
    assert verdict(_cam([3.0, 3.05] * 5), "cam-ratio-varies", methods=UNFIXED).verdict == C.CONTRADICTED
    # the control varies as much: the prompts, not CaM, make the spread
    assert verdict(_cam(SPREAD, control=SPREAD), "cam-ratio-varies", methods=UNFIXED).verdict == C.CONTRADICTED
    # a spread across context lengths is not a workload effect: only the longest length counts
    row = verdict(_cam(SPREAD, targets=[512] * 5 + [1024] * 5), "cam-ratio-varies", methods=UNFIXED)
    assert row.verdict == C.INCONCLUSIVE and row.ours.startswith("at 1024 tokens")  # 5 prompts: 1.0 or 3.0 alone


@pytest.mark.parametrize("setting", [{"keep_ratio": 0.25}, {"capacity": 1024}, {"target": 1024}])
def test_cam_ratio_fixed_by_the_config_is_not_measurable(setting):
    methods = {**UNFIXED, "cam": {"kind": "cam", **setting}}
    row = verdict(_cam(SPREAD), "cam-ratio-varies", methods=methods)
    assert row.verdict == C.NOT_MEASURABLE and "kept size fixed by the config" in row.ours


def test_cam_ratio_without_stage_or_rows():
    assert verdict({}, "cam-ratio-varies").verdict == C.NOT_RUN
    failed = system({"cam": {}}, errors={"cam": 3})
    assert verdict({"system": failed}, "cam-ratio-varies").verdict == C.NOT_MEASURABLE


@pytest.mark.skipif(not SEEDS.is_dir(), reason="seed documents not present (set KVBENCH_SEEDS)")
def test_every_seed_number_quotes_the_seeds():
    seeds = {p.name.split("-")[0]: p.read_text() for p in SEEDS.glob("*.ja.txt")}
    quoted = {
        "token-diversity": ["0.02%", "14.2%", "9.4%", "数百倍"],
        "dummy-weights-inflate": ["非常に良好", "一変"],
        "dummy-weights-inflate-on-the-engine": [
            "Valkey をバックエンドとする KV キャッシュコネクター",
            "非常に良好",
            "一変",
        ],
        "snapkv-long-context-throughput": ["SnapKVがチャンピオン"],
        "turboquant-ttft-overhead": ["長く待たせる"],
        "cam-ratio-varies": ["節約が全くできない"],
        "summarization-most-fragile": ["ゴミ"],
        "kivi4-most-stable": ["間違いをめったに犯しません"],
        "ratio-predicts-poorly": ["必ずしもパフォーマンスの向上"],
        "hi-ranks-wrong": ["誰も使わないワークロード"],
        "repetitive-input-inflates": ["実態以上によく見せて"],
    }
    assert set(quoted) == set(C.CLAIMS)
    for claim_id, phrases in quoted.items():
        text = seeds[C.CLAIMS[claim_id].seed]
        assert all(p in text for p in phrases), claim_id
        numbers = re.findall(r"\d+(?:\.\d+)?", C.CLAIMS[claim_id].seed_number.replace(",", ""))
        assert all(n in text.replace(",", "") for n in numbers), (claim_id, numbers)


def _fragility(summ_loss, fewshot_loss, spread=0.02, noise=0.0):
    means = {
        m: {
            "single_doc_qa": 0.5 * (1 - (m != "full") * 0.05),
            "summarization": 0.3 * (1 - (m != "full") * summ_loss),
            "few_shot": 0.4 * (1 - (m != "full") * fewshot_loss),
        }
        for m in QUALITY_OK
    }
    scores = quality(means, samples=6, spread=spread)
    if noise:
        scores["score"] = (scores.score + np.random.default_rng(2).normal(0, noise, len(scores))).clip(0, 1)
    return {"quality_scores": scores}


def test_summarization_most_fragile():
    row = verdict(_fragility(0.4, 0.1), "summarization-most-fragile")
    assert row.verdict == C.CONFIRMED and row.ci_high < 0  # summarization minus the next most fragile
    assert verdict(_fragility(0.1, 0.4), "summarization-most-fragile").verdict == C.CONTRADICTED
    only_qa = {"quality_scores": quality({m: {"single_doc_qa": 0.5} for m in QUALITY_OK}, samples=6)}
    assert verdict(only_qa, "summarization-most-fragile").verdict == C.NOT_MEASURABLE


def test_summarization_on_one_sample_per_category_decides_nothing():
    # the case: one sample per category cannot compare categories
    row = verdict(
        {
            "quality_scores": quality(
                {m: {"single_doc_qa": 0.5, "summarization": 0.3 if m == "full" else 0.1} for m in QUALITY_OK}, samples=1
            )
        },
        "summarization-most-fragile",
    )
    assert row.verdict == C.INCONCLUSIVE and row.n == 1 and "no interval" in row.ours
    row = verdict(_fragility(0.2, 0.15, noise=0.15), "summarization-most-fragile")
    assert row.verdict == C.INCONCLUSIVE and not row.p_holm < 0.05


def _ratio_quality(score_of, samples=8, noise=0.01):
    """Six methods, their measured ratio 1-6 per sample; score per method and sample."""
    rng = np.random.default_rng(4)
    methods = ["full", "kivi2", "kivi4", "turboquant3", "snapkv", "cam"]
    rows = []
    for i, m in enumerate(methods):
        for s in range(samples):
            rows.append(
                {
                    "model": "m",
                    "method": m,
                    "task": "qa_task",
                    "category": "qa",
                    "metric": "qa_f1",
                    "bucket": "0-4k",
                    "context_tokens": 1000,
                    "sample": s,
                    "error": None,
                    "ttft_s": math.nan,
                    "tpot_s": math.nan,
                    "kv_bytes": math.nan,
                    "ratio": 1.0 + i,
                    "score": float(np.clip(score_of(i, s) + rng.normal(0, noise), 0, 1)),
                }
            )
    return {"quality_scores": pd.DataFrame(rows)}


@pytest.mark.parametrize(
    "name, score_of, expected",
    [
        ("more compression, less quality", lambda i, s: 0.8 - 0.1 * i, C.CONTRADICTED),  # the ratio orders it
        ("methods differ, unordered by ratio", lambda i, s: [0.5, 0.2, 0.7, 0.3, 0.8, 0.4][i], C.CONFIRMED),
        ("noise: no method differs", lambda i, s: 0.3 + 0.4 * ((s * 7919) % 5) / 5, C.INCONCLUSIVE),
    ],
)
def test_ratio_predicts_poorly(name, score_of, expected):
    row = verdict(_ratio_quality(score_of, noise=0.01 if expected != C.INCONCLUSIVE else 0.1), "ratio-predicts-poorly")
    assert row.verdict == expected, (name, row.ours)
    assert "methods differ p" in row.ours and row.unit == "samples"


def test_ratio_predicts_poorly_is_not_confirmed_by_noise_with_a_rank_correlation_near_zero():
    # the case: rho near 0 from scores that are noise. "Poorly" needs methods that differ
    row = verdict(_ratio_quality(lambda i, s: 0.5, samples=30, noise=0.2), "ratio-predicts-poorly")
    assert row.verdict == C.INCONCLUSIVE and "methods differ p" in row.ours


def test_ratio_predicts_poorly_needs_three_methods_with_a_ratio():
    two = {"quality_scores": quality({"full": {"qa": 0.5}, "kivi2": {"qa": 0.4}}, samples=6)}
    assert verdict(two, "ratio-predicts-poorly").verdict == C.NOT_MEASURABLE
    assert verdict({}, "ratio-predicts-poorly").verdict == C.NOT_RUN


def test_model_claims_have_one_row_per_model():
    frames = {"system": pd.concat([system({"cam": {}}, model="a"), system({"cam": {}}, model="b")])}
    rows = report(frames).claims.query("claim_id == 'cam-ratio-varies'")
    assert list(rows.model) == ["a", "b"]


def test_ties_neither_confirm_nor_contradict():
    even = {m: 0.5 for m in QUALITY_OK}  # every method equals the baseline
    assert verdict(_quality(even), "kivi4-most-stable").verdict == C.INCONCLUSIVE
    tied = {
        "quality_scores": quality(
            {m: {"qa": 0.5, "few_shot": 0.4, "summarization": 0.3} for m in QUALITY_OK}, samples=6
        )
    }
    assert verdict(tied, "summarization-most-fragile").verdict == C.INCONCLUSIVE
    assert verdict(_speeds(12, 12, 8192), "snapkv-long-context-throughput").verdict == C.INCONCLUSIVE


def test_holm_over_the_family_can_leave_a_claim_that_alone_would_pass_inconclusive():
    from kvbench.report.bootstrap import Interval
    from kvbench.report.decide import Test, verdicts

    def test(p):
        return Test("a", "b", Interval(1.0, 0.5, 1.5, 20, 0.2, p, 0.95), p, 1, True, "samples", 0.1)

    found, adjusted = verdicts([test(0.03), test(0.001), None, test(0.2)], 0.95)
    assert found == [C.INCONCLUSIVE, C.CONFIRMED, None, C.INCONCLUSIVE]  # 0.03 * 2 = 0.06 after the first step
    assert np.allclose(adjusted[[0, 1, 3]], [0.06, 0.003, 0.2])


def test_an_outcome_every_method_shares_has_no_ranking_to_test():
    frames = {
        "system": system({m: {"ratio_end": r} for m, r in (("full", 1.0), ("kivi2", 4.0), ("kivi4", 2.5))}, prompts=6)
    }  # TPOT 0.1 for every method
    rows = report(frames).claims.query("claim_id == 'ratio-predicts-poorly'")
    tpot = rows[rows.ours.str.startswith("TPOT")].iloc[0]
    assert tpot.verdict == C.NOT_MEASURABLE and "no ranking" in tpot.ours


def _engine(inflation, spread, dtype="bfloat16", note=None, n=20, draws=True):
    """The serve stage's engine table: the realistic cell, and the benchmark cell with its
    inflation and bootstrap draws (normal around `inflation`, SD `spread`)."""
    rng = np.random.default_rng(0)
    return pd.DataFrame(
        [
            {
                "weights": "real",
                "corpus": "realistic",
                "codec": "zstd-3",
                "served_dtype": dtype,
                "dtype_note": note,
                "ratio": 1.3,
                "inflation": None,
                "inflation_ci_low": None,
                "inflation_ci_high": None,
                "inflation_n": 0,
                "realistic_n": 0,
                "inflation_draws": None,
            },
            {
                "weights": "dummy",
                "corpus": "synthetic",
                "codec": "zstd-3",
                "served_dtype": dtype,
                "dtype_note": note,
                "ratio": 1.3 * inflation,
                "inflation": inflation,
                "inflation_ci_low": inflation - 2 * spread,
                "inflation_ci_high": inflation + 2 * spread,
                "inflation_n": n,
                "realistic_n": n,
                "inflation_draws": list(rng.normal(inflation, spread, 1000)) if draws else None,
            },
        ]
    )


@pytest.mark.parametrize(
    "inflation, spread, expected",
    [
        (30.0, 2.0, C.CONFIRMED),  # far above 2x, the interval too
        (1.5, 0.1, C.CONTRADICTED),  # an effect, but not "far better"
        (1.1, 0.1, C.CONTRADICTED),  # no effect at all: below 2x
        (2.5, 0.4, C.INCONCLUSIVE),  # the interval includes the threshold
    ],
)
def test_dummy_weights_inflate_on_the_engine_is_decided_by_its_test(inflation, spread, expected):
    row = verdict({"serve_engine": _engine(inflation, spread)}, "dummy-weights-inflate-on-the-engine")
    assert row.verdict == expected and row.ours_value == pytest.approx(inflation)
    assert row.p_value == row.p_value and row.null == C.WEIGHTS_INFLATION and row.unit == "documents"
    assert "over 20 and 20 documents" in row.ours and row.n == 20


def test_dummy_weights_on_the_engine_names_a_float32_fallback_and_needs_both_cells():
    row = verdict(
        {"serve_engine": _engine(30, 2, "float32", "bfloat16 requested, but this CPU lacks AVX-512 BF16")},
        "dummy-weights-inflate-on-the-engine",
    )
    assert "served float32" in row.ours and "lacks AVX-512 BF16" in row.ours
    only_real = _engine(30, 2).iloc[:1]
    assert verdict({"serve_engine": only_real}, "dummy-weights-inflate-on-the-engine").verdict == C.NOT_MEASURABLE
    assert verdict({}, "dummy-weights-inflate-on-the-engine").verdict == C.NOT_RUN
    few = verdict({"serve_engine": _engine(30, 2, n=3)}, "dummy-weights-inflate-on-the-engine")
    assert few.verdict == C.INCONCLUSIVE  # too few documents for an interval
    no_draws = verdict({"serve_engine": _engine(30, 2, draws=False)}, "dummy-weights-inflate-on-the-engine")
    assert no_draws.verdict == C.INCONCLUSIVE and "no interval" in no_draws.ours


def test_hi_ranks_wrong_leaves_fixed_size_wire_formats_out():
    """kivi2 and fp8 have the same ratio on any input: counted, they would make any two rankings agree."""
    rows = [
        ("valkey", "zstd-3", "realistic", 1.1, 1),
        ("valkey", "zstd-3", "synthetic", 1.3, 1),
        ("valkey", "lz4", "realistic", 1.2, 1),
        ("valkey", "lz4", "synthetic", 1.0, 1),
        ("valkey", "zstd-3+byteplane", "realistic", 1.3, 1),
        ("valkey", "zstd-3+byteplane", "synthetic", 1.1, 1),
    ]
    rows += [
        ("valkey", c, corpus, r, 1)
        for c, r in (("kivi2", 5.3), ("fp8", 2.0), ("none", 1.0))
        for corpus in ("realistic", "synthetic")
    ]
    row = verdict({"serve_offload": serve_offload(rows)}, "hi-ranks-wrong")
    # shown, not decisive (no kv stage: nothing to resample)
    assert "sized by the data, by wire ratio (serve): tau -0.333 over 3" in row.ours and row.verdict == C.NOT_MEASURABLE

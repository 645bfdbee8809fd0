"""The report's statistics on simulated data with known answers: interval coverage over many
seeds, unbiasedness, p-values that agree with the intervals, Holm's adjustment, the power
formulas, and that claims on pure noise come out inconclusive (SIMULATED data, not measurements)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from report_frames import tables
from scipy import stats

from kvbench.report import claims as C
from kvbench.report.bootstrap import (
    MIN_UNITS,
    Estimate,
    Resample,
    equal_means_test,
    expanded_alpha,
    holm,
    interval,
    resample_counts,
    rng_for,
)
from kvbench.report.power import mde, n_needed, power_table, spread
from kvbench.report.samples import paired_quality, system_units
from kvbench.report.stats import kendall_tau_rows

SIMS = 400


def _coverage(draw, true: float, n: int, weights=None, sims: int = SIMS) -> tuple[float, float, float]:
    """(coverage of the 95 % interval, mean estimate, its standard error) over `sims` data sets."""
    hits, estimates = 0, []
    for s in range(sims):
        rng = np.random.default_rng(10_000 + s)
        x = draw(rng, n)
        est = Resample.of([n], 1000, rng_for(s, "coverage")).mean(x, weights(rng, n) if weights else None)
        iv = est.interval(0.95)
        hits += iv.low <= true <= iv.high
        estimates.append(est.estimate)
    return hits / sims, float(np.mean(estimates)), float(np.std(estimates) / math.sqrt(sims))


@pytest.mark.parametrize(
    "name, draw, true, n, low",
    [
        # 1000 data sets (coverage +-0.008): the plain percentile interval covers 0.87 on the first, the
        # expanded one 0.926; on the skewed second 0.917
        ("normal, n = 8", lambda r, n: r.normal(1.0, 1.0, n), 1.0, 8, 0.91),
        ("exponential, n = 20", lambda r, n: r.exponential(1.0, n), 1.0, 20, 0.90),
    ],
)
def test_intervals_cover_the_true_mean_at_their_level(name, draw, true, n, low):
    coverage, mean, se = _coverage(draw, true, n, sims=1000)
    assert low <= coverage <= 0.985, (name, coverage)
    assert abs(mean - true) < 3 * se, (name, mean)  # the estimate is the sample mean: unbiased


def test_the_position_weighted_mean_covers_and_is_unbiased():
    # KL per sample (gamma, mean 0.3) pooled over each sample's teacher-forced positions (5-59)
    coverage, mean, se = _coverage(
        lambda r, n: r.gamma(2.0, 0.15, n), 0.3, 30, weights=lambda r, n: r.integers(5, 60, n).astype(float)
    )
    assert 0.92 <= coverage <= 0.98 and abs(mean - 0.3) < 3 * se


def test_a_null_difference_is_decided_in_at_most_alpha_of_simulations():
    decided = 0
    for s in range(SIMS):
        rng = np.random.default_rng(s)
        method, reference = rng.normal(0.5, 0.2, 20), rng.normal(0.5, 0.2, 20)
        r = Resample.of([20], 1000, rng_for(s, "null"))
        iv = (r.mean(method) - r.mean(reference)).interval(0.95)
        decided += iv.direction != 0
    assert decided / SIMS <= 0.05 + 2 * math.sqrt(0.05 * 0.95 / SIMS)


def test_p_values_agree_with_the_intervals():
    rng = np.random.default_rng(5)
    for shift in np.linspace(-1.0, 1.0, 21):
        x = rng.normal(shift, 1.0, 15)
        iv = Resample.of([15], 2000, rng_for(int(shift * 100) + 200, "p")).mean(x).interval(0.95)
        assert (iv.p_value < 0.05) == (iv.direction != 0), (shift, iv)


def test_expanded_alpha_is_the_t_correction():
    assert expanded_alpha(0.05, 10) == pytest.approx(2 * stats.norm.cdf(math.sqrt(10 / 9) * stats.t.ppf(0.025, 9)))
    assert expanded_alpha(0.05, 10) < expanded_alpha(0.05, 100) < 0.05  # wider at small n, to 0.05 at large
    assert expanded_alpha(0.05, 10_000) == pytest.approx(0.05, abs=2e-4)


def test_no_interval_below_the_minimum_number_of_units():
    r = Resample.of([MIN_UNITS - 1], 200, rng_for(1, "few"))
    iv = r.mean(np.array([1.0, 2.0, 3.0, 4.0])).interval(0.95)
    assert math.isnan(iv.low) and math.isnan(iv.p_value) and iv.n == MIN_UNITS - 1 and iv.direction == 0


def test_stratified_resamples_keep_each_stratum_size():
    counts = resample_counts([3, 5, 2], 500, np.random.default_rng(0))
    assert counts.shape == (500, 10)
    assert (counts[:, :3].sum(axis=1) == 3).all() and (counts[:, 3:8].sum(axis=1) == 5).all()
    assert (counts[:, 8:].sum(axis=1) == 2).all()


def test_paired_statistics_on_known_values():
    r = Resample.of([6], 300, rng_for(2, "known"))
    m, b = np.array([2.0, 4, 6, 8, 10, np.nan]), np.array([1.0, 2, 3, 4, 5, 6])
    assert r.ratio(m, b).estimate == pytest.approx(30 / 15)  # the unit without a method value is left out
    assert r.ratio(m, b).n == 5 and np.allclose(r.ratio(m, b).draws, 2.0)  # constant per-unit ratio: no spread
    assert r.geometric_mean(np.log(m / b)).estimate == pytest.approx(2.0)
    assert r.mean(m, weights=np.array([1.0, 1, 1, 1, 6, 1])).estimate == pytest.approx((2 + 4 + 6 + 8 + 60) / 10)
    assert r.median(b).estimate == 3.5
    # per draw, the median of the drawn values (the lower middle one for an even count)
    values = np.array([5.0, 1.0, 4.0, 2.0, 3.0, 9.0])
    for row, drawn in zip(r.counts[:50], r.median(values).draws[:50]):
        expanded = np.sort(np.repeat(values, row.astype(int)))
        assert drawn == expanded[(len(expanded) - 1) // 2]


def test_differences_of_one_cell_are_paired():
    rng = np.random.default_rng(3)
    difficulty = rng.normal(0, 1.0, 30)  # shared by both methods: pairing removes it
    a, b = difficulty + 0.3, difficulty + rng.normal(0, 0.05, 30)
    r = Resample.of([30], 1000, rng_for(3, "paired"))
    paired = (r.mean(a) - r.mean(b)).interval(0.95)
    assert paired.direction == 1 and paired.high - paired.low < 0.1  # the unpaired spread would be ~0.5


def test_holm_adjusts_as_it_must():
    p = [0.01, 0.04, 0.03, 0.005]
    assert np.allclose(holm(p), [0.03, 0.06, 0.06, 0.02])  # sorted: 4*0.005, 3*0.01, 2*0.03 (then max), 1*0.04
    adjusted = holm([0.2, np.nan, 0.01])
    assert np.isnan(adjusted[1]) and np.allclose(adjusted[[0, 2]], [0.2, 0.02])  # NaN is not in the family
    rng = np.random.default_rng(0)
    for _ in range(50):
        raw = rng.uniform(0, 0.2, 8)
        adj = holm(raw)
        assert (adj >= raw).all() and (adj <= np.minimum(8 * raw, 1)).all()  # between raw and Bonferroni
        order = np.argsort(raw)
        assert (np.diff(adj[order]) >= 0).all()  # monotone in the raw p-values
    assert list(holm([0.6, 0.7])) == [1.0, 1.0]  # 2 * 0.6 capped at 1, and the step-down keeps it


def test_the_mde_is_detected_with_80_percent_power():
    n, sd = 20, 1.0
    effect = mde(sd / math.sqrt(n), n, 0.95)
    assert effect == pytest.approx((stats.t.ppf(0.975, n - 1) + stats.t.ppf(0.8, n - 1)) * sd / math.sqrt(n))
    detected = 0
    for s in range(300):
        x = np.random.default_rng(s).normal(effect, sd, n)
        detected += Resample.of([n], 1000, rng_for(s, "power")).mean(x).interval(0.95).direction == 1
    assert 0.72 <= detected / 300 <= 0.90


def test_n_needed_is_the_smallest_n_whose_mde_meets_the_effect():
    se, n, effect = 0.05, 16, 0.04
    needed = n_needed(se, n, effect, 0.95)
    sd = se * math.sqrt(n)
    assert mde(sd / math.sqrt(needed), int(needed), 0.95) <= effect
    assert mde(sd / math.sqrt(needed - 1), int(needed) - 1, 0.95) > effect
    assert n_needed(0.0, n, effect, 0.95) == 2 and math.isnan(n_needed(math.nan, n, effect, 0.95))


def test_the_spread_of_a_weighted_mean_is_the_delta_method():
    d, w = np.array([1.0, 2.0, 3.0, 4.0]), np.array([1.0, 1.0, 1.0, 1.0])
    estimate, se, n = spread(d, w)
    assert (estimate, n) == (2.5, 4) and se == pytest.approx(np.std(d, ddof=1) / 2)


def test_power_table_on_pilot_data():
    rows = []
    for s in range(10):
        rows += [
            {
                "model": "m",
                "protocol": "p",
                "method": "kivi",
                "category": c,
                "d_score": v,
                "d_kl_mean": 0.1,
                "w_kl_mean": 1.0,
            }
            for c, v in (("qa", 0.1 * (s % 2)), ("sum", -0.1 * (s % 2)))
        ]
    table = power_table(pd.DataFrame(rows), {"score": 0.05}, 0.95).set_index(["category", "quantity"])
    qa = table.loc[("qa", "score")]
    assert qa.n == 10 and qa.sd == pytest.approx(np.std([0.0, 0.1] * 5, ddof=1))
    assert qa.mde == pytest.approx(mde(qa.sd / math.sqrt(10), 10, 0.95)) and qa.effect == 0.05
    assert table.loc[("pooled", "score")].n == 20 and table.loc[("qa", "kl_mean")].n_needed == 2  # no spread


def test_equal_means_test_separates_noise_from_a_difference():
    rejected = 0
    for s in range(200):
        noise = np.random.default_rng(s).normal(0, 1, (20, 5)) + np.random.default_rng(s + 1).normal(0, 1, (20, 1))
        p, n = equal_means_test(noise, 500, rng_for(s, "equal"))
        rejected += p < 0.05
    assert n == 20 and rejected / 200 <= 0.08
    shifted = np.random.default_rng(9).normal(0, 1, (20, 5)) + np.array([0, 0, 0, 0, 2.0])
    assert equal_means_test(shifted, 500, rng_for(9, "equal"))[0] < 0.01


def test_kendall_tau_rows_is_scipys_tau_b():
    rng = np.random.default_rng(4)
    a, b = rng.integers(0, 4, (30, 6)).astype(float), rng.normal(size=(30, 6))
    ours = kendall_tau_rows(a, b)
    for row, tau in zip(range(30), ours):
        expected = stats.kendalltau(a[row], b[row]).statistic
        assert (math.isnan(tau) and math.isnan(expected)) or tau == pytest.approx(expected)


def test_a_cell_draws_the_same_resamples_whatever_else_the_run_holds():
    one = Resample.of([7], 100, rng_for(1234, "quality", "m", "query-aware", "qa", "0-4k")).counts
    again = Resample.of([7], 100, rng_for(1234, "quality", "m", "query-aware", "qa", "0-4k")).counts
    other = Resample.of([7], 100, rng_for(1234, "quality", "m", "query-aware", "qa", "4-8k")).counts
    assert (one == again).all() and not (one == other).all()


def test_interval_and_estimate_arithmetic():
    draws = np.r_[np.full(50, np.nan), np.linspace(0.0, 1.0, 1000)]  # NaN draws (no data drawn) left out
    assert interval(0.5, draws, 30, 0.95, null=0.5).direction == 0
    iv = interval(0.5, draws, 30, 0.95)
    assert 0 < iv.low < 0.05 and 0.95 < iv.high < 1 and iv.direction == 1 and iv.p_value < 0.05
    diff = Estimate(2.0, np.full(10, 2.0), 8) - Estimate(0.5, np.full(10, 0.5), 6)
    assert diff.estimate == 1.5 and (diff.draws == 1.5).all()


def test_a_difference_of_two_means_is_taken_on_the_units_both_have():
    # A has units 0-9, B units 5-14; units 0-4 are hard (a unit effect of +10) and only A has them.
    # On the 5 shared units A is B + 1 exactly: the paired difference is 1 with no spread, n = 5
    # (a difference of the two means over their own units would be 5 + 1 and n = min = 10).
    r = Resample.of([15], 500, np.random.default_rng(0))
    effect = np.r_[np.full(5, 10.0), np.arange(10.0)]
    a = np.where(np.arange(15) < 10, effect + 1, np.nan)
    b = np.where(np.arange(15) >= 5, effect, np.nan)
    diff = r.mean(a) - r.mean(b)
    assert diff.n == 5 and diff.estimate == pytest.approx(1.0)
    assert np.allclose(diff.draws[np.isfinite(diff.draws)], 1.0) and diff.changed == 5


def test_a_difference_of_two_ratios_and_of_their_lowest_is_taken_on_the_units_both_have():
    # relative quality (method / baseline) of two methods: a has units 0-11, b units 4-15; units 0-3
    # are hard (the baseline scores 0.1) and a keeps only half there. On the 8 shared units both keep
    # 0.9: the paired difference is 0 on n = 8 (over their own units: -0.02 on n = min = 12).
    from kvbench.report.claims import _lowest

    r = Resample.of([16], 500, np.random.default_rng(1))
    unit = np.arange(16)
    base = np.where(unit < 4, 0.1, 1.0)
    a = np.where(unit < 4, 0.5 * base, np.where(unit < 12, 0.9 * base, np.nan))
    b = np.where(unit < 4, np.nan, 0.9 * base)
    diff = r.ratio(a, base) - r.ratio(b, base)
    assert diff.n == 8 and diff.estimate == pytest.approx(0.0, abs=1e-12)
    even = unit % 2 == 0
    worst = {
        m: _lowest({c: r.ratio(np.where(h, v, np.nan), base) for c, h in (("x", even), ("y", ~even))})
        for m, v in (("a", a), ("b", b))
    }
    lowest = worst["a"] - worst["b"]
    assert lowest.n == 4 and lowest.estimate == pytest.approx(0.0, abs=1e-12)


def test_documents_are_resampled_whole_and_counted_as_n():
    documents = np.repeat(["d0", "d1", "d2", "d3", "d4", "d5"], 3)
    r = Resample.clustered(documents, 200, np.random.default_rng(0))
    assert (r.counts.reshape(200, 6, 3) == r.counts.reshape(200, 6, 3)[:, :, :1]).all()  # a document's units together
    assert r.counts.sum(axis=1).tolist() == [18.0] * 200  # 6 documents drawn per resample
    est = r.mean(np.where(np.arange(18) == 17, np.nan, 1.0))  # one unit missing: its document still counts
    assert (est.n, est.n_units) == (6, 17) and est.interval(0.95).n_units == 17


def test_a_cluster_bootstrap_covers_a_mean_whose_units_share_documents():
    # 10 documents x 6 samples, a document effect (sd 1) shared by its samples, noise sd 0.3: resampling
    # samples treats 60 correlated values as independent and under-covers; resampling documents does not.
    rng = np.random.default_rng(11)
    documents = np.repeat(np.arange(10), 6)
    covered = {"documents": 0, "samples": 0}
    sims = 300
    for _ in range(sims):
        values = rng.normal(0, 1, 10)[documents] + rng.normal(0, 0.3, 60)
        for name, r in (
            ("documents", Resample.clustered(documents, 1000, rng)),
            ("samples", Resample.of([60], 1000, rng)),
        ):
            iv = r.mean(values).interval(0.95)
            covered[name] += iv.low <= 0 <= iv.high
    assert covered["documents"] / sims >= 0.90 and covered["samples"] / sims < 0.75


# --- claims on pure noise: inconclusive in at least 1 - alpha of simulations ------------------

FAMILIES = {
    "full": {"kind": "full"},
    "kivi2": {"kind": "kivi", "bits": 2},
    "kivi4": {"kind": "kivi", "bits": 4},
    "turboquant3": {"kind": "turboquant", "bits": 3},
    "turboquant4": {"kind": "turboquant", "bits": 4},
    "snapkv": {"kind": "snapkv", "keep_ratio": 0.25},
    "snapkv50": {"kind": "snapkv", "keep_ratio": 0.5},
    "cam": {"kind": "cam", "keep_ratio": 0.25},
}
RATIOS = {
    "full": 1.0,
    "kivi2": 7.0,
    "kivi4": 3.8,
    "turboquant3": 4.9,
    "turboquant4": 3.9,
    "snapkv": 4.0,
    "snapkv50": 2.0,
    "cam": 4.0,
}
CATEGORIES = ("single_doc_qa", "multi_doc_qa", "few_shot", "summarization", "retrieval")


def _evidence(frames: dict, **kw) -> C.Evidence:
    found = tables(**frames)
    paired = paired_quality(found, "full")
    units = system_units(found, "full")[0]
    return C.Evidence(
        found,
        FAMILIES,
        "full",
        "bf16",
        "zstd-3",
        pd.DataFrame(),
        pd.DataFrame(),
        paired,
        units,
        n_boot=400,
        seed=kw.get("seed", 0),
        level=0.95,
    )


def _noise_scores(rng: np.random.Generator, samples: int = 8) -> pd.DataFrame:
    """Every method scores each sample's difficulty plus noise: no method differs from another."""
    rows = []
    for c in CATEGORIES:
        difficulty = rng.uniform(0.2, 0.8, samples)
        for m in FAMILIES:
            noise = rng.normal(0, 0.1, samples)
            rows += [
                {
                    "model": "m",
                    "method": m,
                    "task": f"{c}_task",
                    "category": c,
                    "metric": "qa_f1",
                    "bucket": "0-4k",
                    "context_tokens": 1000,
                    "sample": s,
                    "score": float(np.clip(difficulty[s] + noise[s], 0, 1)),
                    "error": None,
                    "ttft_s": math.nan,
                    "tpot_s": math.nan,
                    "kv_bytes": math.nan,
                    "ratio": RATIOS[m] * (1 + rng.normal(0, 0.01)),
                }
                for s in range(samples)
            ]
    return pd.DataFrame(rows)


def _noise_runs(rng: np.random.Generator, prompts: int = 8, repeats: int = 3) -> pd.DataFrame:
    """Interleaved runs: a drift per round shared by every method, per-run noise, no method effect."""
    rows = []
    for p in range(prompts):
        for r in range(repeats):
            drift = rng.lognormal(0, 0.3)
            for m in FAMILIES:
                rows.append(
                    {
                        "model": "m",
                        "method": m,
                        "prompt_id": f"doc{p}@1024",
                        "corpus": "realistic",
                        "repeat": r,
                        "ttft_s": 2.0 * drift * rng.lognormal(0, 0.05),
                        "tpot_s": 0.1 * drift * rng.lognormal(0, 0.05),
                        "decode_tok_s": 10 / drift,
                        "kv_bytes_end": 1e6 / RATIOS[m],
                        "ratio_end": RATIOS[m],
                        "error": None,
                        "bucket": "0-4k",
                        "target_context": 1024,
                    }
                )
    return pd.DataFrame(rows)


@pytest.mark.parametrize(
    "claim_id, frames",
    [
        ("ratio-predicts-poorly", lambda rng: {"quality_scores": _noise_scores(rng)}),
        ("summarization-most-fragile", lambda rng: {"quality_scores": _noise_scores(rng)}),
        ("kivi4-most-stable", lambda rng: {"quality_scores": _noise_scores(rng)}),
        ("turboquant-ttft-overhead", lambda rng: {"system_runs": _noise_runs(rng)}),
    ],
)
def test_a_claim_on_pure_noise_is_inconclusive(claim_id, frames):
    sims, decided = 60, 0
    for s in range(sims):
        ev = _evidence(frames(np.random.default_rng(s)), seed=s)
        claims = C.evaluate(ev)
        verdicts = claims[claims.claim_id == claim_id].verdict
        assert len(verdicts) and verdicts.isin([C.INCONCLUSIVE, C.CONFIRMED, C.CONTRADICTED]).all()
        decided += (verdicts != C.INCONCLUSIVE).any()
    assert decided / sims <= 0.05, (claim_id, decided)


def test_the_schemas_effects_are_the_power_modules():
    import yaml

    from kvbench.report.power import DEFAULT_EFFECTS
    from kvbench.tinyrun import REPO

    schema = yaml.safe_load((REPO / "workflow/schemas/config.schema.yaml").read_text())
    effects = schema["properties"]["report"]["properties"]["power"]["properties"]["effects"]
    assert effects["propertyNames"]["enum"] == list(DEFAULT_EFFECTS)


def test_mde_and_n_needed_of_a_claim_use_the_level_its_verdict_is_decided_at():
    from kvbench.report.bootstrap import Interval
    from kvbench.report.decide import Test, family_levels
    from kvbench.report.power import POWER

    def test(p: float, bonferroni: int = 1) -> Test:
        iv = Interval(0.01, -0.01, 0.03, 20, 0.01, p, 0.95)
        return Test("a vs b", "difference", iv, p, 1, True, "samples", 0.05, bonferroni)

    tests = [test(0.5), test(0.001), None, test(0.02, bonferroni=2), test(math.nan)]
    levels = family_levels(tests, 0.95)
    # alpha over the 3 tests with a p-value, whatever their rank (an inconclusive claim's largest p
    # gets no easier level than the first), and over a test's own Bonferroni factor
    assert levels == pytest.approx([1 - 0.05 / 3, 1 - 0.05 / 3, 1 - 0.05 / 3, 1 - 0.05 / 6, 1 - 0.05 / 3])
    t = tests[1]
    assert t.mde(levels[1]) == pytest.approx(mde(0.01, 20, 1 - 0.05 / 3, POWER))
    assert t.mde(levels[1]) > mde(0.01, 20, 0.95, POWER)
    assert t.n_needed(levels[1]) > n_needed(0.01, 20, 0.05, 0.95, POWER)


def test_the_power_tables_spread_counts_documents_where_units_share_them():
    # 5 documents x 4 samples, each document's samples equal: the spread is the documents' (n = 5),
    # not 20 independent samples'
    doc_means = np.array([0.1, -0.2, 0.3, 0.0, 0.4])
    documents = np.repeat(np.arange(5), 4)
    estimate, se, n = spread(doc_means[documents], None, documents)
    assert n == 5 and estimate == pytest.approx(doc_means.mean())
    assert se == pytest.approx(doc_means.std(ddof=1) / math.sqrt(5))
    assert spread(doc_means[documents])[1] < se / 2  # as 20 independent samples: far too small
    assert spread(doc_means, None, np.arange(5)) == pytest.approx(spread(doc_means))  # one unit each: as before
    paired = pd.DataFrame({"method": "m", "category": "qa", "d_score": doc_means[documents], "document": documents})
    row = power_table(paired, by=("method", "category")).iloc[0]
    assert (row.n, row.n_units) == (5, 20)


def test_a_difference_of_means_that_differ_on_few_units_has_no_interval():
    # 0/1 scores equal on 95 of 100 samples: the bootstrap's interval of the paired difference would
    # exclude 0 (drawing none of the 5 is rare), an exact sign test gives p = 2 / 2^5 = 0.0625. No
    # interval below MIN_CHANGED = 6 changed units; from 6 on (p = 0.031), the usual one.
    from kvbench.report.bootstrap import MIN_CHANGED

    assert MIN_CHANGED == 6 and stats.binomtest(5, 5).pvalue > 0.05 > stats.binomtest(6, 6).pvalue
    r = Resample.of([100], 2000, np.random.default_rng(3))
    full = np.ones(100)
    few, six, many = full.copy(), full.copy(), full.copy()
    few[:5], six[:6], many[:30] = 0.0, 0.0, 0.0
    sparse = (r.mean(few) - r.mean(full)).interval(0.95)
    assert sparse.estimate == pytest.approx(-0.05) and sparse.n == 100
    assert math.isnan(sparse.low) and math.isnan(sparse.p_value)
    assert (r.mean(six) - r.mean(full)).interval(0.95).high < 0
    dense = (r.mean(many) - r.mean(full)).interval(0.95)
    assert dense.high < 0 and dense.p_value < 0.05 and dense.n == 100


def test_where_documents_are_resampled_the_changes_are_counted_in_documents():
    # 40 samples of 20 documents; 6 samples change, in 4 documents: 4 independent changes, no interval
    documents = np.repeat(np.arange(20), 2)
    r = Resample.clustered(documents, 2000, np.random.default_rng(4))
    full = np.ones(40)
    four_docs, six_docs = full.copy(), full.copy()
    four_docs[[0, 1, 2, 3, 4, 6]] = 0.0  # documents 0, 1, 2, 3
    six_docs[[0, 2, 4, 6, 8, 10]] = 0.0  # documents 0 to 5
    assert (r.mean(four_docs) - r.mean(full)).changed == 4
    assert math.isnan((r.mean(four_docs) - r.mean(full)).interval(0.95).low)
    assert (r.mean(six_docs) - r.mean(full)).interval(0.95).high < 0

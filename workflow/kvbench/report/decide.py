"""How a claim's verdict is decided by its evidence: the test behind it, and the family rule.

Every testable claim ends in a Test: the interval of the statistic it rests on (at the report's
level, per comparison), a two-sided bootstrap p-value for the verdict its data points to, and the
n, minimum detectable effect and the n a stated effect needs. Across the family of claims the
p-values are adjusted by Holm's step-down method, which bounds the chance of any false verdict in
the table by alpha (family-wise error), whatever the dependence between claims; a reader acts on
each verdict alone, so the guarantee is per verdict, not a share of false ones (Benjamini-
Hochberg's), and Holm is never less powerful than Bonferroni. A claim is `confirmed` or
`contradicted` only when its Holm-adjusted p-value is below alpha and its printed interval lies
on that side of the null; otherwise it is `inconclusive`, with the interval, n and MDE.

"X is the highest of its rivals" is an intersection-union test: confirmed when some member of
X exceeds every rival (each paired difference decided; Bonferroni over X's members), contradicted
when some rival exceeds every member of X (Bonferroni over the rivals). The interval printed is
the binding pair's: the difference that decides (or fails to).

The MDE and the n a stated effect needs are at the level every verdict of the family can be
decided at whatever the others do: alpha over the m tests with a p-value (Holm's first step,
which step-down Holm's later steps only reach once every smaller p fell) and over the test's own
Bonferroni factor (`family_levels`). For the claims a run leaves inconclusive, which have the
largest p-values, Holm's own later steps would understate both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from kvbench.report.bootstrap import Estimate, Interval, holm, p_beyond
from kvbench.report.power import POWER, mde, n_needed

CONFIRMED = "confirmed"
CONTRADICTED = "contradicted"
INCONCLUSIVE = "inconclusive"


@dataclass(frozen=True)
class Test:
    compared: str  # what is compared, in words
    statistic: str  # the statistic and its null
    interval: Interval  # of the statistic printed (the binding one), at the report's level
    p_value: float  # two-sided, for the verdict in `direction` (NaN: no interval at this n)
    direction: int  # +1 the data point to confirmed, -1 to contradicted, 0 to neither
    supports: bool  # the printed interval(s) lie on that side of the null at the report's level
    unit: str  # what a unit is: samples, prompts, documents
    effect: float  # the effect the claim must resolve, in the statistic's units
    bonferroni: int = 1  # the test's own factor on its p-value (members or rivals; the band's 2 sides)

    @property
    def counted(self) -> str:
        """What n counts: documents where the cell resampled them (its units share documents)."""
        return "documents" if self.interval.n_units is not None else self.unit

    def mde(self, level: float) -> float:
        """At `level`: the family's (family_levels), not the printed interval's."""
        return mde(self.interval.se, self.interval.n, level, POWER)

    def n_needed(self, level: float) -> float:
        return n_needed(self.interval.se, self.interval.n, self.effect, level, POWER)

    def describe(self) -> str:
        iv = self.interval
        ci = f"[{iv.low:.3g}, {iv.high:.3g}]" if iv.low == iv.low else "no interval"
        behind = f" ({iv.n_units} {self.unit})" if iv.n_units is not None else ""
        return f"{self.statistic}: {iv.estimate:.3g} {ci}, n = {iv.n} {self.counted}{behind}"


def no_interval(
    compared: str, statistic: str, estimate: float, n: int, level: float, unit: str, effect: float, null: float = 0.0
) -> Test:
    """A test that cannot run at this n (fewer units than an interval needs)."""
    iv = Interval(estimate, math.nan, math.nan, n, math.nan, math.nan, level, null)
    return Test(compared, statistic, iv, math.nan, 0, False, unit, effect)


def threshold_test(
    compared: str, statistic: str, est: Estimate, threshold: float, level: float, unit: str, effect: float
) -> Test:
    """Confirmed if the statistic lies above `threshold`, contradicted if below."""
    iv = est.interval(level, null=threshold)
    if iv.p_value != iv.p_value:
        return Test(compared, statistic, iv, math.nan, 0, False, unit, effect)
    direction = 1 if est.estimate > threshold else -1 if est.estimate < threshold else 0
    return Test(compared, statistic, iv, iv.p_value, direction, iv.direction == direction != 0, unit, effect)


def family_threshold_test(
    compared: str,
    statistic: str,
    estimates: Mapping[str, Estimate],
    threshold: float,
    level: float,
    unit: str,
    effect: float,
) -> Test:
    """Confirmed if some member lies above `threshold` (Bonferroni over the members), contradicted if
    every member lies below it (intersection-union)."""
    ivs = {name: est.interval(level, null=threshold) for name, est in estimates.items()}
    if not ivs:
        raise ValueError(f"{compared}: no member to test")
    if all(iv.p_value != iv.p_value for iv in ivs.values()):
        return Test(compared, statistic, next(iter(ivs.values())), math.nan, 0, False, unit, effect)

    def p(iv: Interval, above: bool) -> float:
        on_side = iv.estimate > threshold if above else iv.estimate < threshold
        return iv.p_value if on_side and iv.p_value == iv.p_value else 1.0

    up = min(ivs, key=lambda k: p(ivs[k], True))
    p_up = min(1.0, len(ivs) * p(ivs[up], True))
    down = max(ivs, key=lambda k: p(ivs[k], False))
    p_down = p(ivs[down], False)
    if p_up <= p_down:
        return Test(compared, statistic, ivs[up], p_up, 1, ivs[up].direction == 1, unit, effect, len(ivs))
    supports = all(iv.direction == -1 for iv in ivs.values())
    return Test(compared, statistic, ivs[down], p_down, -1, supports, unit, effect)


def extreme_test(
    compared: str,
    statistic: str,
    estimates: Mapping[str, Estimate],
    family: Sequence[str],
    rivals: Sequence[str],
    higher: bool,
    level: float,
    unit: str,
    effect: float,
) -> Test:
    """Is some member of `family` the highest (or lowest) of all, by paired differences of
    `estimates` (all on one cell's resamples)? See the module's text."""
    sign = 1 if higher else -1
    ivs = {(x, c): (estimates[x] - estimates[c]).interval(level) for x in family for c in rivals}
    if all(iv.p_value != iv.p_value for iv in ivs.values()):
        binding = max(ivs, key=lambda k: sign * ivs[k].estimate if ivs[k].estimate == ivs[k].estimate else -math.inf)
        return Test(compared, statistic, ivs[binding], math.nan, 0, False, unit, effect)

    def p(iv: Interval, side: int) -> float:
        return iv.p_value if sign * side * iv.estimate > 0 and iv.p_value == iv.p_value else 1.0

    confirm = {x: max(((p(ivs[(x, c)], 1), c) for c in rivals), key=lambda t: t[0]) for x in family}
    best_x = min(confirm, key=lambda x: confirm[x][0])
    p_confirm = min(1.0, len(family) * confirm[best_x][0])
    contradict = {c: max(((p(ivs[(x, c)], -1), x) for x in family), key=lambda t: t[0]) for c in rivals}
    best_c = min(contradict, key=lambda c: contradict[c][0])
    p_contradict = min(1.0, len(rivals) * contradict[best_c][0])
    if p_confirm <= p_contradict:
        supports = all(ivs[(best_x, c)].direction == sign for c in rivals)
        binding = ivs[(best_x, confirm[best_x][1])]
        return Test(compared, statistic, binding, p_confirm, 1, supports, unit, effect, len(family))
    supports = all(ivs[(x, best_c)].direction == -sign for x in family)
    binding = ivs[(contradict[best_c][1], best_c)]
    return Test(compared, statistic, binding, p_contradict, -1, supports, unit, effect, len(rivals))


def band_test(
    compared: str,
    statistic: str,
    est: Estimate,
    band: float,
    level: float,
    unit: str,
    effect: float,
    also_needed: float = 0.0,
) -> Test:
    """Confirmed if the statistic's interval lies inside (-band, band) (and `also_needed`, the p-value
    of a condition the confirmation also needs, is small: intersection-union), contradicted if it
    lies beyond band or beyond -band (Bonferroni over the two sides)."""
    iv = est.interval(level)
    if iv.p_value != iv.p_value:
        return Test(compared, statistic, iv, math.nan, 0, False, unit, effect)
    draws, n = est.draws[np.isfinite(est.draws)], iv.n
    p_inside = max(p_beyond(draws, n, band, above=True), p_beyond(draws, n, -band, above=False), also_needed)
    p_outside = min(1.0, 2 * min(p_beyond(draws, n, band, above=False), p_beyond(draws, n, -band, above=True)))
    if p_inside <= p_outside:
        return Test(compared, statistic, iv, p_inside, 1, -band < iv.low and iv.high < band, unit, effect)
    return Test(compared, statistic, iv, p_outside, -1, iv.low >= band or iv.high <= -band, unit, effect, 2)


def verdicts(tests: Sequence[Test | None], level: float) -> tuple[list[str | None], np.ndarray]:
    """The verdict of each test (None where there is none) and its Holm-adjusted p-value over the
    tests that have a p-value."""
    adjusted = holm([t.p_value if t is not None else math.nan for t in tests])
    out: list[str | None] = []
    for test, p in zip(tests, adjusted):
        if test is None:
            out.append(None)
        elif p < 1 - level and test.supports and test.direction:
            out.append(CONFIRMED if test.direction > 0 else CONTRADICTED)
        else:
            out.append(INCONCLUSIVE)
    return out, adjusted


def family_levels(tests: Sequence[Test | None], level: float) -> list[float]:
    """Per test, the level an MDE or a needed n is stated at: 1 - alpha / (m * its Bonferroni
    factor), m the tests with a p-value (at least 1), the same for every test of the family."""
    m = max(1, sum(1 for t in tests if t is not None and math.isfinite(t.p_value)))
    return [1 - (1 - level) / (m * (t.bonferroni if t is not None else 1)) for t in tests]

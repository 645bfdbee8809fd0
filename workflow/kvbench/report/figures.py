"""The report's figures: rank correlation of measured ratio with outcomes, the trade-offs, and the
compression frontier. Every point that has an interval carries it as an error bar (a point without
one is drawn hollow); methods are told apart by colour in one legend per figure, never by text
next to the points, so no label can hide another."""

from __future__ import annotations

import os
from typing import Any, Iterable, Mapping

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.collections import LineCollection
from matplotlib.lines import Line2D

from kvbench.plots import save
from kvbench.report.bootstrap import MIN_CHANGED
from kvbench.report.cells import ALL
from kvbench.report.claims import PREDICTS_RHO

OUTCOME_LABELS = {"quality": "quality", "ttft_s": "TTFT", "tpot_s": "TPOT"}
MARKERS = ["o", "s", "^", "D", "v", "P", "X", "<", ">", "*"]
PROTOCOL_MARKERS = {"query-aware": "o", "context-only": "s"}
# Keys a sweep varies: methods of one kind that differ only in these are one curve of the frontier.
SWEEP_KEYS = ("keep_ratio", "bits", "capacity", "window")
# (quantity, column of the differences table, label, higher is better)
FRONTIER_ROWS = [
    ("score", "difference", "task score - reference's", True),
    ("kl_mean", "value", "KL to the reference (nats / position)", False),
    ("top1_agreement", "value", "top-1 agreement with the reference", True),
]


def _empty(ax: plt.Axes, text: str, clear_y: bool = True) -> None:
    """A panel that says what is missing (y ticks stay when the y axis is shared)."""
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="#616e7c")
    ax.set_xticks([])
    if clear_y:
        ax.set_yticks([])


def method_colors(methods: Iterable[str]) -> dict[str, Any]:
    """One colour per method, stable under the order given (sorted)."""
    cmap = plt.get_cmap("tab20")
    return {m: cmap(i % 20) for i, m in enumerate(sorted(set(methods)))}


def _ends(low: Any, high: Any, like: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    low = np.full_like(like, np.nan) if low is None else np.asarray(low, float)
    high = np.full_like(like, np.nan) if high is None else np.asarray(high, float)
    return low, high, np.isfinite(low) & np.isfinite(high)


def points(
    ax: plt.Axes,
    x: Any,
    y: Any,
    xlow: Any,
    xhigh: Any,
    ylow: Any,
    yhigh: Any,
    colors: list[Any],
    marker: str,
    size: float = 5,
) -> None:
    """Points (`colors`: one per point) with their intervals as bars where both ends are known (the
    line collections `interval-x` and `interval-y`: one segment per point with that interval);
    hollow where a point has an interval on neither axis (too few units). One call per panel:
    matplotlib's errorbar per point made a large frontier take seconds."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    ok = np.isfinite(x) & np.isfinite(y)
    xl, xh, has_x = _ends(xlow, xhigh, x)
    yl, yh, has_y = _ends(ylow, yhigh, y)
    for name, mask, ends in (
        ("interval-x", ok & has_x, lambda i: [(xl[i], y[i]), (xh[i], y[i])]),
        ("interval-y", ok & has_y, lambda i: [(x[i], yl[i]), (x[i], yh[i])]),
    ):
        idx = np.flatnonzero(mask)
        if len(idx):
            segments = [ends(i) for i in idx]
            ax.add_collection(
                LineCollection(segments, colors=[colors[i] for i in idx], linewidths=0.9, alpha=0.9, gid=name),
                autolim=False,
            )
            ax.update_datalim(np.array(segments).reshape(-1, 2))
    for mask, hollow in ((ok & (has_x | has_y), False), (ok & ~(has_x | has_y), True)):
        idx = np.flatnonzero(mask)
        if len(idx):
            shade = [colors[i] for i in idx]
            ax.scatter(
                x[idx],
                y[idx],
                marker=marker,
                s=size**2,
                zorder=3,
                edgecolors=shade,
                facecolors="none" if hollow else shade,
            )
    ax.autoscale_view()


def _method_legend(fig: plt.Figure, colors: Mapping[str, Any], drawn: Iterable[str], extra: list[Line2D] = ()) -> None:
    """One legend for the figure: each method drawn (colours stable across figures), then `extra`."""
    drawn = set(drawn)
    handles = [Line2D([], [], color=c, marker="o", ls="none", label=m) for m, c in colors.items() if m in drawn]
    handles.append(Line2D([], [], color="#52606d", marker="o", mfc="none", ls="none", label="no interval (n < 5)"))
    fig.legend(handles=[*handles, *extra], loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=7, frameon=False)


def correlation_figure(corr: pd.DataFrame, png: str | os.PathLike, svg: str | os.PathLike) -> None:
    """Spearman's rho (point) and its bootstrap interval (bar) per category, one panel per outcome."""
    protocols = corr.protocol.nunique() > 1 if "protocol" in corr else False

    def name(r: Any) -> str:
        return f"{r.model} / {r.protocol} / {r.category}" if protocols else f"{r.model} / {r.category}"

    labels = sorted({name(r) for r in corr.itertuples()})
    height = 1.8 + 0.5 * len(labels)
    fig, axes = plt.subplots(
        1, len(OUTCOME_LABELS), figsize=(4.2 * len(OUTCOME_LABELS), height), sharey=True, squeeze=False
    )
    axes[0][0].set_ylim(-0.5, len(labels) - 0.5)
    axes[0][0].set_yticks(range(len(labels)), labels, fontsize=8)
    for ax, (outcome, label) in zip(axes[0], OUTCOME_LABELS.items()):
        rows = corr[(corr.outcome == outcome) & corr.rho.notna()]
        ax.set_title(f"measured ratio vs {label}")
        if rows.empty:
            _empty(ax, "not measured", clear_y=False)
            continue
        y = np.array([labels.index(name(r)) for r in rows.itertuples()], float)
        points(ax, rows.rho, y, rows.ci_low, rows.ci_high, None, None, ["#1f3b73"] * len(rows), "o")
        for r, yy in zip(rows.itertuples(), y):  # samples behind each point: one row each, nothing to collide with
            ax.annotate(
                f"n={r.samples}",
                (r.rho, yy),
                fontsize=7,
                xytext=(0, 6),
                textcoords="offset points",
                ha="center",
                color="#52606d",
            )
        ax.axvline(0, color="grey", lw=0.8)
        for edge in (-PREDICTS_RHO, PREDICTS_RHO):
            ax.axvline(edge, color="#d95f02", lw=0.8, ls="--")
        ax.set_xlim(-1.05, 1.05)
        ax.set_xlabel("Spearman's rho across methods")
    level = corr.level.dropna().iloc[0] if "level" in corr and corr.level.notna().any() else 0.95
    fig.suptitle(
        f"Does the measured compression ratio predict end-to-end behaviour? ({level:.0%} bootstrap intervals)",
        y=1 + 0.5 / height,
    )  # above the panel titles, whatever the height
    save(fig, png, svg)


def _bounds(rows: pd.DataFrame, column: str) -> tuple[pd.Series, pd.Series]:
    return rows.get(f"{column}_low"), rows.get(f"{column}_high")


def tradeoff_figure(
    table: pd.DataFrame, baseline: str, png: str | os.PathLike, svg: str | os.PathLike, methods: Iterable[str] = ()
) -> None:
    """Measured ratio (x) against quality (one panel per protocol; marker: category) and TTFT, TPOT
    (marker: context bucket; they do not depend on the task) relative to the baseline, per method,
    with the intervals of both axes."""
    protocols = sorted(table.protocol.dropna().unique()) if "protocol" in table and len(table) else []
    panels = [("quality_rel", f"quality ({p})", "category", p) for p in protocols] or [
        ("quality_rel", "quality", "category", None)
    ]
    panels += [("ttft_s_rel", "TTFT", "bucket", None), ("tpot_s_rel", "TPOT", "bucket", None)]
    colors = method_colors([*methods, *table.method])
    several = table.model.nunique() > 1 if len(table) else False
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 4.4), squeeze=False)
    for ax, (column, label, marker_by, protocol) in zip(axes[0], panels):
        rows = table[table[column].notna() & table.ratio.notna()] if len(table) else table
        if protocol is not None:
            rows = rows[rows.protocol == protocol]
        keys = ["model", "method", marker_by] if column != "quality_rel" else ["model", "method", "category", "bucket"]
        rows = rows.drop_duplicates(keys)
        ax.set_title(f"{label} relative to {baseline}")
        if rows.empty:
            _empty(ax, f"{label} not measured")
            continue
        groups = sorted(rows[marker_by].astype(str).unique())
        markers = {g: MARKERS[i % len(MARKERS)] for i, g in enumerate(groups)}
        for group, part in rows.groupby(rows[marker_by].astype(str)):
            xlo, xhi = _bounds(part, "ratio")
            ylo, yhi = _bounds(part, column)
            points(ax, part.ratio, part[column], xlo, xhi, ylo, yhi, [colors[m] for m in part.method], markers[group])
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xlabel(f"measured KV compression ratio vs {baseline}")
        title = marker_by + (" (models: " + ", ".join(sorted(rows.model.unique())) + ")" if several else "")
        ax.legend(
            handles=[Line2D([], [], color="#52606d", marker=markers[g], ls="none", label=g) for g in groups],
            fontsize=7,
            title=title,
            title_fontsize=7,
        )
    _method_legend(fig, colors, table.method if len(table) else [])
    fig.suptitle(
        "Trade-offs per method (bars: bootstrap intervals, an exact bound for a quality that differs from the "
        f"baseline's on < {MIN_CHANGED} samples; quality and bytes per sample, timings per prompt, paired with the "
        "baseline)"
    )
    save(fig, png, svg)


def sweep_key(spec: Mapping[str, Any]) -> tuple:
    """Methods with equal keys are points of one sweep (one kind, the same settings but SWEEP_KEYS)."""
    return (spec.get("kind"), tuple(sorted((k, str(v)) for k, v in spec.items() if k not in SWEEP_KEYS)))


def pareto(x: np.ndarray, y: np.ndarray, higher: bool) -> np.ndarray:
    """Mask of the points no other point beats on both axes (larger x, and larger y if `higher`
    else smaller y), ties kept."""
    good = y if higher else -y
    out = np.ones(len(x), bool)
    for i in range(len(x)):
        better = (x >= x[i]) & (good >= good[i]) & ((x > x[i]) | (good > good[i]))
        out[i] = not better.any()
    return out


def _frontier_rows(diff: pd.DataFrame) -> pd.DataFrame:
    """Per model x protocol x category: the rows pooled over buckets (or the one bucket's), and the
    pooled `all` category likewise."""
    keep = []
    for _, part in diff.groupby(["model", "protocol", "category"]):
        pooled = part[part.bucket == ALL]
        keep.append(pooled if len(pooled) else part[part.bucket == part.bucket.min()])
    return pd.concat(keep, ignore_index=True) if keep else diff


def frontier_figure(
    diff: pd.DataFrame, methods: Mapping[str, Mapping[str, Any]], png: str | os.PathLike, svg: str | os.PathLike
) -> None:
    """Fidelity and score against the measured compression ratio per task category (columns) and
    both protocols (markers), with both intervals; the Pareto frontier of each panel and protocol
    ringed and joined; the points of one sweep (one kind, one setting varied) joined by a thin line."""
    rows = _frontier_rows(diff) if len(diff) else diff
    kinds = (
        rows.dropna(subset=["kind"]).drop_duplicates("method").set_index("method").kind.to_dict() if len(rows) else {}
    )
    columns = sorted({(r.model, r.category) for r in rows.itertuples()}, key=lambda k: (k[0], k[1] == ALL, k[1]))
    several = len({m for m, _ in columns}) > 1
    colors = method_colors([*methods, *rows.method])
    fig, axes = plt.subplots(
        len(FRONTIER_ROWS), max(len(columns), 1), figsize=(3.4 * max(len(columns), 1), 9.5), squeeze=False
    )
    for j, (model, category) in enumerate(columns or [("-", "-")]):
        for i, (quantity, column, label, higher) in enumerate(FRONTIER_ROWS):
            ax = axes[i][j]
            if i == 0:
                ax.set_title(f"{model} / {category}" if several else str(category), fontsize=9)
            if j == 0:
                ax.set_ylabel(label, fontsize=8)
            here = rows[(rows.model == model) & (rows.category == category)] if columns else rows
            xs = here[here.quantity == "ratio"].set_index(["protocol", "method"])
            ys = here[here.quantity == quantity].set_index(["protocol", "method"])
            both = xs.index.intersection(ys.index)
            if both.empty:
                _empty(ax, "not measured")
                continue
            x, y = xs.loc[both], ys.loc[both]
            y_low, y_high = (y.ci_low, y.ci_high) if column == "difference" else (y.value_low, y.value_high)
            for protocol in sorted(set(both.get_level_values(0))):
                sel = both[both.get_level_values(0) == protocol]
                marker = PROTOCOL_MARKERS.get(protocol, "D")
                xv, yv = x.value[sel].to_numpy(float), y[column][sel].to_numpy(float)
                points(
                    ax,
                    xv,
                    yv,
                    x.value_low[sel],
                    x.value_high[sel],
                    y_low[sel],
                    y_high[sel],
                    [colors[method] for _, method in sel],
                    marker,
                )
                front = pareto(xv, yv, higher)
                order = np.argsort(xv[front])
                ax.plot(xv[front][order], yv[front][order], ls="--", lw=0.9, color="black", zorder=1)
                ax.plot(xv[front], yv[front], marker, ms=10, mfc="none", mec="black", ls="none", zorder=1)
                sweeps: dict[tuple, list[int]] = {}
                for k, (_, method) in enumerate(sel):  # a method not in the config: its kind alone
                    spec = methods.get(method) or {"kind": kinds.get(method, method)}
                    sweeps.setdefault(sweep_key(spec), []).append(k)
                for members in sweeps.values():
                    if len(members) > 1:
                        idx = np.array(members)[np.argsort(xv[members])]
                        ax.plot(xv[idx], yv[idx], lw=0.7, color="#9aa5b1", zorder=0)
            if column == "difference":
                ax.axhline(0.0, color="grey", lw=0.8)
            if i == len(FRONTIER_ROWS) - 1:
                ax.set_xlabel("measured compression ratio", fontsize=8)
            ax.tick_params(labelsize=7)
    extra = [Line2D([], [], color="#52606d", marker=m, ls="none", label=p) for p, m in PROTOCOL_MARKERS.items()]
    extra += [
        Line2D([], [], color="black", marker="o", mfc="none", ms=10, ls="--", lw=0.9, label="Pareto frontier"),
        Line2D([], [], color="#9aa5b1", lw=0.7, label="one sweep (kind, setting varied)"),
    ]
    _method_legend(fig, colors, rows.method if len(rows) else [], extra)
    fig.suptitle(
        "Compression frontier: fidelity and score vs measured ratio per category (bars: paired bootstrap "
        "intervals over samples)"
    )
    fig.tight_layout()
    save(fig, png, svg)

"""The report's figures: rank correlation of measured ratio with outcomes, and the trade-offs."""

from __future__ import annotations

import os

import matplotlib.pyplot as plt
import pandas as pd

from kvbench.plots import save
from kvbench.report.claims import PREDICTS_RHO

OUTCOME_LABELS = {"quality": "quality", "ttft_s": "TTFT", "tpot_s": "TPOT"}


def _empty(ax: plt.Axes, text: str, clear_y: bool = True) -> None:
    """A panel that says what is missing (y ticks stay when the y axis is shared)."""
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="#616e7c")
    ax.set_xticks([])
    if clear_y:
        ax.set_yticks([])


def correlation_figure(corr: pd.DataFrame, png: str | os.PathLike, svg: str | os.PathLike) -> None:
    """Spearman's rho (point) and its bootstrap interval (bar) per category, one panel per outcome."""
    labels = sorted({f"{r.model} / {r.category}" for r in corr.itertuples()})
    height = 1.8 + 0.5 * len(labels)
    fig, axes = plt.subplots(1, len(OUTCOME_LABELS), figsize=(4.2 * len(OUTCOME_LABELS), height), sharey=True,
                             squeeze=False)
    axes[0][0].set_ylim(-0.5, len(labels) - 0.5)
    axes[0][0].set_yticks(range(len(labels)), labels, fontsize=8)
    for ax, (outcome, label) in zip(axes[0], OUTCOME_LABELS.items()):
        rows = corr[(corr.outcome == outcome) & corr.rho.notna()]
        ax.set_title(f"measured ratio vs {label}")
        if rows.empty:
            _empty(ax, "not measured", clear_y=False)
            continue
        y = [labels.index(f"{r.model} / {r.category}") for r in rows.itertuples()]
        rho, low, high = (rows[c].to_numpy(float) for c in ("rho", "ci_low", "ci_high"))
        ax.errorbar(rho, y, xerr=[rho - low, high - rho], fmt="o", color="#1f3b73", ecolor="#7da7d9", capsize=3)
        for r, yy in zip(rows.itertuples(), y):  # samples behind each point (no interval below MIN_SAMPLES)
            ax.annotate(f"n={r.samples}", (r.rho, yy), fontsize=7, xytext=(0, 6), textcoords="offset points",
                        ha="center", color="#52606d")
        ax.axvline(0, color="grey", lw=0.8)
        for edge in (-PREDICTS_RHO, PREDICTS_RHO):
            ax.axvline(edge, color="#d95f02", lw=0.8, ls="--")
        ax.set_xlim(-1.05, 1.05)
        ax.set_xlabel("Spearman's rho across methods")
    level = corr.level.dropna().iloc[0] if "level" in corr and corr.level.notna().any() else 0.95
    fig.suptitle(f"Does the measured compression ratio predict end-to-end behaviour? ({level:.0%} bootstrap intervals)",
                 y=1 + 0.5 / height)  # above the panel titles, whatever the height
    save(fig, png, svg)


def tradeoff_figure(table: pd.DataFrame, baseline: str, png: str | os.PathLike, svg: str | os.PathLike) -> None:
    """Measured ratio (x) against quality (per category), TTFT and TPOT (per context bucket: they do
    not depend on the task) relative to the baseline, per method."""
    panels = [("quality_rel", "quality", ["category", "bucket"]), ("ttft_s_rel", "TTFT", ["bucket"]),
              ("tpot_s_rel", "TPOT", ["bucket"])]
    several = table.model.nunique() > 1
    fig, axes = plt.subplots(1, len(panels), figsize=(15, 4.6), squeeze=False)
    for ax, (column, label, by) in zip(axes[0], panels):
        rows = table[table[column].notna() & table.ratio.notna()].drop_duplicates(["model", "method", *by])
        ax.set_title(f"{label} relative to {baseline}")
        if rows.empty:
            _empty(ax, f"{label} not measured")
            continue
        for key, part in rows.groupby(["model", *by]):
            name = ", ".join(map(str, key if several else key[1:]))
            ax.scatter(part.ratio, part[column], s=22, label=name)
            for method, x, y in zip(part.method, part.ratio, part[column]):
                ax.annotate(method, (x, y), fontsize=7, xytext=(3, 2), textcoords="offset points")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xlabel(f"measured KV compression ratio vs {baseline}")
        ax.legend(fontsize=7)
    fig.suptitle("Trade-offs per method (medians over prompts, means over samples)")
    save(fig, png, svg)

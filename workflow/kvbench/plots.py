"""Figures (matplotlib, headless); every figure is written atomically as PNG."""

from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from kvbench.atomic import atomic_path  # noqa: E402


def save(fig: plt.Figure, path: str | os.PathLike) -> None:
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=120, bbox_inches="tight")
    plt.close(fig)


def diversity_figure(stats: pd.DataFrame, summary: pd.DataFrame, path: str | os.PathLike) -> None:
    """Per-document diversity (dots), group means (bars) and the reference figures (diamonds)."""
    labels = [f"{c}\n{d}" for c, d in zip(summary.corpus, summary.domain)]
    fig, ax = plt.subplots(figsize=(1.8 * len(labels) + 2, 4.5))
    x = range(len(labels))
    ax.bar(x, summary.diversity_pct_mean, color="#7da7d9", label="measured mean")
    for i, (c, d) in enumerate(zip(summary.corpus, summary.domain)):
        pts = stats[(stats.corpus == c) & (stats.domain == d)].diversity_pct
        ax.scatter([i] * len(pts), pts, color="#1f3b73", s=14, zorder=3,
                   label="documents" if i == 0 else None)
    ref = summary.reference_diversity_pct
    ax.scatter([i for i, r in zip(x, ref) if r == r], [r for r in ref if r == r], marker="D",
               color="#d95f02", s=50, zorder=4, label="reference (10K-token docs, Qwen3-8B)")
    ax.set_yscale("log")
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("token diversity, unique / total (%)")
    ax.set_title("Token diversity by corpus and domain")
    ax.legend(fontsize=8)
    save(fig, path)

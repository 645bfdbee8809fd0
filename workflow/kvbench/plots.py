"""Figures (matplotlib, headless); every figure is written atomically as PNG (and SVG on request)."""

from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from kvbench.atomic import atomic_path  # noqa: E402
from kvbench.kv.summary import pooled_ratios  # noqa: E402


def save(fig: plt.Figure, path: str | os.PathLike, svg: str | os.PathLike | None = None) -> None:
    """PNG at `path`, and the same figure as SVG at `svg` if given."""
    for target, fmt in ((path, "png"), (svg, "svg")):
        if target is not None:
            with atomic_path(target) as tmp:
                fig.savefig(tmp, format=fmt, dpi=120, bbox_inches="tight")
    plt.close(fig)


def diversity_figure(stats: pd.DataFrame, summary: pd.DataFrame, path: str | os.PathLike) -> None:
    """Per-document diversity (dots), group means (bars) and the reference figures (diamonds)."""
    labels = [f"{c}\n{d}" for c, d in zip(summary.corpus, summary.domain)]
    fig, ax = plt.subplots(figsize=(1.8 * len(labels) + 2, 4.5))
    x = range(len(labels))
    ax.bar(x, summary.diversity_pct_mean, color="#7da7d9", label="measured mean")
    for i, (c, d) in enumerate(zip(summary.corpus, summary.domain)):
        pts = stats[(stats.corpus == c) & (stats.domain == d)].diversity_pct
        ax.scatter([i] * len(pts), pts, color="#1f3b73", s=14, zorder=3, label="documents" if i == 0 else None)
    ref = summary.reference_diversity_pct
    ax.scatter(
        [i for i, r in zip(x, ref) if r == r],
        [r for r in ref if r == r],
        marker="D",
        color="#d95f02",
        s=50,
        zorder=4,
        label="reference (10K-token docs, Qwen3-8B)",
    )
    ax.set_yscale("log")
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("token diversity, unique / total (%)")
    ax.set_title("Token diversity by corpus and domain")
    ax.legend(fontsize=8)
    save(fig, path)


def kv_ratio_figure(ratios: pd.DataFrame, codec: str, path: str | os.PathLike) -> None:
    """The "hi hi hi" figure: pooled KV compression ratio by corpus x weights, one panel per dtype."""
    sel = ratios[ratios.codec == codec]
    dtypes = sorted(set(sel.dtype))
    fig, axes = plt.subplots(1, len(dtypes), figsize=(4.2 * len(dtypes), 4), sharey=True, squeeze=False)
    for ax, dtype in zip(axes[0], dtypes):
        panel = sel[sel.dtype == dtype].pivot(index="corpus", columns="weights", values="ratio")
        panel.plot.bar(ax=ax, rot=0, color=["#1b9e77", "#d95f02", "#7570b3"][: panel.shape[1]])
        ax.set_title(f"{dtype}, {codec}")
        ax.set_yscale("log")
        ax.set_ylabel("compression ratio (raw / compressed)")
        ax.axhline(1.0, color="grey", lw=0.8)
    fig.suptitle("KV-cache compressibility: realistic vs synthetic input, real vs dummy weights")
    save(fig, path)


def kv_layer_figure(layers: pd.DataFrame, dtype: str, codec: str, path: str | os.PathLike) -> None:
    sel = layers[(layers.dtype == dtype) & (layers.codec == codec)]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, part in zip(axes, ("K", "V")):
        agg = pooled_ratios(sel[sel.part == part], by=["corpus", "weights", "layer"])
        for (corpus, weights), series in agg.groupby(["corpus", "weights"]):
            ax.plot(series.layer, series.ratio, marker=".", label=f"{corpus} / {weights}")
        ax.set_title(f"{part}, {dtype}, {codec}")
        ax.set_xlabel("layer")
        ax.set_yscale("log")
    axes[0].set_ylabel("compression ratio")
    axes[1].legend(fontsize=7)
    save(fig, path)


def kv_chunk_figure(chunks: pd.DataFrame, dtype: str, codec: str, path: str | os.PathLike) -> None:
    sel = chunks[(chunks.dtype == dtype) & (chunks.codec == codec) & chunks.error.isna()]
    groups = sorted(sel.groupby(["corpus", "weights"]).groups)
    data = [sel[(sel.corpus == c) & (sel.weights == w)].ratio.to_numpy() for c, w in groups]
    fig, ax = plt.subplots(figsize=(1.4 * len(groups) + 2, 4))
    ax.boxplot(data, showfliers=True)
    ax.set_xticks(range(1, len(groups) + 1), [f"{c}\n{w}" for c, w in groups], fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("per-chunk compression ratio")
    ax.set_title(f"Ratio per LMCache-style chunk (K+V, all layers), {dtype}, {codec}")
    save(fig, path)


def system_figure(metrics: pd.DataFrame, path: str | os.PathLike) -> None:
    """TTFT, TPOT and measured compression ratio per method (model/method when the table holds
    several models), one bar group per context bucket."""
    ok = metrics[metrics.error.isna()]
    if metrics.model.nunique() > 1:
        ok = ok.assign(method=ok.model + "/" + ok.method)
    panels = [("ttft_s", "TTFT (s)"), ("tpot_s", "TPOT (s)"), ("ratio_end", "measured KV ratio vs full fp16")]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for ax, (column, label) in zip(axes, panels):
        table = ok.groupby(["method", "bucket"])[column].median().unstack("bucket")
        table.plot.bar(ax=ax, rot=45)
        ax.set_ylabel(label)
        ax.set_xlabel("")
    axes[2].axhline(1.0, color="grey", lw=0.8)
    fig.suptitle("Methods through one harness (median over prompts; errors excluded, see metrics.parquet)")
    save(fig, path)


def _heatmap(ax: plt.Axes, grid: pd.DataFrame, text: pd.DataFrame, cmap: str, title: str, **norm: object) -> None:
    image = ax.imshow(grid.to_numpy(dtype=float), cmap=cmap, aspect="auto", **norm)
    ax.set_xticks(range(grid.shape[1]), grid.columns, rotation=30, ha="right")
    ax.set_yticks(range(grid.shape[0]), grid.index)
    for (i, j), label in np.ndenumerate(text.to_numpy()):
        ax.text(j, i, label, ha="center", va="center", fontsize=7)
    ax.set_title(title, fontsize=10)
    plt.colorbar(image, ax=ax, shrink=0.8)


def _by_protocol(summary: pd.DataFrame) -> pd.DataFrame:
    """One heatmap column per category x protocol (`category` relabelled where there are two)."""
    if "protocol" not in summary or summary.protocol.nunique() < 2:
        return summary
    return summary.assign(category=summary.category + "\n" + summary.protocol)


def quality_score_figure(summary: pd.DataFrame, reference: str, path: str | os.PathLike) -> None:
    """Score per method x category (x protocol): colour = difference to the reference, text = the score."""
    summary = _by_protocol(summary)
    score = summary.pivot(index="method", columns="category", values="score_mean")
    delta = summary.pivot(index="method", columns="category", values="score_delta")
    order = [reference] + [m for m in summary.method.drop_duplicates() if m != reference]
    score, delta = score.loc[order], delta.loc[order, score.columns]
    limit = max(float(np.nanmax(np.abs(delta.to_numpy(dtype=float)))), 0.05) if delta.notna().any().any() else 1.0
    text = score.map(lambda v: "err" if v != v else f"{v:.2f}")
    fig, ax = plt.subplots(figsize=(1.3 * score.shape[1] + 3, 0.45 * score.shape[0] + 1.8))
    _heatmap(
        ax,
        delta,
        text,
        "RdBu",
        f"Task score per method (text) and its difference to {reference} (colour)",
        vmin=-limit,
        vmax=limit,
    )
    save(fig, path)


def quality_fidelity_figure(summary: pd.DataFrame, path: str | os.PathLike) -> None:
    """Mean next-token KL(full || method) and top-1 agreement, teacher-forced, per method x category
    (x protocol)."""
    sel = _by_protocol(summary[summary.kl_mean.notna()])
    kl = sel.pivot(index="method", columns="category", values="kl_mean")
    top1 = sel.pivot(index="method", columns="category", values="top1_agreement")
    kl, top1 = kl.loc[sel.method.drop_duplicates()], top1.loc[sel.method.drop_duplicates(), kl.columns]
    fig, axes = plt.subplots(1, 2, figsize=(2.4 * kl.shape[1] + 5, 0.45 * kl.shape[0] + 1.8))
    positive = kl.where(kl > 0)
    floor = float(np.nanmin(positive.to_numpy(dtype=float))) if positive.notna().any().any() else 1e-4
    _heatmap(
        axes[0],
        kl.clip(lower=floor),
        kl.map(lambda v: f"{v:.3g}"),
        "magma_r",
        "mean KL(full || method), nats",
        norm=matplotlib.colors.LogNorm(vmin=floor, vmax=max(float(np.nanmax(kl.to_numpy(dtype=float))), floor * 10)),
    )
    _heatmap(axes[1], top1, top1.map(lambda v: f"{v:.2f}"), "viridis", "top-1 agreement with full", vmin=0, vmax=1)
    fig.suptitle("Fidelity to the full cache, teacher-forced on its greedy continuation")
    save(fig, path)


def quality_ratio_figure(summary: pd.DataFrame, reference: str, path: str | os.PathLike) -> None:
    """Mean score over categories and mean KL vs the measured compression ratio, one point per method."""
    overall = summary[summary.category == "all"]
    if "protocol" not in overall:
        overall = overall.assign(protocol="query-aware")
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    colours = dict(zip(sorted(overall.protocol.unique()), ("#1f3b73", "#c4512d", "#4a8c3f")))
    for ax, column, label in (
        (axes[0], "score_mean", "mean task score over all samples"),
        (axes[1], "kl_mean", "mean KL(full || method), nats"),
    ):
        sel = overall[overall[column].notna() & (overall[column] > 0 if column == "kl_mean" else True)]
        for protocol, part in sel.groupby("protocol"):
            ax.scatter(part.ratio_end_mean, part[column], color=colours[protocol], label=protocol)
        if len(colours) > 1:
            ax.legend(fontsize=8)
        for row in sel.itertuples():
            ax.annotate(
                row.method,
                (row.ratio_end_mean, getattr(row, column)),
                fontsize=8,
                xytext=(4, 3),
                textcoords="offset points",
            )
        ax.set_xlabel("measured KV compression ratio vs a 16-bit full cache")
        ax.set_ylabel(label)
    axes[1].set_yscale("log")
    fig.suptitle(f"Quality vs measured compression ({reference} is the reference)")
    save(fig, path)

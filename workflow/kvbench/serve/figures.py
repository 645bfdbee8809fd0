"""Figures of the serve stage (PNG, written atomically through kvbench.plots.save)."""

from __future__ import annotations

import os

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from kvbench.plots import save

CORPUS_COLORS = {"realistic": "#1b9e77", "synthetic": "#d95f02", "imported": "#7570b3"}


def _label(backend: str, codec: str) -> str:
    if codec == "all":
        return f"{backend}\nshared warm-up\n(stores all codecs)"
    return backend if codec == "-" else f"{backend}\n{codec}"


def ttft_figure(offload: pd.DataFrame, path: str | os.PathLike) -> None:
    """Query-round TTFT on hits (KV really loaded) and misses, and warm-up TTFT, per backend (and
    codec), one panel per corpus. The valkey warm-up, which stores every codec at once, is its own
    bar, not any codec's."""
    ok = offload[offload.status == "ok"] if "status" in offload else offload
    corpora = sorted(set(ok.corpus))
    fig, axes = plt.subplots(
        len(corpora),
        1,
        figsize=(max(8, 0.9 * ok.groupby(["backend", "codec"]).ngroups + 3), 3.6 * len(corpora)),
        squeeze=False,
        sharey=True,
    )
    for ax, corpus in zip(axes[:, 0], corpora):
        sel = ok[ok.corpus == corpus].reset_index(drop=True)
        x = np.arange(len(sel))
        for offset, column, label, color in (
            (-0.27, "ttft_warmup_mean_s", "warm-up", "#bbbbbb"),
            (0.0, "ttft_miss_mean_s", "query miss", "#d95f02"),
            (0.27, "ttft_hit_mean_s", "query hit", "#1b9e77"),
        ):
            ax.bar(x + offset, sel[column], width=0.27, label=label, color=color)
        ax.set_xticks(x, [_label(b, c) for b, c in zip(sel.backend, sel.codec)], fontsize=7)
        ax.set_ylabel("mean TTFT (s)")
        ax.set_title(f"{corpus} documents")
        ax.legend(fontsize=7)
    fig.suptitle("Time to first token per KV backend: warm-up, query-round misses and hits (client-side)")
    fig.tight_layout()
    save(fig, path)


def wire_figure(offload: pd.DataFrame, path: str | os.PathLike) -> None:
    """Bytes on the wire per codec: compression ratio of what the connector stored, realistic vs
    synthetic documents, with the kv stage's prediction for the same dtype and codec."""
    sel = offload[(offload.backend == "valkey") & offload.ratio.notna()] if "ratio" in offload else offload.iloc[:0]
    codecs = list(dict.fromkeys(sel.codec))
    corpora = sorted(set(sel.corpus))
    fig, ax = plt.subplots(figsize=(1.1 * len(codecs) * max(1, len(corpora)) + 3, 4.5))
    width = 0.8 / max(1, len(corpora))
    for i, corpus in enumerate(corpora):
        rows = sel[sel.corpus == corpus].set_index("codec").reindex(codecs)
        x = np.arange(len(codecs)) + (i - (len(corpora) - 1) / 2) * width
        bars = ax.bar(
            x, rows.ratio, width=width, color=CORPUS_COLORS.get(corpus), label=f"{corpus}: measured on the wire"
        )
        ax.bar_label(bars, labels=[f"{r:.3g}" for r in rows.ratio], fontsize=6)
        if "predicted_ratio" in rows:
            ax.scatter(
                x,
                rows.predicted_ratio,
                marker="D",
                color="black",
                s=22,
                zorder=3,
                label="kv stage prediction" if i == 0 else None,
            )
    ax.set_xticks(np.arange(len(codecs)), codecs, rotation=20, fontsize=8)
    ax.set_yscale("log")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_ylabel("raw bytes / bytes on the wire")
    ax.set_title("KV offload through Valkey: compression on a serving engine, realistic vs synthetic documents")
    ax.legend(fontsize=7)
    save(fig, path)


def hit_path_figure(offload: pd.DataFrame, path: str | os.PathLike) -> None:
    """Where a valkey hit's TTFT goes: lookup, GET, decode, copy into the cache, and the rest
    (the forward pass over the uncached tail, queueing, HTTP), per codec and corpus."""
    sel = offload[(offload.backend == "valkey") & offload.get("hit_get_mean_s", pd.Series(dtype=float)).notna()]
    parts = [
        ("hit_lookup_mean_s", "lookup"),
        ("hit_get_mean_s", "GET"),
        ("hit_decode_mean_s", "decode"),
        ("hit_copy_mean_s", "copy into cache"),
        ("hit_rest_mean_s", "forward + rest"),
    ]
    labels = [f"{c}\n{corpus}" for c, corpus in zip(sel.codec, sel.corpus)]
    fig, ax = plt.subplots(figsize=(0.8 * len(labels) + 3, 4.5))
    bottom = np.zeros(len(sel))
    for column, name in parts:
        values = sel[column].fillna(0).to_numpy()
        ax.bar(range(len(sel)), values, bottom=bottom, label=name)
        bottom += values
    recompute = offload[
        (offload.backend == "recompute") & offload.get("ttft_hit_mean_s", pd.Series(dtype=float)).notna()
    ]
    for corpus, ttft in zip(recompute.corpus, recompute.ttft_hit_mean_s):
        ax.axhline(ttft, ls="--", lw=1, color=CORPUS_COLORS.get(corpus), label=f"recompute TTFT, {corpus}")
    ax.set_xticks(range(len(sel)), labels, fontsize=7)
    ax.set_ylabel("mean TTFT of a hit (s)")
    ax.set_title("The valkey hit path, broken down")
    ax.legend(fontsize=7)
    save(fig, path)

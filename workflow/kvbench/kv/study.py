"""The compressibility study for one corpus x weights variant: capture, store, compress, measure."""

from __future__ import annotations

import math
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import pandas as pd
import torch

from kvbench.kv.capture import capture_kv
from kvbench.kv.codecs import get_codec
from kvbench.kv.measure import measure
from kvbench.kv.storage import Stored, store


@dataclass(frozen=True)
class KVSettings:
    context_tokens: int
    docs_per_corpus: int
    dtypes: tuple[str, ...]
    codecs: tuple[str, ...]
    detail_dtypes: tuple[str, ...]
    detail_codecs: tuple[str, ...]
    chunk_tokens: int
    repeats: int


def kv_settings(cfg: dict[str, Any], **override: Any) -> KVSettings:
    """KVSettings from the `kv` config section (lists become tuples), with overrides."""
    fields = {name: cfg[name] for name in KVSettings.__dataclass_fields__} | override
    return KVSettings(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})


def pick_documents(docs: pd.DataFrame, n: int) -> pd.DataFrame:
    """The first `n` documents, round-robin over domains, then doc types, then copies."""
    ranked = docs.assign(
        _copy=docs.groupby("doc_type").cumcount(),
        _type=docs.groupby("domain")["doc_type"].rank(method="dense"),
    )
    order = ranked.sort_values(["_copy", "_type", "domain", "doc_id"])
    return order.head(n).drop(columns=["_copy", "_type"]).reset_index(drop=True)


def _codec_rows(
    data: bytes, itemsize: int, codecs: tuple[str, ...], repeats: int, key: dict[str, Any]
) -> list[dict[str, Any]]:
    return [{**key, "codec": name, **measure(data, get_codec(name, itemsize), repeats)} for name in codecs]


def value_stats(stored: Stored) -> dict[str, Any]:
    """What the stored values are like: distinct patterns, magnitude, saturation and underflow."""
    return {
        "values": stored.values,
        "unique_values": stored.unique_values,
        "mean_abs": stored.mean_abs,
        "clipped": stored.clipped,
        "below_normal": stored.below_normal,
        "flushed_to_zero": stored.flushed_to_zero,
    }


def document_rows(
    keys: torch.Tensor, values: torch.Tensor, settings: KVSettings, key: dict[str, Any]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """Rows for the whole cache (per part), per layer, and per LMCache-style chunk."""
    whole, layers, chunks = [], [], []
    parts = {"K": keys, "V": values}
    for dtype in settings.dtypes:
        for part, tensor in parts.items():
            stored = store(tensor, dtype)
            whole += _codec_rows(
                stored.data,
                stored.itemsize,
                settings.codecs,
                settings.repeats,
                {**key, "dtype": dtype, "part": part, **value_stats(stored)},
            )
        if dtype not in settings.detail_dtypes:
            continue
        for part, tensor in parts.items():
            for layer in range(tensor.shape[0]):
                stored = store(tensor[layer], dtype)
                layers += _codec_rows(
                    stored.data,
                    stored.itemsize,
                    settings.detail_codecs,
                    1,
                    {**key, "dtype": dtype, "part": part, "layer": layer, **value_stats(stored)},
                )
        # An LMCache chunk holds K and V of every layer for chunk_tokens consecutive tokens.
        n_tokens = keys.shape[1]
        for index in range(math.ceil(n_tokens / settings.chunk_tokens)):
            span = slice(index * settings.chunk_tokens, (index + 1) * settings.chunk_tokens)
            stored = store(torch.stack([keys[:, span], values[:, span]]), dtype)
            chunks += _codec_rows(
                stored.data,
                stored.itemsize,
                settings.detail_codecs,
                1,
                {
                    **key,
                    "dtype": dtype,
                    "chunk": index,
                    "chunk_tokens": min(n_tokens, (index + 1) * settings.chunk_tokens) - span.start,
                },
            )
    return whole, layers, chunks


def run_study(
    model: torch.nn.Module,
    encode: Callable[[str], list[int]],
    docs: pd.DataFrame,
    settings: KVSettings,
    weights: str,
) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """All rows for one weights variant; a document that fails gets one row with its error."""
    whole, layers, chunks = [], [], []
    chosen = pick_documents(docs, settings.docs_per_corpus)
    for i, doc in enumerate(chosen.itertuples(index=False), start=1):
        key = {
            "corpus": doc.corpus,
            "domain": doc.domain,
            "doc_type": doc.doc_type,
            "doc_id": doc.doc_id,
            "weights": weights,
        }
        start = time.monotonic()
        try:
            ids = encode(doc.text)[: settings.context_tokens]
            keys, values = capture_kv(model, ids)
            capture_s = time.monotonic() - start
            key |= {"tokens": len(ids), "layers": keys.shape[0], "capture_s": capture_s}
            w, per_layer, c = document_rows(keys, values, settings, key)
            del keys, values
        except Exception as err:  # recorded, never dropped: OOM or a model failure on this doc
            traceback.print_exc()
            whole.append({**key, "error": f"{type(err).__name__}: {err}"})
            continue
        whole, layers, chunks = whole + w, layers + per_layer, chunks + c
        print(
            f"[kv] {weights} {i}/{len(chosen)} {doc.doc_id}: {len(ids)} tokens, capture {capture_s:.1f} s, "
            f"total {time.monotonic() - start:.1f} s",
            file=sys.stderr,
            flush=True,
        )
    return pd.DataFrame(whole), pd.DataFrame(layers), pd.DataFrame(chunks)


def long_document(docs: pd.DataFrame, encode: Callable[[str], list[int]], tokens: int) -> pd.DataFrame:
    """One document of at least `tokens` tokens, made by joining realistic documents in order."""
    text, n = "", 0
    for doc_text in docs.sort_values("doc_id").text:
        text += doc_text + "\n\n"
        n = len(encode(text))
        if n >= tokens:
            return pd.DataFrame(
                [
                    {
                        "doc_id": f"joined-{tokens}",
                        "corpus": "realistic",
                        "domain": "mixed",
                        "doc_type": "joined",
                        "text": text,
                    }
                ]
            )
    raise ValueError(f"the corpus has only {n} tokens; the memory probe needs {tokens}")

"""Tables of the serve stage: requests joined with the connector's transfers, outputs against
recompute, and per backend x codec x corpus the offload figures next to the kv stage's prediction."""

from __future__ import annotations

import numpy as np
import pandas as pd

from kvbench.kv.summary import pooled_ratios

# vLLM's cache dtype names -> the kv stage's storage dtype names
KV_DTYPE = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3"}
# bytes per element of vLLM's --dtype (auto: the 16-bit dtype of the model's config)
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "auto": 2}
PREDICTION_TOLERANCE = 0.20
KEY = ["backend", "codec", "corpus"]


def _last(events: pd.DataFrame, kind: str, columns: dict[str, str]) -> pd.DataFrame:
    """Per tag, the last event of `kind` (a request is scheduled once; a rescheduled one logs again)."""
    if events.empty or "event" not in events:
        return pd.DataFrame(columns=["tag", *columns.values()])
    sel = events[events.event == kind].sort_values("time").groupby("tag").tail(1)
    return sel[["tag", *columns]].rename(columns=columns)


def join_transfers(requests: pd.DataFrame, transfers: pd.DataFrame) -> pd.DataFrame:
    """Per request: its lookup and load (the hit path) and the sum of its stores over codecs."""
    lookup = _last(transfers, "lookup", {"seconds": "lookup_s", "hit_chunks": "hit_chunks", "error": "lookup_error"})
    load = _last(
        transfers,
        "load",
        {
            "get_s": "load_get_s",
            "decode_s": "load_decode_s",
            "copy_s": "load_copy_s",
            "loaded_chunks": "loaded_chunks",
            "failed_chunks": "failed_chunks",
            "error": "load_error",
        },
    )
    out = requests.merge(lookup, on="tag", how="left").merge(load, on="tag", how="left")
    if not transfers.empty and "event" in transfers:
        stores = transfers[transfers.event == "store"].copy()
        stores["store_s"] = stores[["gather_s", "encode_s", "set_s"]].sum(axis=1, min_count=1)
        agg = stores.groupby("tag").agg(store_s=("store_s", "sum"), store_errors=("error", "count"))
        out = out.merge(agg, left_on="tag", right_index=True, how="left")
    for col in ("store_s", "store_errors"):
        if col not in out:
            out[col] = np.nan
    # what the hit path leaves for the forward pass, queueing and HTTP
    out["ttft_rest_s"] = out.ttft_s - out[["lookup_s", "load_get_s", "load_decode_s", "load_copy_s"]].fillna(0).sum(
        axis=1
    )
    out["lookup_failed"] = out.lookup_error.notna()
    out["load_failed"] = out.load_error.notna() | (out.failed_chunks.fillna(0) > 0)
    out["kv_failed"] = out.lookup_failed | out.load_failed
    # what vLLM counted as loaded is no evidence (it keeps cached_tokens after a failed load)
    out["kv_loaded"] = (pd.to_numeric(out.loaded_chunks).fillna(0) > 0) & ~out.kv_failed.astype(bool)
    return out


def compare_outputs(requests: pd.DataFrame) -> pd.DataFrame:
    """`output_matches_recompute`: the output equals recompute's for the same prompt (the same
    document without a miss prefix) on the same run; NA where there is no reference."""
    ok = requests[requests.error.isna()] if "error" in requests else requests
    ref = (
        ok[(ok.backend == "recompute") & ~ok.miss.astype(bool)]
        .groupby(["corpus", "doc_id"])
        .output.agg(lambda s: s.iloc[0] if s.nunique() == 1 else None)
    )
    out = requests.copy()
    misses = out.miss.astype("boolean").fillna(True)
    refs = [ref.get((c, d)) if not m else None for c, d, m in zip(out.corpus, out.doc_id, misses)]
    out["output_matches_recompute"] = pd.array(
        [None if r is None or o is None else o == r for o, r in zip(out.output, refs)], dtype="boolean"
    )
    return out


def prediction(kv: pd.DataFrame, dtype: str) -> pd.DataFrame:
    """The kv stage's pooled ratio (real weights, K and V together) per corpus x codec at `dtype`."""
    sel = kv[(kv.weights == "real") & (kv.dtype == KV_DTYPE.get(dtype, dtype))]
    if sel.empty:
        return pd.DataFrame(columns=["corpus", "codec", "predicted_ratio", "predicted_docs"])
    pooled = pooled_ratios(sel, by=["corpus", "codec"])
    return pooled.rename(columns={"ratio": "predicted_ratio", "docs": "predicted_docs"})[
        ["corpus", "codec", "predicted_ratio", "predicted_docs"]
    ]


def _mean(series: pd.Series) -> float:
    return float(series.mean()) if series.notna().any() else float("nan")


def _mb_s(raw: float, seconds: float) -> float:
    return raw / 1e6 / seconds if seconds > 0 else float("nan")


def effective_hits(query: pd.DataFrame, backend: str) -> pd.Series:
    """Planned hits (no miss prefix) whose prefix really came from the backend's cache: for valkey a
    load that moved chunks and did not fail; for vLLM's own caches and the example connector
    cached tokens reported by vLLM; for recompute every planned hit (the same prompts recomputed)."""
    planned = ~query.miss.astype(bool)
    if backend == "recompute":
        return planned
    if backend == "valkey":
        return planned & query.kv_loaded.astype(bool)
    return planned & (query.cached_tokens.fillna(0) > 0)


def _wire(events: pd.DataFrame, hits: pd.DataFrame) -> dict:
    """Stored bytes and throughput of one codec (the warm-up's stores of every codec included),
    loads of the query round, the warm-up's store cost of this codec, and the mean hit path."""
    stores = events[(events.event == "store") & events.error.isna()]
    warm = stores[stores["round"] == "warmup"]
    warm_store_s = (warm.encode_s + warm.set_s).groupby(warm.tag).sum()
    loads = events[(events.event == "load") & (events["round"] == "query")]
    raw, wire = stores.raw_bytes.sum(), stores.wire_bytes.sum()
    loaded = loads.raw_bytes.sum()
    return {
        "stored_chunks": int(stores.chunks.sum()),
        "raw_bytes": int(raw),
        "wire_bytes": int(wire),
        "ratio": raw / wire if wire else float("nan"),
        "encode_mb_s": _mb_s(raw, stores.encode_s.sum()),
        "store_mb_s": _mb_s(raw, (stores.encode_s + stores.set_s).sum()),
        "decode_mb_s": _mb_s(loaded, loads.decode_s.sum()),
        "load_mb_s": _mb_s(loaded, (loads.get_s + loads.decode_s + loads.copy_s).sum()),
        "warmup_store_mean_s": _mean(warm_store_s),
        "hit_lookup_mean_s": _mean(hits.lookup_s),
        "hit_get_mean_s": _mean(hits.load_get_s),
        "hit_decode_mean_s": _mean(hits.load_decode_s),
        "hit_copy_mean_s": _mean(hits.load_copy_s),
        "hit_rest_mean_s": _mean(hits.ttft_rest_s),
    }


def offload_table(
    requests: pd.DataFrame, transfers: pd.DataFrame, metrics: pd.DataFrame, kv: pd.DataFrame, dtype: str
) -> pd.DataFrame:
    """One row per backend x codec x corpus. The valkey warm-up stored every codec at once: its TTFT
    is one row of its own (codec `all`), not any codec's; each codec's row carries its share of
    that warm-up's store cost, and the warm-up's stores count towards each codec's bytes."""
    events = pd.DataFrame(columns=["tag", "event", "codec"])
    if not transfers.empty and "event" in transfers:
        events = transfers.merge(requests[["tag", "backend", "corpus", "round"]], on="tag", how="inner")
    rows = []
    for (backend, codec, corpus), group in requests.groupby(KEY, sort=False):
        row: dict = {"backend": backend, "codec": codec, "corpus": corpus}
        if group["round"].isna().all():  # a backend this machine cannot run
            rows.append({**row, "status": group.error.iloc[0]})
            continue
        warm = requests[
            (requests.backend == backend)
            & (requests.corpus == corpus)
            & (requests["round"] == "warmup")
            & (requests.codec == codec)
        ]
        query = group[group["round"] == "query"]
        hit = effective_hits(query, backend)
        hits, misses = query[hit], query[query.miss.astype(bool)]
        identical = hits.output_matches_recompute.astype("Float64")
        failed = int(group.error.notna().sum())
        row |= {
            "status": "ok" if not failed else f"{failed} requests failed",
            "requests": len(group),
            "query_hits": len(hits),
            "hits_not_loaded": int((~hit & ~query.miss.astype(bool)).sum()),
            "query_misses": len(misses),
            "fault_requests": int((group["round"] == "fault").sum()),
            "ttft_warmup_mean_s": _mean(warm.ttft_s),
            "ttft_query_mean_s": _mean(query.ttft_s),
            "ttft_hit_mean_s": _mean(hits.ttft_s),
            "ttft_miss_mean_s": _mean(misses.ttft_s),
            "cached_tokens_hit_mean": _mean(hits.cached_tokens),
            "outputs_identical_share": _mean(identical),
            "outputs_compared": int(identical.notna().sum()),
            "lookup_errors": int(group.lookup_failed.sum()),
            "load_failures": int(group.load_failed.sum()),
        }
        if backend == "valkey":
            mine = events[(events.backend == "valkey") & (events.corpus == corpus) & (events.codec == codec)]
            row |= _wire(mine, hits)
        if backend == "example" and "disk_bytes_written" in metrics:
            written = metrics[(metrics.backend == backend) & (metrics.corpus == corpus)].disk_bytes_written
            row |= {"wire_bytes": int(written.sum())}
        rows.append(row)
    table = pd.DataFrame(rows)
    table["dtype"] = KV_DTYPE.get(dtype, dtype)
    table = table.merge(prediction(kv, dtype), on=["corpus", "codec"], how="left")
    if "ratio" in table:
        # the same stored bytes against the cache held at 16 bits (the usual serving dtype)
        table["ratio_vs_16bit"] = table.ratio * 2 / DTYPE_BYTES[dtype]
        table["ratio_vs_prediction"] = table.ratio / table.predicted_ratio
        gap = (table.ratio_vs_prediction - 1).abs()
        table["within_20pct"] = pd.array(
            [None if np.isnan(g) else bool(g <= PREDICTION_TOLERANCE) for g in gap], dtype="boolean"
        )
    return table


def summary_text(offload: pd.DataFrame, metrics: pd.DataFrame) -> str:
    """Plain-text digest for the job log."""
    lines = ["serve: backend x codec x corpus (mean TTFT in s; ratio = raw / wire bytes)"]
    for row in offload.itertuples():
        if str(row.status).startswith("unsupported"):
            lines.append(f"  {row.backend:<9} {row.codec:<17} {row.corpus:<9} {row.status}")
            continue
        if row.codec == "all":
            lines.append(
                f"  {row.backend:<9} {'(all codecs)':<17} {row.corpus:<9} shared warm-up that stored every "
                f"codec: {row.ttft_warmup_mean_s:6.2f}"
            )
            continue
        ratio = getattr(row, "ratio", float("nan"))
        pred = getattr(row, "predicted_ratio", float("nan"))
        lines.append(
            f"  {row.backend:<9} {row.codec:<17} {row.corpus:<9} warm-up {row.ttft_warmup_mean_s:6.2f}  "
            f"hit {row.ttft_hit_mean_s:6.2f} ({row.query_hits:.0f} loaded, {row.hits_not_loaded:.0f} not)  "
            f"miss {row.ttft_miss_mean_s:6.2f}  ratio {ratio:6.2f} (kv stage {pred:5.2f})  "
            f"identical {row.outputs_identical_share:.2f} of {row.outputs_compared:.0f}  "
            f"lookup errors {row.lookup_errors:.0f}  load failures {row.load_failures:.0f}  [{row.status}]"
        )
    if not metrics.empty and "server_ttft_mean_s" in metrics:
        gap = (metrics.client_ttft_mean_s / metrics.server_ttft_mean_s - 1).abs()
        pooled = client_vs_server(metrics)
        lines.append(
            f"client vs server mean TTFT: {pooled:+.1%} over all {int(metrics.requests.sum())} requests; "
            f"per round at most {gap.max():.1%} ({len(metrics)} rounds)"
        )
    return "\n".join(lines)


def client_vs_server(metrics: pd.DataFrame) -> float:
    """Client mean TTFT over the server histogram's mean, - 1, pooled over every round's requests."""
    client = (metrics.client_ttft_mean_s * metrics.requests).sum() / metrics.requests.sum()
    server = metrics.server_ttft_sum_s.sum() / metrics.server_ttft_count.sum()
    return float(client / server - 1)

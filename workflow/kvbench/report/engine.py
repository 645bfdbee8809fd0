"""Engine quality (results/report/engine.parquet): the quality tasks on vLLM's own quantized KV
caches (stage quality_served), with intervals, labelled as the engine's.

Per model x server, over the samples it scored:
- against the engine's 16-bit server (`against` = the reference server): the task score's paired
  difference, and KL, first-token KL, top-1 agreement and decode-time KL each paired with the
  reference server's own value on the same sample (its second run against its first: the engine's
  run-to-run noise, so a difference is one beyond it);
- against the harness's method the cache is nearest to (kvbench.vllm_native.NativeKV.harness, where
  the run has it): each side against its own reference (engine vs its 16-bit server, harness vs
  the report's baseline), paired by sample: the score change's difference (a difference of
  differences) and the fidelity's difference, read where each side's cache is read (`NATIVE_VIEW`).

One bootstrap per model x server (its units: the samples either side has; documents where the
harness's samples share them), so every row of the cell sees the same draws. What differs between
the two sides is in `note`.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import pandas as pd

from kvbench.report.bootstrap import Estimate, Interval, Resample, rng_for
from kvbench.report.contracts import CONTEXT_ONLY, QUERY_AWARE, Tables
from kvbench.vllm_native import NATIVE_KV

ENGINE_COLUMNS = [
    "model",
    "server",
    "kv_cache_dtype",
    "served_dtype",
    "against",
    "against_kind",
    "protocol",
    "quantity",
    "value",
    "value_low",
    "value_high",
    "against_value",
    "difference",
    "ci_low",
    "ci_high",
    "n",
    "samples",
    "failed",
    "p_value",
    "verdict",
    "note",
    "level",
    "bootstrap",
    "bootstrap_seed",
]
# quantity -> the positions it is pooled over (weights), as the harness pools them
FIDELITY = {
    "kl_mean": "positions",
    "kl_first": None,
    "top1_agreement": "positions",
    "decode_kl_mean": "decode_positions",  # the engine's alone: steps generated before the first divergence
}
HARNESS_OF = {kv.label: kv.harness for kv in NATIVE_KV if kv.harness}
# The harness's protocol an engine cache is compared with, the nearest first, and the engine's
# quantity that reads its cache as the harness's kl_mean reads the method's. A cache whose forced
# positions read it (fp8 and most backends: K/V quantized as written, the prefill reads them) is
# nearest to context-only (the question reads the quantized context); one whose prefill attends to
# the raw K/V (TurboQuant: `fidelity_note`) is nearest to query-aware, read at its decode steps.
PROTOCOL_NOTE = {
    CONTEXT_ONLY: "the context's cache compressed after a full-precision prefill, the question through it",
    QUERY_AWARE: "compressed after a full-precision prefill of the whole prompt: its first answer token is "
    "full precision's",
}
NATIVE_VIEW = {
    False: ((CONTEXT_ONLY, QUERY_AWARE), {q: q for q in ("kl_mean", "kl_first", "top1_agreement")}),
    True: ((QUERY_AWARE, CONTEXT_ONLY), {"decode_kl_mean": "kl_mean"}),
}
UNIT = ["task", "sample"]
PER_SAMPLE = ("score", "positions", "decode_positions", *FIDELITY)  # each side's columns, and its reference's


def verdict(iv: Interval) -> str:
    """What the interval decides about a difference from 0."""
    if iv.low != iv.low:
        return f"no interval at n = {iv.n}"
    if iv.direction == 0:
        return f"inconclusive at n = {iv.n}: the interval holds 0"
    return "higher" if iv.direction > 0 else "lower"


def _engine_rows(served: pd.DataFrame) -> pd.DataFrame:
    """The served table's sample rows, each with its reference server's values on the same sample
    (`ref_<column>`)."""
    rows = served[served["sample"].notna()].copy()
    rows["sample"] = rows["sample"].astype(str)
    keys = ["model", *UNIT]
    ref = rows[rows.server == rows.reference_server].drop_duplicates(keys).set_index(keys)
    where = pd.MultiIndex.from_frame(rows[keys])
    for column in PER_SAMPLE:
        rows[f"ref_{column}"] = ref[column].reindex(where).to_numpy(float)
    return rows


def _side(frame: pd.DataFrame, prefix: str) -> pd.DataFrame:
    """One side's per-sample columns, indexed by (task, sample)."""
    columns = [c for column in PER_SAMPLE for c in (column, f"ref_{column}")]
    out = frame.drop_duplicates(UNIT).set_index(UNIT)
    return out.reindex(columns=columns).astype(float).add_prefix(f"{prefix}_")


def engine_table(
    tables: Tables,
    paired: pd.DataFrame | None,
    baseline: str,
    n_boot: int,
    seed: int,
    level: float,
    harness: Mapping[str, Any] | None = None,
) -> pd.DataFrame:
    """One row per model x server (not the reference) x comparison x quantity that has data.
    `harness`: the quality config's compute_dtype, reference_top_k and fidelity_positions (notes)."""
    served = tables.get("quality_served")
    if served is None or not len(served):
        return pd.DataFrame(columns=ENGINE_COLUMNS)
    engine = _engine_rows(served)
    harness = harness or {}
    rows: list[dict] = []
    for (model, server), mine in served.groupby(["model", "server"], sort=False):
        first = mine.iloc[0]
        if server == first.reference_server:
            continue
        bypass = isinstance(first.get("fidelity_note"), str)
        protocols, view = NATIVE_VIEW[bypass]
        units = _side(engine[(engine.model == model) & (engine.server == server)], "e")
        method = HARNESS_OF.get(server)
        found, protocol = _harness_rows(paired, model, method, protocols)
        if found is not None:
            units = units.join(_side(found, "h"), how="outer")
        units = units.reset_index()
        documents = _documents(paired, model, units)
        rng = rng_for(seed, "engine", model, server)
        resample = (
            Resample.clustered(documents, n_boot, rng)
            if len(set(documents)) < len(documents)
            else Resample.of([len(units)], n_boot, rng)
        )
        head = {
            "model": model,
            "server": server,
            "kv_cache_dtype": first.kv_cache_dtype,
            "served_dtype": first.served_dtype,
            "failed": int(mine.score.isna().sum()),
            "level": level,
            "bootstrap": n_boot,
            "bootstrap_seed": seed,
        }
        engine_note = (
            f"vLLM --kv-cache-dtype {first.kv_cache_dtype} vs vLLM's {first.served_dtype} cache, same prompts "
            f"(not middle-truncated), greedy; KL over both servers' top-{_int(first.get('top_k'))} lists (a lower "
            "bound); each value paired with the 16-bit server's second run against its first"
        )
        if bypass:
            engine_note += f"; {first.fidelity_note}"
        for quantity in ("score", *FIDELITY):
            pair = _pair(units, ("e", quantity), ("e", f"ref_{quantity}"))
            if pair is not None:
                rows.append(
                    _row(head, resample, quantity, *pair, level)
                    | {"against": first.reference_server, "against_kind": "engine reference", "note": engine_note}
                )
        if found is None:
            continue
        harness_note = (
            f"each against its own reference: the engine vs vLLM's {first.served_dtype} cache; the harness's "
            f"{method} vs {baseline} ({protocol} protocol: {PROTOCOL_NOTE[protocol]}; computed in "
            f"{harness.get('compute_dtype', 'its compute dtype')}; prompts middle-truncated to the harness's limit). "
            f"Both over at most {harness.get('fidelity_positions', 'the harness`s')} answer positions; KL: the "
            f"engine's over both servers' top-{_int(first.get('top_k'))} lists, the harness's over its reference's "
            f"top-{harness.get('reference_top_k', 'k')} (each a lower bound); score: the difference of the two score "
            f"changes. The cache: {first.get('difference') or '-'}"
        )
        if bypass:
            harness_note += f". {first.fidelity_note}: the engine's decode_kl_mean against the harness's kl_mean"
        comparisons = {"score_change": ("score_change", "score_change"), **{q: (q, h) for q, h in view.items()}}
        changes = {s: units[f"{s}_score"] - units[f"{s}_ref_score"] for s in ("e", "h")}
        units = units.assign(e_score_change=changes["e"], h_score_change=changes["h"])
        for quantity, (engine_column, harness_column) in comparisons.items():
            pair = _pair(units, ("e", engine_column), ("h", harness_column))
            if pair is not None:
                rows.append(
                    _row(head, resample, quantity, *pair, level)
                    | {"against": method, "against_kind": "harness method", "protocol": protocol}
                    | {"note": harness_note}
                )
    return pd.DataFrame(rows, columns=ENGINE_COLUMNS)


def _int(value: object) -> str:
    return str(int(value)) if isinstance(value, (int, float)) and value == value else "k"


Pair = tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]


def _pair(units: pd.DataFrame, mine: tuple[str, str], theirs: tuple[str, str]) -> Pair | None:
    """Two sides' per-unit values and weights (a column `ref_x` is weighted as `x`), or None where
    either side has no value at all."""
    values = [units[f"{side}_{column}"].to_numpy(float) for side, column in (mine, theirs)]
    if not all(np.isfinite(v).any() for v in values):
        return None
    weights = []
    for side, column in (mine, theirs):
        pooled = FIDELITY.get(column.removeprefix("ref_"))
        prefix = "ref_" if column.startswith("ref_") else ""
        weights.append(
            None if pooled is None else units[f"{side}_{prefix}{pooled}"].fillna(1.0).clip(lower=1.0).to_numpy()
        )
    return values[0], values[1], weights[0], weights[1]


def _row(
    head: dict,
    resample: Resample,
    quantity: str,
    value: np.ndarray,
    against: np.ndarray,
    value_weights: np.ndarray | None,
    against_weights: np.ndarray | None,
    level: float,
) -> dict:
    mine: Estimate = resample.mean(value, value_weights)
    theirs: Estimate = resample.mean(against, against_weights)
    both = mine.mask & theirs.mask  # paired: every number of the row on the samples both sides have
    mine, theirs = mine.restrict(both), theirs.restrict(both)
    difference = mine - theirs
    iv, value_iv = difference.interval(level), mine.interval(level)
    return head | {
        "quantity": quantity,
        "value": mine.estimate,
        "value_low": value_iv.low,
        "value_high": value_iv.high,
        "against_value": theirs.estimate,
        "difference": difference.estimate,
        "ci_low": iv.low,
        "ci_high": iv.high,
        "n": difference.n,
        "samples": difference.n if difference.n_units is None else difference.n_units,
        "p_value": iv.p_value,
        "verdict": verdict(iv),
    }


def _harness_rows(
    paired: pd.DataFrame | None, model: str, method: str | None, protocols: tuple[str, ...]
) -> tuple[pd.DataFrame | None, str]:
    """The harness method's samples under the first of `protocols` it ran."""
    for protocol in protocols:
        if paired is not None and method is not None:
            found = paired[(paired.model == model) & (paired.method == method) & (paired.protocol == protocol)]
            if len(found):
                return found, protocol
    return None, ""


def _documents(paired: pd.DataFrame | None, model: str, units: pd.DataFrame) -> np.ndarray:
    """Each unit's source document, from the harness's table where it has the sample, else the unit."""
    own = ("unit:" + units.task.astype(str) + "/" + units["sample"].astype(str)).to_numpy()
    if paired is None or "document" not in paired:
        return own
    known = paired[paired.model == model].drop_duplicates(UNIT).set_index(UNIT).document
    found = known.reindex(pd.MultiIndex.from_frame(units[UNIT])).to_numpy(object)
    return np.where(pd.isna(found), own, found).astype(str)

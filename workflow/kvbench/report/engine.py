"""Engine quality (results/report/engine.parquet): the quality tasks on vLLM's own quantized KV
caches (stage quality_served), with intervals, labelled as the engine's.

Per model x server, over the samples it scored:
- against the engine's 16-bit server (`against` = the reference server): the task score's paired
  difference, and KL, first-token KL, top-1 agreement and decode-time KL against that server's
  distributions (the reference's own values: 0, 0, 1 and 0);
- against the harness's method the cache is nearest to (kvbench.vllm_native.NativeKV.harness, where
  the run has it): each side against its own reference (engine vs its 16-bit server, harness vs
  the report's baseline), paired by sample: the score change's difference (a difference of
  differences) and the difference of KL, first-token KL and top-1 agreement.

One bootstrap per model x server (its units: the samples either side has; documents where the
harness's samples share them), so every row of the cell sees the same draws. What differs between
the two sides stays in `note`: the engine's prompts are not middle-truncated and its KL is taken
over both top-k lists (a lower bound), the harness computes in float32 over its own truncation.
"""

from __future__ import annotations

from typing import Callable

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
# quantity -> (the reference's own value, the positions it is pooled over, as the harness pools them);
# decode_kl_mean is the engine's alone (the steps generated before the first divergence)
FIDELITY = {
    "kl_mean": (0.0, "positions"),
    "kl_first": (0.0, None),
    "top1_agreement": (1.0, "positions"),
    "decode_kl_mean": (0.0, "decode_positions"),
}
HARNESS_OF = {kv.label: kv.harness for kv in NATIVE_KV if kv.harness}
SIDES = ("e", "h")  # engine, harness
# The harness's protocol the engine is compared with, the nearest first: the engine quantizes K/V as
# they are written, so the question and the first answer token already read the quantized context.
PROTOCOL_NOTE = {
    CONTEXT_ONLY: "the context's cache compressed after a full-precision prefill, the question through it",
    QUERY_AWARE: "compressed after a full-precision prefill of the whole prompt: its first answer token is "
    "full precision's, the engine's is not",
}


def verdict(iv: Interval) -> str:
    """What the interval decides about a difference from 0."""
    if iv.low != iv.low:
        return f"no interval at n = {iv.n}"
    if iv.direction == 0:
        return f"inconclusive at n = {iv.n}: the interval holds 0"
    return "higher" if iv.direction > 0 else "lower"


def _side(frame: pd.DataFrame, prefix: str) -> pd.DataFrame:
    """One side's per-sample columns, indexed by (task, sample)."""
    columns = ["score", "ref_score", "positions", "decode_positions", *FIDELITY]
    out = frame.drop_duplicates(["task", "sample"]).set_index(["task", "sample"])
    return out.reindex(columns=columns).astype(float).add_prefix(f"{prefix}_")


def _engine_rows(served: pd.DataFrame) -> pd.DataFrame:
    """The served table's sample rows, each with its reference server's score on the same sample."""
    rows = served[served["sample"].notna()].copy()
    rows["sample"] = rows["sample"].astype(str)
    ref = rows[rows.server == rows.reference_server].drop_duplicates(["model", "task", "sample"])
    ref = ref.set_index(["model", "task", "sample"]).score
    rows["ref_score"] = ref.reindex(pd.MultiIndex.from_frame(rows[["model", "task", "sample"]])).to_numpy(float)
    return rows


def engine_table(
    tables: Tables, paired: pd.DataFrame | None, baseline: str, n_boot: int, seed: int, level: float
) -> pd.DataFrame:
    """One row per model x server (not the reference) x comparison x quantity that has data."""
    served = tables.get("quality_served")
    if served is None or not len(served):
        return pd.DataFrame(columns=ENGINE_COLUMNS)
    engine = _engine_rows(served)
    rows: list[dict] = []
    for (model, server), mine in served.groupby(["model", "server"], sort=False):
        first = mine.iloc[0]
        if server == first.reference_server:
            continue
        units = _side(engine[(engine.model == model) & (engine.server == server)], "e")
        harness_method = HARNESS_OF.get(server)
        harness, protocol = _harness_rows(paired, model, harness_method)
        if harness is not None:
            units = units.join(_side(harness, "h"), how="outer")
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
            "(not middle-truncated), greedy; KL over both servers' top-k lists (a lower bound)"
        )
        if isinstance(first.get("fidelity_note"), str):
            engine_note += f"; {first.fidelity_note}"
        for quantity, (value, against, weights) in _against_reference(units).items():
            rows.append(
                _row(head, resample, quantity, value, against, weights, level)
                | {"against": first.reference_server, "against_kind": "engine reference", "note": engine_note}
            )
        if harness is None:
            continue
        harness_note = (
            f"each against its own reference: the engine vs vLLM's {first.served_dtype} cache; the harness's "
            f"{harness_method} vs {baseline} ({protocol} protocol: {PROTOCOL_NOTE[protocol]}; float32; prompts "
            "middle-truncated to the harness's limit); KL: the engine's over both top-k lists, the harness's over "
            "its reference's top-k; score: the difference of the two score changes"
        )
        for quantity, (value, against, weights) in _against_harness(units).items():
            rows.append(
                _row(head, resample, quantity, value, against, weights, level)
                | {"against": harness_method, "against_kind": "harness method", "protocol": protocol}
                | {"note": harness_note}
            )
    return pd.DataFrame(rows, columns=ENGINE_COLUMNS)


Pair = tuple[np.ndarray, np.ndarray, Callable[[str], np.ndarray | None]]


def _weights(units: pd.DataFrame, side: str, quantity: str) -> np.ndarray | None:
    pooled = FIDELITY[quantity][1]
    return None if pooled is None else units[f"{side}_{pooled}"].fillna(1.0).clip(lower=1.0).to_numpy()


def _against_reference(units: pd.DataFrame) -> dict[str, Pair]:
    """quantity -> (the engine's values, the reference's, weights by side)."""
    out: dict[str, Pair] = {}
    score = units.e_score.to_numpy(float)
    if np.isfinite(score).any():
        out["score"] = (score, units.e_ref_score.to_numpy(float), lambda side: None)
    for quantity, (own, _) in FIDELITY.items():
        values = units[f"e_{quantity}"].to_numpy(float)
        if np.isfinite(values).any():
            reference = np.where(np.isfinite(values), own, np.nan)
            out[quantity] = (values, reference, lambda side, q=quantity: _weights(units, "e", q))
    return out


def _against_harness(units: pd.DataFrame) -> dict[str, Pair]:
    """quantity -> (the engine's values, the harness method's, weights by side)."""
    out: dict[str, Pair] = {}
    changes = {s: (units[f"{s}_score"] - units[f"{s}_ref_score"]).to_numpy(float) for s in SIDES}
    if all(np.isfinite(c).any() for c in changes.values()):
        out["score_change"] = (changes["e"], changes["h"], lambda side: None)
    for quantity in FIDELITY:
        e, h = (units[f"{s}_{quantity}"].to_numpy(float) for s in SIDES)
        if np.isfinite(e).any() and np.isfinite(h).any():
            out[quantity] = (e, h, lambda side, q=quantity: _weights(units, side, q))
    return out


def _row(
    head: dict,
    resample: Resample,
    quantity: str,
    value: np.ndarray,
    against: np.ndarray,
    weights: Callable[[str], np.ndarray | None],
    level: float,
) -> dict:
    mine: Estimate = resample.mean(value, weights("e"))
    theirs: Estimate = resample.mean(against, weights("h"))
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


def _harness_rows(paired: pd.DataFrame | None, model: str, method: str | None) -> tuple[pd.DataFrame | None, str]:
    """The harness method's samples under the protocol nearest to the engine's (PROTOCOL_NOTE order)."""
    for protocol in PROTOCOL_NOTE:
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
    known = paired[paired.model == model].drop_duplicates(["task", "sample"]).set_index(["task", "sample"]).document
    found = known.reindex(pd.MultiIndex.from_frame(units[["task", "sample"]])).to_numpy(object)
    return np.where(pd.isna(found), own, found).astype(str)

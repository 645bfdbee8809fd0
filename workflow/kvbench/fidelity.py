"""Fidelity to the full cache: the method's next-token distributions teacher-forced on the full
cache's own greedy continuation, compared with the full cache's (stored once by the reference run).

The reference keeps each position's whole distribution, or (`top_k`, for large vocabularies on
long runs) its k most likely tokens: KL is then taken over those k tokens plus the rest as one
outcome, a lower bound of the exact KL (data-processing inequality) that is exact when the rest
carries no mass.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import torch

from kvbench.atomic import atomic_path


@dataclass(frozen=True)
class Reference:
    tokens: list[int]  # the full cache's greedy continuation
    logprobs: torch.Tensor | None  # [len(tokens), vocab or k] log-softmax behind each of them (None: tokens only)
    prompt_hash: str  # the prompt it answered (a method run must see the same prompt)
    indices: torch.Tensor | None = None  # [len(tokens), k] token ids of `logprobs` (None: the whole vocabulary)


def prompt_hash(ids: list[int]) -> str:
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]


def reference_from_logits(tokens: list[int], logits: torch.Tensor, ids: list[int], top_k: int | None) -> Reference:
    return reduced(Reference(tokens, torch.log_softmax(logits.float(), dim=-1), prompt_hash(ids)), top_k)


def reduced(reference: Reference, top_k: int | None) -> Reference:
    """`reference` keeping each position's `top_k` most likely tokens (None: unchanged)."""
    if top_k is None or reference.indices is not None or top_k >= reference.logprobs.shape[-1]:
        return reference
    top = reference.logprobs.topk(top_k, dim=-1)
    return Reference(reference.tokens, top.values, reference.prompt_hash, top.indices)


def kl_top1(reference: Reference, positions: slice, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """KL(full || method) and top-1 agreement at the reference's `positions`, from the method's logits
    there [n, V] (log-probabilities are logits too: log_softmax is idempotent)."""
    method = torch.log_softmax(logits.float(), dim=-1)
    full = reference.logprobs[positions].float()
    if reference.indices is not None:  # the reference's top k, and the rest as one outcome
        method = method.gather(-1, reference.indices[positions])
        full = torch.cat([full, torch.log1p(-full.exp().sum(-1, keepdim=True).clamp(max=1 - 1e-7))], dim=-1)
        method_rest = torch.log1p(-method.exp().sum(-1, keepdim=True).clamp(max=1 - 1e-7))
        method = torch.cat([method, method_rest], dim=-1)
    kl = (full.exp() * (full - method)).sum(dim=-1).clamp_min(0.0)  # rounding can dip below 0 by ~1e-7
    top1 = logits.argmax(dim=-1) == torch.tensor(reference.tokens[positions], device=logits.device)
    return kl, top1


def position_fidelity(reference: Reference, i: int, logits: torch.Tensor) -> tuple[float, bool]:
    """KL and top-1 agreement at position `i` from the method's distribution there [V]."""
    kl, top1 = kl_top1(reference, slice(i, i + 1), logits[None])
    return float(kl[0]), bool(top1[0])


def kl_top_lists(reference: Mapping[int, float], method: Mapping[int, float]) -> float:
    """KL(reference || method) at one position from two servers' returned log-probabilities (each
    a top-k list, token -> log-probability): over the tokens both lists hold, plus everything else
    as one outcome. A coarser partition than the vocabulary, so a lower bound of the exact KL
    (data-processing inequality), exact when the two lists hold every token with mass; 0 for the
    same list."""
    shared = [t for t in reference if t in method]
    p = [math.exp(reference[t]) for t in shared]
    q = [math.exp(method[t]) for t in shared]
    p_rest, q_rest = max(1.0 - sum(p), 0.0), max(1.0 - sum(q), 1e-7)  # kl_top1's clamp
    kl = sum(a * (math.log(a) - math.log(b)) for a, b in zip(p, q) if a > 0)
    if p_rest > 0:
        kl += p_rest * (math.log(p_rest) - math.log(q_rest))
    return max(kl, 0.0)


def summarize(kl: list[float], top1: list[bool]) -> dict[str, float | int | None]:
    """Per-sample fidelity from per-position values: position 0 (after the prompt) alone as `kl_first`,
    the decode positions (1 onwards) pooled; see `compare`."""
    decode_kl, decode_top1 = kl[1:], top1[1:]
    n = len(decode_kl)
    return {
        "kl_first": float(kl[0]) if kl else None,
        "kl_mean": sum(decode_kl) / n if n else None,
        "kl_max": max(decode_kl) if n else None,
        "top1_agreement": sum(decode_top1) / n if n else None,
        "fidelity_positions": n,
    }


def compare(reference: Reference, logits: torch.Tensor) -> dict[str, float | int | None]:
    """KL(full || method) per position and top-1 agreement over the reference's decode positions.

    Position 0 (the distribution after the prefill) is left out of `kl_mean`, `kl_max` and
    `top1_agreement`: every method prefills uncompressed, so it equals the full cache's by
    construction and would only dilute the comparison. It is reported alone as `kl_first` (a
    check: non-zero means a method changed its prefill). With a one-token reference there is no
    decode position: the pooled values are None and `fidelity_positions` is 0.
    """
    kl, top1 = kl_top1(reference, slice(0, len(reference.tokens)), logits)
    return summarize(kl.tolist(), top1.tolist())


def save_references(references: dict[str, Reference], path: str | Path) -> None:
    from safetensors.torch import save_file

    tensors, meta = {}, {}
    for key, ref in references.items():
        tensors[f"{key}::logprobs"] = ref.logprobs.float().contiguous()
        tensors[f"{key}::tokens"] = torch.tensor(ref.tokens, dtype=torch.int64)
        if ref.indices is not None:
            tensors[f"{key}::indices"] = ref.indices.contiguous()
        meta[key] = ref.prompt_hash
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata={"prompt_hashes": json.dumps(meta, sort_keys=True)})


def load_references(path: str | Path) -> dict[str, Reference]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        hashes = json.loads(handle.metadata()["prompt_hashes"])
        names = set(handle.keys())
        return {
            key: Reference(
                handle.get_tensor(f"{key}::tokens").tolist(),
                handle.get_tensor(f"{key}::logprobs"),
                h,
                handle.get_tensor(f"{key}::indices") if f"{key}::indices" in names else None,
            )
            for key, h in hashes.items()
        }

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
from dataclasses import dataclass
from pathlib import Path

import torch

from kvbench.atomic import atomic_path


@dataclass(frozen=True)
class Reference:
    tokens: list[int]  # the full cache's greedy continuation
    logprobs: torch.Tensor  # [len(tokens), vocab or k] log-softmax behind each of them
    prompt_hash: str  # the prompt it answered (a method run must see the same prompt)
    indices: torch.Tensor | None = None  # [len(tokens), k] token ids of `logprobs` (None: the whole vocabulary)


def prompt_hash(ids: list[int]) -> str:
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]


def reference_from_logits(tokens: list[int], logits: torch.Tensor, ids: list[int], top_k: int | None) -> Reference:
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    if top_k is None or top_k >= logprobs.shape[-1]:
        return Reference(tokens, logprobs, prompt_hash(ids))
    top = logprobs.topk(top_k, dim=-1)
    return Reference(tokens, top.values, prompt_hash(ids), top.indices)


def compare(reference: Reference, logits: torch.Tensor) -> dict[str, float | int | None]:
    """KL(full || method) per position and top-1 agreement over the reference's decode positions.

    Position 0 (the distribution after the prefill) is left out of `kl_mean`, `kl_max` and
    `top1_agreement`: every method prefills uncompressed, so it equals the full cache's by
    construction and would only dilute the comparison. It is reported alone as `kl_first` (a
    check: non-zero means a method changed its prefill). With a one-token reference there is no
    decode position: the pooled values are None and `fidelity_positions` is 0.
    """
    method = torch.log_softmax(logits.float(), dim=-1)
    full = reference.logprobs.float()
    if reference.indices is not None:  # the reference's top k, and the rest as one outcome
        method = method.gather(-1, reference.indices)
        full = torch.cat([full, torch.log1p(-full.exp().sum(-1, keepdim=True).clamp(max=1 - 1e-7))], dim=-1)
        method_rest = torch.log1p(-method.exp().sum(-1, keepdim=True).clamp(max=1 - 1e-7))
        method = torch.cat([method, method_rest], dim=-1)
    kl = (full.exp() * (full - method)).sum(dim=-1).clamp_min(0.0)  # rounding can dip below 0 by ~1e-7
    top1 = (logits.argmax(dim=-1) == torch.tensor(reference.tokens)).float()
    decode_kl, decode_top1 = kl[1:], top1[1:]
    n = len(decode_kl)
    return {"kl_first": float(kl[0]), "kl_mean": float(decode_kl.mean()) if n else None,
            "kl_max": float(decode_kl.max()) if n else None,
            "top1_agreement": float(decode_top1.mean()) if n else None, "fidelity_positions": n}


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
        return {key: Reference(handle.get_tensor(f"{key}::tokens").tolist(), handle.get_tensor(f"{key}::logprobs"), h,
                               handle.get_tensor(f"{key}::indices") if f"{key}::indices" in names else None)
                for key, h in hashes.items()}

"""Fidelity to the full cache: the method's next-token distributions teacher-forced on the full
cache's own greedy continuation, compared with the full cache's (stored once by the reference run)."""

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
    logprobs: torch.Tensor  # [len(tokens), vocab] log-softmax behind each of them
    prompt_hash: str  # the prompt it answered (a method run must see the same prompt)


def prompt_hash(ids: list[int]) -> str:
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]


def compare(reference: Reference, logits: torch.Tensor) -> dict[str, float | int]:
    """Mean and max KL(full || method) per position, and top-1 agreement, over the reference's tokens."""
    method = torch.log_softmax(logits.float(), dim=-1)
    full = reference.logprobs.float()
    kl = (full.exp() * (full - method)).sum(dim=-1).clamp_min(0.0)  # rounding can dip below 0 by ~1e-7
    top1 = (method.argmax(dim=-1) == torch.tensor(reference.tokens)).float()
    return {"kl_mean": float(kl.mean()), "kl_max": float(kl.max()), "top1_agreement": float(top1.mean()),
            "fidelity_positions": len(reference.tokens)}


def save_references(references: dict[str, Reference], path: str | Path) -> None:
    from safetensors.torch import save_file

    tensors, meta = {}, {}
    for key, ref in references.items():
        tensors[f"{key}::logprobs"] = ref.logprobs.float().contiguous()
        tensors[f"{key}::tokens"] = torch.tensor(ref.tokens, dtype=torch.int64)
        meta[key] = ref.prompt_hash
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata={"prompt_hashes": json.dumps(meta, sort_keys=True)})


def load_references(path: str | Path) -> dict[str, Reference]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        hashes = json.loads(handle.metadata()["prompt_hashes"])
        return {key: Reference(handle.get_tensor(f"{key}::tokens").tolist(), handle.get_tensor(f"{key}::logprobs"), h)
                for key, h in hashes.items()}

"""One full-precision prefill shared by every method: run the prompt once through a full cache at
the compute dtype, keeping what any method's own prefill would receive — each layer's K and V, and
the attention modules' inputs (hidden states, rotary embeddings) from which the eviction methods'
query hooks project their queries. `MethodCache.fork` then builds each method's cache from it.

Every method's prefill attends to the K/V the model computed and compresses only what it keeps for
decoding (prefill parity), so a fork of the whole prompt is exact: it holds the same bytes as a
cache prefilled on its own (tested), and the prompt's next-token distribution is the same for every
method. A prefix of the prompt (`upto`) serves the context-only protocol: a cache of the context
alone, compressed before the question exists. Causality makes the prefix's K/V and queries those of
a context-only prefill, but not bit for bit: matrix products of another length round differently
(within 1e-4 here, tested), so a near-tie of an eviction score can resolve otherwise.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from kvbench.decode import sync
from kvbench.methods.base import MethodCache, ModelShape
from kvbench.methods.catalog import build_cache


@dataclass
class Prefill:
    keys: list[torch.Tensor]  # per layer [1, Hkv, T, d] at the compute dtype
    values: list[torch.Tensor]
    hidden: list[torch.Tensor]  # per layer, the attention module's input [1, T, D]
    cos: torch.Tensor  # rotary embeddings [1, T, d], the same for every layer
    sin: torch.Tensor
    logits: torch.Tensor  # next-token logits after the whole prompt [V], float32
    seconds: float  # wall time of the forward pass
    tokens: int


@torch.inference_mode()
def shared_prefill(model: torch.nn.Module, ids: list[int]) -> Prefill:
    device = next(model.parameters()).device
    cache = build_cache({"kind": "full"}, ModelShape.of(model.config))
    layers = model.model.layers
    hidden: list[Any] = [None] * len(layers)
    rotary: list[Any] = [None]

    def capture(index: int):
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            hidden[index] = kwargs.get("hidden_states", args[0] if args else None)
            rotary[0] = kwargs["position_embeddings"]

        return hook

    handles = [
        block.self_attn.register_forward_pre_hook(capture(i), with_kwargs=True) for i, block in enumerate(layers)
    ]
    try:
        sync(device)
        start = time.perf_counter()
        out = model(
            input_ids=torch.tensor([ids], device=device), past_key_values=cache, use_cache=True, logits_to_keep=1
        )
        logits = out.logits[0, -1].float()
        sync(device)
        seconds = time.perf_counter() - start
    finally:
        for handle in handles:
            handle.remove()
    cos, sin = rotary[0]
    return Prefill(
        [layer.keys for layer in cache.layers],
        [layer.values for layer in cache.layers],
        hidden,
        cos,
        sin,
        logits,
        seconds,
        len(ids),
    )


def fork(
    model: torch.nn.Module, prefill: Prefill, spec: dict[str, Any], upto: int, seed: int = 0
) -> tuple[MethodCache, float]:
    """A fresh cache of `spec` holding the prompt's first `upto` positions, and the seconds its
    compression took (what the method adds to a prefill)."""
    device = next(model.parameters()).device
    cache = build_cache(spec, ModelShape.of(model.config), seed)
    sync(device)
    start = time.perf_counter()
    with torch.inference_mode():
        cache.fork(model, prefill, upto)
    sync(device)
    return cache, time.perf_counter() - start

"""`cam`: SnapKV-style eviction at prefill, with the evicted values merged into kept ones
(Zhang et al., ICML 2024, zyxxmu/cam).

With a_i the observation window's attention to position i, the evicted tokens' contribution
sum_e a_e v_e is added to the `merge_budget` most recent kept non-window positions M, each
v_j += sum_e a_e v_e / sum_{j in M} a_j, so sum_{j in M} a_j v_j' gains exactly sum_e a_e v_e: the
attention mass the window placed on evicted tokens is conserved in the kept values."""

from __future__ import annotations

from typing import Any

import torch

from kvbench.methods.base import STORAGE, ModelShape, register
from kvbench.methods.eviction import (
    EvictionCache, attention_probs, gather, keep_count, max_pool, select_with_window,
)
from kvbench.methods.snapkv import SnapKVLayer


def merge_evicted(values: torch.Tensor, weights: torch.Tensor, kept: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """values [1, H, T, d], weights a [H, T], kept [H, K] positions, targets [H, M] positions
    (a subset of kept). Returns the kept values [1, H, K, d] with the evicted mass merged."""
    heads, tokens = weights.shape
    evicted = torch.ones(heads, tokens, dtype=torch.bool)
    evicted.scatter_(1, kept, False)
    mass = ((weights * evicted)[..., None] * values[0].float()).sum(dim=1)  # [H, d]
    target_weight = weights.gather(1, targets).sum(dim=1).clamp_min(1e-12)  # [H]
    merged = values[0].float().clone()
    delta = (mass / target_weight[:, None])[:, None, :].expand(-1, targets.shape[1], -1)
    merged.scatter_add_(1, targets[..., None].expand(-1, -1, values.shape[-1]), delta)
    return gather(merged[None], kept)


class CaMLayer(SnapKVLayer):
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        if self.is_initialized:
            return super().update(key_states, value_states)
        tokens = key_states.shape[-2]
        keep = keep_count(tokens, self.settings)
        if keep >= tokens or self.queries is None:
            return super().update(key_states, value_states)
        self.lazy_initialization(key_states, value_states)
        window = min(self.window, tokens)
        groups = self.q_heads // key_states.shape[1]
        weights = attention_probs(self.queries[..., -window:, :], key_states, groups).mean(dim=1)  # [H, T]
        kept = select_with_window(max_pool(weights, self.kernel), keep, self.window)
        prefix = keep - min(window, keep)  # kept positions before the window, in position order
        budget = min(int(self.settings.get("merge_budget", 32)), prefix)
        targets = kept[:, prefix - budget: prefix] if budget > 0 else kept[:, -1:]
        self.store(gather(key_states, kept), merge_evicted(value_states, weights, kept, targets))
        return key_states, value_states


@register("cam")
def cam(settings: dict[str, Any], shape: ModelShape, seed: int) -> EvictionCache:
    storage = STORAGE[settings.get("storage", "fp16")]
    defaults = {"window": 16, "kernel": 7}
    return EvictionCache([CaMLayer(storage, shape.q_heads, defaults | settings) for _ in range(shape.layers)])

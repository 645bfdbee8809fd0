"""`snapkv`: at prefill, score prompt positions by the attention of the last `window` queries,
max-pool with `kernel`, keep the top positions per KV head plus the window (Li et al. 2024,
FasterDecoding/SnapKV). Keep `keep_ratio` of the prompt or a fixed `capacity`; GQA-aware (scores
averaged over each group's query heads). Decode tokens are appended without eviction."""

from __future__ import annotations

from typing import Any

import torch

from kvbench.methods.base import STORAGE, ModelShape, register
from kvbench.methods.eviction import (
    EvictionCache, ScoredLayer, gather, keep_count, pooled_window_scores, select_with_window,
)


class SnapKVLayer(ScoredLayer):
    def __init__(self, storage: torch.dtype, q_heads: int, settings: dict[str, Any]) -> None:
        super().__init__(storage, q_heads)
        self.settings = settings
        self.window, self.kernel = int(settings.get("window", 32)), int(settings.get("kernel", 7))
        self.query_window = self.window

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        if self.is_initialized:  # decode: append at the storage dtype, attend at the compute dtype
            self.store(torch.cat([self.keys, key_states.to(self.storage)], dim=-2),
                       torch.cat([self.values, value_states.to(self.storage)], dim=-2))
            return self.keys.to(key_states.dtype), self.values.to(value_states.dtype)
        self.lazy_initialization(key_states, value_states)
        tokens = key_states.shape[-2]
        keep = keep_count(tokens, self.settings)
        if keep >= tokens or self.queries is None:
            self.store(key_states, value_states)
        else:
            groups = self.q_heads // key_states.shape[1]
            scores = pooled_window_scores(self.queries, key_states, groups, min(self.window, tokens), self.kernel)
            index = select_with_window(scores, keep, self.window)
            self.store(gather(key_states, index), gather(value_states, index))
        return key_states, value_states  # the prefill itself attends to the whole prompt


@register("snapkv")
def snapkv(settings: dict[str, Any], shape: ModelShape, seed: int) -> EvictionCache:
    storage = STORAGE[settings.get("storage", "fp16")]
    return EvictionCache([SnapKVLayer(storage, shape.q_heads, settings) for _ in range(shape.layers)])

"""`snapkv`: at prefill, score prompt positions by the attention of the last `window` queries,
pool with `kernel`, keep the top positions per KV head plus the window (Li et al. 2024,
FasterDecoding/SnapKV). Scoring follows kvpress SnapKVPress, which the seed study ran: the window's
attention averaged over its queries, on the prefix only, `pooling: avg` (the default; `max` as the
SnapKV paper's ablations), averaged over each GQA group. Keep `keep_ratio` of the prompt (rounded
down, as kvpress) or a fixed `capacity`. Decode tokens are appended without eviction."""

from __future__ import annotations

from typing import Any

import torch

from kvbench.methods.base import STORAGE, ModelShape, register
from kvbench.methods.eviction import (
    EvictionCache,
    ScoredLayer,
    gather,
    keep_count,
    keep_top,
    snapkv_scores,
)
from kvbench.methods.kinds import SnapKVSettings


class SnapKVLayer(ScoredLayer):
    def __init__(self, storage: torch.dtype, q_heads: int, settings: SnapKVSettings) -> None:
        super().__init__(storage, q_heads)
        self.settings = settings
        self.window, self.kernel, self.pooling = settings.window, settings.kernel, settings.pooling
        self.prefill_queries = self.window

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        if self.is_initialized:  # decode: append at the storage dtype, attend at the compute dtype
            keys = self.append("keys", key_states.to(self.storage))
            values = self.append("values", value_states.to(self.storage))
            return keys.to(key_states.dtype), values.to(value_states.dtype)
        self.lazy_initialization(key_states, value_states)
        queries = self.take_queries()
        index = self.select(queries, key_states)
        if index is None:
            self.store(key_states, value_states)
        else:
            self.store(gather(key_states, index), gather(value_states, index))
        return key_states, value_states  # the prefill itself attends to the whole prompt

    def select(self, queries: torch.Tensor | None, keys: torch.Tensor) -> torch.Tensor | None:
        """Kept positions [Hkv, keep] in position order, or None to keep the whole prompt."""
        tokens = keys.shape[-2]
        keep = keep_count(tokens, self.settings.capacity, self.settings.keep_ratio)
        if keep >= tokens:
            return None
        if queries is None:
            raise RuntimeError("snapkv: no queries reached the layer; run the model with the cache attached")
        window = min(self.window, keep)  # a budget below the window keeps the newest `keep` tokens
        return keep_top(snapkv_scores(queries, keys, window, self.kernel, self.pooling), keep)


@register("snapkv")
def snapkv(settings: SnapKVSettings, shape: ModelShape, seed: int) -> EvictionCache:
    storage = STORAGE[settings.storage]
    return EvictionCache([SnapKVLayer(storage, shape.q_heads, settings) for _ in range(shape.layers)])

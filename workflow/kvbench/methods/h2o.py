"""`h2o`: heavy hitters by accumulated attention plus a recent window (Zhang et al. 2023).

Every query's attention (averaged over each GQA group) is added to its keys' scores; the cache
keeps the `recent` newest tokens and the highest-scoring others, `heavy` of them (or a fraction
`keep_ratio` of the prompt, split evenly between heavy hitters and recent tokens). The scores are
method state the cache holds (fp32, one per kept token per KV head) and count in its bytes."""

from __future__ import annotations

import math
from typing import Any

import torch

from kvbench.methods.base import STORAGE, ModelShape, register, tensor_bytes
from kvbench.methods.eviction import EvictionCache, ScoredLayer, attention_received, gather, keep_top, protect_recent
from kvbench.methods.kinds import H2OSettings


class H2OLayer(ScoredLayer):
    prefill_queries = None  # every prompt query's attention counts
    decode_queries = True  # heavy hitters accumulate every new query's attention

    def __init__(self, storage: torch.dtype, q_heads: int, settings: H2OSettings) -> None:
        super().__init__(storage, q_heads)
        self.settings = settings
        self.budget: tuple[int, int] | None = None  # (heavy, recent)
        self.scores: torch.Tensor | None = None  # [Hkv, kept tokens]

    def _budget(self, tokens: int) -> tuple[int, int]:
        if self.settings.heavy is not None:
            return self.settings.heavy, self.settings.recent
        keep = max(2, math.ceil(tokens * self.settings.keep_ratio))
        return keep // 2, keep - keep // 2

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        compute = key_states.dtype
        if self.is_initialized:
            keys = torch.cat([self.keys.to(compute), key_states], dim=-2)
            values = torch.cat([self.values.to(compute), value_states], dim=-2)
        else:
            self.lazy_initialization(key_states, value_states)
            keys, values = key_states, value_states
            self.budget = self._budget(keys.shape[-2])
        queries = self.take_queries()
        if queries is None:
            raise RuntimeError("h2o: no queries reached the layer; run the model with the cache attached")
        new = torch.zeros(keys.shape[1], key_states.shape[-2], device=keys.device)  # fp32 scores
        scores = new if self.scores is None else torch.cat([self.scores, new], dim=-1)
        scores += attention_received(queries, keys)  # each query's attention, causal
        heavy, recent = self.budget
        if keys.shape[-2] > heavy + recent:
            index = keep_top(protect_recent(scores, recent), heavy + recent)
            self.store(gather(keys, index), gather(values, index))
            self.scores = scores.gather(1, index)
        else:
            self.store(keys, values)
            self.scores = scores
        return keys, values

    def nbytes(self) -> int:
        return super().nbytes() + tensor_bytes(self.scores)


@register("h2o")
def h2o(settings: H2OSettings, shape: ModelShape, seed: int) -> EvictionCache:
    storage = STORAGE[settings.storage]
    return EvictionCache([H2OLayer(storage, shape.q_heads, settings) for _ in range(shape.layers)])

"""`streamingllm`: attention sinks (the first `sinks` tokens) plus a window of recent tokens.

Xiao et al. 2024. Keys keep their original RoPE positions (the cache is post-RoPE)."""

from __future__ import annotations

from typing import Any

import torch

from kvbench.methods.base import STORAGE, MethodCache, MethodLayer, ModelShape, register
from kvbench.methods.kinds import StreamingLLMSettings


class SinkWindowLayer(MethodLayer):
    def __init__(self, sinks: int, window: int, storage: torch.dtype) -> None:
        super().__init__()
        self.sinks, self.window, self.storage = sinks, window, storage

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        prefill = not self.is_initialized
        keys, values = super().update(key_states.to(self.storage), value_states.to(self.storage))
        # Attention this step sees everything it was given (the prefill at compute precision, as
        # every method's prefill); eviction applies to what is kept.
        out = (key_states, value_states) if prefill else (keys.to(key_states.dtype), values.to(value_states.dtype))
        if keys.shape[-2] > self.sinks + self.window:
            self.keys = torch.cat([keys[..., : self.sinks, :], keys[..., -self.window :, :]], dim=-2)
            self.values = torch.cat([values[..., : self.sinks, :], values[..., -self.window :, :]], dim=-2)
        return out


@register("streamingllm")
def streamingllm(settings: StreamingLLMSettings, shape: ModelShape, seed: int) -> MethodCache:
    storage = STORAGE[settings.storage]
    return MethodCache([SinkWindowLayer(settings.sinks, settings.window, storage) for _ in range(shape.layers)])

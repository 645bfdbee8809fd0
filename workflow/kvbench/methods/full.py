"""`full`: the baseline cache. By default it keeps what the model computes (fp32 on CPU), so the
harness reproduces plain `generate` exactly; `storage: fp16|bf16` holds it at 16 bits instead."""

from __future__ import annotations

from typing import Any

import torch

from kvbench.methods.base import STORAGE, MethodCache, MethodLayer, ModelShape, owned, register
from kvbench.methods.kinds import FullSettings


class StoredLayer(MethodLayer):
    """Full cache held at a storage dtype, computed with at the incoming dtype. The prefill attends
    to the K/V it was given, as every method's prefill does; decode appends in place (`append`) and
    reads the stored cache."""

    def __init__(self, storage: torch.dtype | None) -> None:
        super().__init__()
        self.storage = storage

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        storage = self.storage or key_states.dtype
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self.keys, self.values = owned(key_states, storage), owned(value_states, storage)
            return key_states, value_states
        keys, values = self.append("keys", key_states.to(storage)), self.append("values", value_states.to(storage))
        return keys.to(key_states.dtype), values.to(value_states.dtype)


@register("full")
def full(settings: FullSettings, shape: ModelShape, seed: int) -> MethodCache:
    storage = STORAGE[settings.storage] if settings.storage else None
    return MethodCache([StoredLayer(storage) for _ in range(shape.layers)])

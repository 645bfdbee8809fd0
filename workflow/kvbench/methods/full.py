"""`full`: the baseline cache. By default it keeps what the model computes (fp32 on CPU), so the
harness reproduces plain `generate` exactly; `storage: fp16|bf16` holds it at 16 bits instead."""

from __future__ import annotations

from typing import Any

import torch

from kvbench.methods.base import STORAGE, MethodCache, MethodLayer, ModelShape, register


class StoredLayer(MethodLayer):
    """Full cache held at a storage dtype, computed with at the incoming dtype."""

    def __init__(self, storage: torch.dtype | None) -> None:
        super().__init__()
        self.storage = storage

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        if self.storage is None:
            return super().update(key_states, value_states)
        compute = key_states.dtype
        keys, values = super().update(key_states.to(self.storage), value_states.to(self.storage))
        return keys.to(compute), values.to(compute)


@register("full")
def full(settings: dict[str, Any], shape: ModelShape, seed: int) -> MethodCache:
    storage = settings.get("storage")
    return MethodCache([StoredLayer(STORAGE[storage] if storage else None) for _ in range(shape.layers)])

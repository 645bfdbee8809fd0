"""`fp8`: K and V stored as float8 e4m3 (one byte per value, saturating at +-448)."""

from __future__ import annotations

from typing import Any

import torch

from kvbench.kv.storage import FP8_E4M3_MAX
from kvbench.methods.base import MethodCache, MethodLayer, ModelShape, register


def to_fp8_bytes(x: torch.Tensor) -> torch.Tensor:
    """Encode: the e4m3 bit patterns of `x` as uint8 (decode: `.view(torch.float8_e4m3fn).to(dtype)`)."""
    return x.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


class Fp8Layer(MethodLayer):
    """Codes kept as uint8 bit patterns (concatenation of fp8 tensors is not supported on CPU).
    The prefill attends to the K/V it was given; decode reads the stored fp8 cache."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self.keys = to_fp8_bytes(key_states)
            self.values = to_fp8_bytes(value_states)
            return key_states, value_states
        self.keys = torch.cat([self.keys, to_fp8_bytes(key_states)], dim=-2)
        self.values = torch.cat([self.values, to_fp8_bytes(value_states)], dim=-2)
        return (self.keys.view(torch.float8_e4m3fn).to(key_states.dtype),
                self.values.view(torch.float8_e4m3fn).to(value_states.dtype))


@register("fp8")
def fp8(settings: dict[str, Any], shape: ModelShape, seed: int) -> MethodCache:
    return MethodCache([Fp8Layer() for _ in range(shape.layers)])

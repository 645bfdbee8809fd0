"""`fp8`: K and V stored as float8 e4m3 (one byte per value, saturating at +-448)."""

from __future__ import annotations

from typing import Any

import torch

from kvbench.kv.storage import FP8_E4M3_MAX
from kvbench.methods.base import MethodCache, MethodLayer, ModelShape, register
from kvbench.methods.kinds import Fp8Settings

# Every e4m3 bit pattern's value: decoding by table lookup is several times faster on CPU than
# converting float8 tensors.
FP8_VALUES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()


def to_fp8_bytes(x: torch.Tensor) -> torch.Tensor:
    """Encode: the e4m3 bit patterns of `x` as uint8."""
    return x.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def from_fp8_bytes(codes: torch.Tensor) -> torch.Tensor:
    """Decode `to_fp8_bytes`'s output to float32 (the same values as `.view(float8_e4m3fn).float()`)."""
    table = FP8_VALUES.to(codes.device)
    return torch.index_select(table, 0, codes.reshape(-1).to(torch.int32)).view(codes.shape)


class Fp8Layer(MethodLayer):
    """Codes kept as uint8 bit patterns (concatenation of fp8 tensors is not supported on CPU).
    The prefill attends to the K/V it was given; decode reads the stored fp8 cache."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self.keys = to_fp8_bytes(key_states)
            self.values = to_fp8_bytes(value_states)
            return key_states, value_states
        self.append("keys", to_fp8_bytes(key_states))
        self.append("values", to_fp8_bytes(value_states))
        return from_fp8_bytes(self.keys).to(key_states.dtype), from_fp8_bytes(self.values).to(value_states.dtype)


@register("fp8")
def fp8(settings: Fp8Settings, shape: ModelShape, seed: int) -> MethodCache:
    return MethodCache([Fp8Layer() for _ in range(shape.layers)])

"""`kivi`: asymmetric low-bit KV quantization (Liu et al. 2024, jy-yuan/KIVI).

Keys are quantized per channel (each channel's scale and zero point over a group of G tokens),
values per token (each token's scale and zero point over a group of G channels). The most recent
tokens stay in full precision: the residual holds R to R+G-1 tokens, and each time it reaches R+G
its oldest G tokens are quantized. Codes are packed; scales and zero points are fp16.
"""

from __future__ import annotations

from typing import Any

import torch

from kvbench.methods.base import STORAGE, MethodCache, MethodLayer, ModelShape, register, tensor_bytes
from kvbench.methods.packing import pack_planes, unpack_planes_into


def quantize(x: torch.Tensor, bits: int, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric uniform quantization with min/max statistics reduced over `dim`."""
    lo = x.amin(dim=dim, keepdim=True)
    hi = x.amax(dim=dim, keepdim=True)
    scale = ((hi - lo) / (2**bits - 1)).to(torch.float16)
    zero = lo.to(torch.float16)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale)).float()
    codes = ((x - zero.float()) / safe).round().clamp(0, 2**bits - 1).to(torch.uint8)
    return codes, scale, zero


class QuantizedBlock:
    """Whole groups of G tokens of K or V: codes packed in planes along head_dim, fp16 scale and
    zero point per group."""

    def __init__(self, x: torch.Tensor, bits: int, group: int, per_channel: bool) -> None:
        # x: [batch, heads, n * G tokens, head_dim]
        self.shape, self.bits, self.per_channel = x.shape, bits, per_channel
        b, h, t, d = x.shape
        # Per channel: statistics over each group of G tokens; per token: over G channels.
        self.grouped = (b, h, t // group, group, d) if per_channel else (b, h, t, d // group, group)
        codes, self.scale, self.zero = quantize(x.reshape(self.grouped), bits, dim=-2 if per_channel else -1)
        self.packed = pack_planes(codes.reshape(x.shape), bits)

    def tokens(self) -> int:
        return self.shape[-2]

    def dequantize_into(self, out: torch.Tensor) -> None:
        """Write codes * scale + zero into `out`, a [batch, heads, tokens, head_dim] view."""
        unpack_planes_into(self.packed, self.bits, out)
        grouped = out.view(self.grouped)
        if self.per_channel:
            torch.addcmul(self.zero.float(), grouped, self.scale.float(), out=grouped)
        else:  # addcmul broadcasting along the innermost axis is several times slower on CPU
            grouped.mul_(self.scale.float()).add_(self.zero.float())

    def dequantize(self) -> torch.Tensor:
        out = torch.empty(self.shape, device=self.packed.device)
        self.dequantize_into(out)
        return out

    def nbytes(self) -> int:
        return tensor_bytes(self.packed, self.scale, self.zero)


class KiviLayer(MethodLayer):
    def __init__(self, bits: int, group: int, residual: int, storage: torch.dtype) -> None:
        super().__init__()
        self.bits, self.group, self.residual, self.storage = bits, group, residual, storage
        self.key_blocks: list[QuantizedBlock] = []
        self.value_blocks: list[QuantizedBlock] = []
        self.quantized_tokens = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        compute = key_states.dtype
        prefill = not self.is_initialized
        keys, values = super().update(key_states.to(self.storage), value_states.to(self.storage))
        flush = max(0, (keys.shape[-2] - self.residual) // self.group) * self.group
        if flush:  # every whole group beyond the residual, in one vectorized block
            self.key_blocks.append(QuantizedBlock(keys[..., :flush, :].float(), self.bits, self.group, True))
            self.value_blocks.append(QuantizedBlock(values[..., :flush, :].float(), self.bits, self.group, False))
            self.keys, self.values = keys[..., flush:, :], values[..., flush:, :]
            self.quantized_tokens += flush
        if prefill:  # as KIVI does: the prompt attends in full precision, the cache is quantized
            return key_states, value_states
        # Decode attends to the dequantized blocks, rebuilt each step into one buffer: no
        # full-precision shadow copy is kept, so the cache holds only what nbytes() counts.
        return self._rebuild(self.key_blocks, self.keys, compute), self._rebuild(self.value_blocks, self.values, compute)

    @staticmethod
    def _rebuild(blocks: list[QuantizedBlock], residual: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        b, h, _, d = residual.shape
        out = torch.empty(b, h, sum(x.tokens() for x in blocks) + residual.shape[-2], d, dtype=dtype,
                          device=residual.device)
        start = 0
        for block in blocks:
            block.dequantize_into(out[..., start : start + block.tokens(), :])
            start += block.tokens()
        out[..., start:, :] = residual
        return out

    def get_seq_length(self) -> int:
        return self.quantized_tokens + super().get_seq_length()

    def nbytes(self) -> int:
        blocks = sum(b.nbytes() for b in self.key_blocks + self.value_blocks)
        return blocks + tensor_bytes(self.keys, self.values)


@register("kivi")
def kivi(settings: dict[str, Any], shape: ModelShape, seed: int) -> MethodCache:
    bits, group, residual = int(settings["bits"]), int(settings.get("group_size", 32)), int(settings.get("residual", 128))
    if shape.head_dim % group:
        raise ValueError(f"kivi: group_size {group} must divide head_dim {shape.head_dim}")
    if bits not in (1, 2, 4, 8):
        raise ValueError(f"kivi: bits must be 1, 2, 4 or 8 (codes are packed in byte planes), not {bits}")
    storage = STORAGE[settings.get("storage", "fp16")]
    return MethodCache([KiviLayer(bits, group, residual, storage) for _ in range(shape.layers)])

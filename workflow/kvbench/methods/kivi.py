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
from kvbench.methods.packing import PLANE_BITS, pack_planes, unpack_planes_into


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
    zero point per group. Later groups are appended to the same block, so a decode step unpacks
    one block whatever the generation length."""

    def __init__(self, x: torch.Tensor, bits: int, group: int, per_channel: bool) -> None:
        # x: [batch, heads, n * G tokens, head_dim]
        self.shape, self.bits, self.group, self.per_channel = x.shape, bits, group, per_channel
        codes, self.scale, self.zero = quantize(x.reshape(self.grouped), bits, dim=-2 if per_channel else -1)
        self.packed = pack_planes(codes.reshape(x.shape), bits)

    @property
    def grouped(self) -> tuple[int, ...]:
        """Per channel: statistics over each group of G tokens; per token: over G channels."""
        b, h, t, d = self.shape
        return (b, h, t // self.group, self.group, d) if self.per_channel else (b, h, t, d // self.group, self.group)

    def tokens(self) -> int:
        return self.shape[-2]

    def append(self, later: "QuantizedBlock") -> None:
        """Take the tokens of `later` after this block's (both keep their own group statistics)."""
        self.packed = torch.cat([self.packed, later.packed], dim=-2)
        self.scale = torch.cat([self.scale, later.scale], dim=2)
        self.zero = torch.cat([self.zero, later.zero], dim=2)
        self.shape = torch.Size((*self.shape[:2], self.shape[2] + later.shape[2], self.shape[3]))

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
        self.key_block: QuantizedBlock | None = None
        self.value_block: QuantizedBlock | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        compute = key_states.dtype
        prefill = not self.is_initialized
        keys, values = super().update(key_states.to(self.storage), value_states.to(self.storage))
        flush = max(0, (keys.shape[-2] - self.residual) // self.group) * self.group
        if flush:  # every whole group beyond the residual, quantized in one vectorized step
            new_keys = QuantizedBlock(keys[..., :flush, :].float(), self.bits, self.group, True)
            new_values = QuantizedBlock(values[..., :flush, :].float(), self.bits, self.group, False)
            if self.key_block is None:
                self.key_block, self.value_block = new_keys, new_values
            else:
                self.key_block.append(new_keys)
                self.value_block.append(new_values)
            self.keys, self.values = keys[..., flush:, :], values[..., flush:, :]
        if prefill:  # as KIVI does: the prompt attends in full precision, the cache is quantized
            return key_states, value_states
        # Decode attends to the dequantized block, rebuilt each step into one buffer: no
        # full-precision shadow copy is kept, so the cache holds only what nbytes() counts.
        return self._rebuild(self.key_block, self.keys, compute), self._rebuild(self.value_block, self.values, compute)

    def quantized_tokens(self) -> int:
        return self.key_block.tokens() if self.key_block is not None else 0

    @staticmethod
    def _rebuild(block: QuantizedBlock | None, residual: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        b, h, recent, d = residual.shape
        quantized = block.tokens() if block is not None else 0
        out = torch.empty(b, h, quantized + recent, d, dtype=dtype, device=residual.device)
        if block is not None:
            block.dequantize_into(out[..., :quantized, :])
        out[..., quantized:, :] = residual
        return out

    def get_seq_length(self) -> int:
        return self.quantized_tokens() + super().get_seq_length()

    def nbytes(self) -> int:
        blocks = sum(b.nbytes() for b in (self.key_block, self.value_block) if b is not None)
        return blocks + tensor_bytes(self.keys, self.values)


@register("kivi")
def kivi(settings: dict[str, Any], shape: ModelShape, seed: int) -> MethodCache:
    bits, group, residual = int(settings["bits"]), int(settings.get("group_size", 32)), int(settings.get("residual", 128))
    if shape.head_dim % group:
        raise ValueError(f"kivi: group_size {group} must divide head_dim {shape.head_dim}")
    if bits not in PLANE_BITS:  # refused here, not at the first flush in the middle of a run
        raise ValueError(f"kivi: bits must be 1, 2, 4 or 8 (codes are packed in byte planes), not {bits}")
    storage = STORAGE[settings.get("storage", "fp16")]
    return MethodCache([KiviLayer(bits, group, residual, storage) for _ in range(shape.layers)])

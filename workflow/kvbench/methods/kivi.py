"""`kivi`: asymmetric low-bit KV quantization (Liu et al. 2024, jy-yuan/KIVI).

Keys are quantized per channel (each channel's scale and zero point over a group of G tokens),
values per token (each token's scale and zero point over a group of G channels). The residual
policy is the reference's (`models/llama_kivi.py`), with R a multiple of G:
- keys: the newest `T mod R` tokens stay at full precision; when they reach R, all R are quantized
  at once (so at T = 1024, R = 128 no key is held at full precision);
- values: exactly the R newest tokens stay at full precision (all of them while T <= R); each new
  token pushes the oldest one into the quantized block, token by token.
A decode step attends to the new token at full precision and the cache flushes after it, as the
reference does. Codes are packed in byte planes; scales and zero points are fp16; "full
precision" is the `storage` dtype (fp16, the reference's model dtype).

On the CPU with the native kernels, decode attends through the cache's own attention (installed by
`attach`) over the packed codes, without rebuilding K or V: scores q.k = sum_d (q_d s_d) c_d +
sum_d q_d z_d, each key group's per-channel scales folded into a copy of the query and the zero
points added as a separate term; values sum_t p_t v_t = sum_t (p_t s_t) c_t + sum_t p_t z_t, each
token's per-channel-group scales folded into its attention weight (`packing.lut_dots`/`lut_sums`).
The reference's kernels instead dequantize each code in registers (code * scale + zero): the same
arithmetic, reordered. Elsewhere (no kernels, a GPU, or not attached) each step rebuilds K/V into one
buffer for the model's own attention, as before; a shape the kernels do not take dequantizes the
blocks inside the cache's attention.
"""

from __future__ import annotations

from typing import Any

import torch

from kvbench.methods import native
from kvbench.methods.attention import RoutedLayer, attach_routed
from kvbench.methods.base import STORAGE, MethodCache, MethodLayer, ModelShape, owned, register, tensor_bytes
from kvbench.methods.kinds import KiviSettings
from kvbench.methods.packing import lut_dots, lut_sums, pack_planes, unpack_planes_into


def quantize(x: torch.Tensor, bits: int, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric uniform quantization with min/max statistics reduced over `dim`."""
    lo, hi = torch.aminmax(x, dim=dim, keepdim=True)
    scale = ((hi - lo) / (2**bits - 1)).to(torch.float16)
    zero = lo.to(torch.float16)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale)).float()
    codes = ((x - zero.float()) / safe).round().clamp(0, 2**bits - 1).to(torch.uint8)
    return codes, scale, zero


class QuantizedBlock:
    """Whole groups of K or V: codes packed in planes along head_dim, fp16 scale and zero point per
    group. Per channel (keys): statistics over groups of G tokens, so tokens come in multiples of G;
    per token (values): over groups of G channels, any number of tokens. Later tokens are appended
    to the same block, so a decode step unpacks one block whatever the generation length.

    Block-level codec: `QuantizedBlock(x, bits, group, per_channel)` encodes x [..., tokens, head_dim]
    (batch, heads leading), `.dequantize()` decodes to fp32, `.nbytes()` is what it holds."""

    def __init__(self, x: torch.Tensor, bits: int, group: int, per_channel: bool) -> None:
        self.shape, self.bits, self.group, self.per_channel = x.shape, bits, group, per_channel
        codes, self.scale, self.zero = quantize(x.reshape(self.grouped), bits, dim=-2 if per_channel else -1)
        self.packed = pack_planes(codes.reshape(x.shape), bits, check=False)  # clamped above

    @property
    def grouped(self) -> tuple[int, ...]:
        """Per channel: statistics over each group of G tokens; per token: over G channels."""
        *lead, t, d = self.shape
        return (*lead, t // self.group, self.group, d) if self.per_channel else (*lead, t, d // self.group, self.group)

    def tokens(self) -> int:
        return self.shape[-2]

    def append(self, later: "QuantizedBlock") -> None:
        """Take the tokens of `later` after this block's (both keep their own group statistics)."""
        axis = len(self.shape) - 2  # the token axis (of groups, for per-channel statistics)
        self.packed = torch.cat([self.packed, later.packed], dim=-2)
        self.scale = torch.cat([self.scale, later.scale], dim=axis)
        self.zero = torch.cat([self.zero, later.zero], dim=axis)
        self.shape = torch.Size((*self.shape[:-2], self.shape[-2] + later.shape[-2], self.shape[-1]))

    def dequantize_into(self, out: torch.Tensor) -> None:
        """Write codes * scale + zero into `out`, a [..., tokens, head_dim] view."""
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

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        """x @ dequantize()^T for a per-channel block (keys): x [..., R, d] -> [..., R, tokens]."""
        scale, zero = (t.float()[..., 0, :] for t in (self.scale, self.zero))  # [..., groups, d]
        folded = x[..., None, :, :] * scale[..., None, :]  # [..., groups, R, d]: one query per group
        native = lut_dots(self.packed, self.bits, self.codes(), folded, planes=True, span=self.group)
        if native is None:
            return x @ self.dequantize().transpose(-1, -2)
        offsets = (x[..., None, :, :] * zero[..., None, :]).sum(-1)  # [..., groups, R]
        return native.add_(offsets.transpose(-1, -2).repeat_interleave(self.group, dim=-1))

    def weighted(self, p: torch.Tensor) -> torch.Tensor:
        """p @ dequantize() for a per-token block (values): p [..., R, tokens] -> [..., R, d]."""
        scale, zero = (t.float()[..., 0] for t in (self.scale, self.zero))  # [..., tokens, d / G]
        native = lut_sums(self.packed, self.bits, self.codes(), p[..., None] * scale[..., None, :, :], planes=True)
        if native is None:
            return p @ self.dequantize()
        return native.add_((p @ zero).repeat_interleave(self.group, dim=-1))

    def codes(self) -> tuple[float, ...]:
        return tuple(float(c) for c in range(2**self.bits))

    def nbytes(self) -> int:
        return tensor_bytes(self.packed, self.scale, self.zero)


def _extend(block: QuantizedBlock | None, later: QuantizedBlock) -> QuantizedBlock:
    if block is None:
        return later
    block.append(later)
    return block


class KiviLayer(RoutedLayer, MethodLayer):
    """`keys`/`values` (the DynamicLayer fields) hold the full-precision residuals; the quantized
    tokens are in `key_block`/`value_block`."""

    def __init__(self, bits: int, group: int, residual: int, storage: torch.dtype) -> None:
        super().__init__()
        self.bits, self.group, self.residual, self.storage = bits, group, residual, storage
        self.key_block: QuantizedBlock | None = None
        self.value_block: QuantizedBlock | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self.keys = self.keys.to(self.storage)
            self.values = self.values.to(self.storage)
            self._append(key_states.to(self.storage), value_states.to(self.storage))
            # As KIVI does: the prompt attends in full precision, the cache is quantized.
            return key_states, value_states
        self.keys = torch.cat([self.keys, key_states.to(self.storage)], dim=-2)
        self.values = torch.cat([self.values, value_states.to(self.storage)], dim=-2)
        # This step attends to the quantized blocks plus the residuals with the new token in full
        # precision; then the residuals flush (`after_attention`).
        if self.attached and key_states.device.type == "cpu" and native.library() is not None:
            self.pending = True
            return key_states, value_states  # unused: `attend` reads the blocks and residuals
        compute = key_states.dtype  # rebuilt into one buffer for the model's own attention
        out = self._rebuild(self.key_block, self.keys, compute), self._rebuild(self.value_block, self.values, compute)
        self._flush()
        return out

    def _append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys = torch.cat([self.keys, keys], dim=-2)
        self.values = torch.cat([self.values, values], dim=-2)
        self._flush()

    def _flush(self) -> None:
        """Keys: every whole R tokens of the residual to the block. Values: all but the R newest."""
        keys = self.keys.shape[-2] // self.residual * self.residual
        if keys:
            self.key_block = _extend(
                self.key_block, QuantizedBlock(self.keys[..., :keys, :].float(), self.bits, self.group, True)
            )
            self.keys = owned(self.keys[..., keys:, :])
        values = max(0, self.values.shape[-2] - self.residual)
        if values:
            self.value_block = _extend(
                self.value_block, QuantizedBlock(self.values[..., :values, :].float(), self.bits, self.group, False)
            )
            self.values = owned(self.values[..., values:, :])

    def scores(self, query: torch.Tensor) -> torch.Tensor:
        """q.k for every cached key: query [b, Hq, n, d] (GQA: consecutive query heads share a KV
        head) -> [b, Hq, n, T]; quantized keys first, then the residual."""
        b, hq, n, d = query.shape
        x = query.float().reshape(b, self.keys.shape[1], -1, d)
        parts = [self.key_block.scores(x)] if self.key_block is not None else []
        parts.append(x @ self.keys.float().transpose(-1, -2))
        return torch.cat(parts, dim=-1).view(b, hq, n, -1)

    def weighted_values(self, probs: torch.Tensor) -> torch.Tensor:
        """sum_t p_t v_t for probs [b, Hq, n, T] -> [b, n, Hq, d]."""
        b, hq, n, t = probs.shape
        p = probs.reshape(b, self.values.shape[1], -1, t)
        quantized = self.value_block.tokens() if self.value_block is not None else 0
        out = p[..., quantized:] @ self.values.float()
        if quantized:
            out += self.value_block.weighted(p[..., :quantized].contiguous())
        return out.view(b, hq, n, -1).transpose(1, 2)

    def after_attention(self) -> None:
        self._flush()

    def quantized_tokens(self) -> tuple[int, int]:
        """(keys, values) held quantized."""
        return tuple(b.tokens() if b is not None else 0 for b in (self.key_block, self.value_block))

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
        return self.quantized_tokens()[0] + super().get_seq_length()

    def nbytes(self) -> int:
        blocks = sum(b.nbytes() for b in (self.key_block, self.value_block) if b is not None)
        return blocks + tensor_bytes(self.keys, self.values)


@register("kivi")
def kivi(settings: KiviSettings, shape: ModelShape, seed: int) -> MethodCache:
    if shape.head_dim % settings.group_size:
        raise ValueError(f"kivi: group_size {settings.group_size} must divide head_dim {shape.head_dim}")
    storage = STORAGE[settings.storage]
    return KiviCache(
        [KiviLayer(settings.bits, settings.group_size, settings.residual, storage) for _ in range(shape.layers)]
    )


class KiviCache(MethodCache):
    def attach(self, model: torch.nn.Module) -> list[Any]:
        return attach_routed(model, self.layers)

"""vLLM's KV cache layouts, and K and V as token rows.

Every attention backend of vLLM 0.32+ gives a layer's cache the logical shape
[blocks, kv_heads, block_size, 2 * head_size]; what the last axis holds depends on the backend:

- `cpu-packed` (the CPU backend, `cpu_attn_reshape_and_cache`, ISA `vec`/`vec16`, 16- and 32-bit
  caches): one block of one head viewed as [2 * block_size, head_size] holds K channel-major
  (head_size rows of block_size tokens, i.e. K transposed) in its first half, V as token rows in
  its second. tests/test_serve_wire.py checks this against the kernel itself.
- `cpu-amx` (the CPU backend's `amx` ISA: bf16 caches with block_size % 32 == 0 on CPUs with AMX
  tiles, head_size % 32 == 0; vLLM also picks it for fp8 caches, which only lossless and raw
  formats carry): VNNI-style tiles.
  One block of one head holds K as [block_size / 16, head_size / 2, 16 tokens, 2 channels] in its
  first half and V as [head_size / 16, block_size / 2, 16 channels, 2 tokens] in its second.
  tests/test_serve_wire.py checks this against the kernel on CPUs with AMX, and against the
  kernel's index formulas everywhere.
- `token-rows` (the CUDA backends: FlashAttention, FlashInfer, Triton, FlexAttention): K is the
  first head_size channels of each token row, V the last (`kv_cache.transpose(1, 2).split(
  head_size, -1)` in their forward), whatever physical stride order the tensor has.

A chunk is one block of every layer, [layers, kv_heads, block_size, 2 * head_size] in the
layer's own layout, so lossless formats ship the cache's bytes as they are.
"""

from __future__ import annotations

from typing import Callable

import torch

CPU_PACKED = "cpu-packed"
CPU_AMX = "cpu-amx"
TOKEN_ROWS = "token-rows"
# The CPU backend's attention ISAs whose packing SPLIT/JOIN follow (checked against the kernel in the tests).
CPU_ISA_LAYOUTS = {"vec": CPU_PACKED, "vec16": CPU_PACKED, "amx": CPU_AMX}


def layout_of(device: torch.device | str, isa: str | None = None) -> str:
    """The layout of a cache on `device`; on the CPU, of the attention ISA vLLM packs it for: one
    SPLIT/JOIN follows, else `cpu-<isa>` (no wire format unpacks it; its chunks share no key with
    another layout's)."""
    if torch.device(device).type != "cpu":
        return TOKEN_ROWS
    return CPU_PACKED if isa is None else CPU_ISA_LAYOUTS.get(isa, f"cpu-{isa}")


def split(chunk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of a `cpu-packed` chunk [..., kv_heads, block_size, 2 * head_size] as
    [..., kv_heads, block_size, head_size] token rows (views where the layout allows)."""
    *lead, heads, block, double = chunk.shape
    head = double // 2
    halves = chunk.reshape(*lead, heads, 2 * block, head)
    keys = halves[..., :block, :].reshape(*lead, heads, head, block).transpose(-1, -2)
    return keys, halves[..., block:, :]


def join(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Inverse of `split`: token rows back to the CPU kernel's packed chunk."""
    *lead, heads, block, head = keys.shape
    packed = torch.cat([keys.transpose(-1, -2).reshape(*lead, heads, block, head), values], dim=-2)
    return packed.reshape(*lead, heads, block, 2 * head)


def split_amx(chunk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of a `cpu-amx` chunk [..., kv_heads, block_size, 2 * head_size] as
    [..., kv_heads, block_size, head_size] token rows (copies)."""
    *lead, heads, block, double = chunk.shape
    head = double // 2
    halves = chunk.reshape(*lead, heads, 2, block * head)
    # K: [tokens/16, channels/2, 16 tokens, 2 channels] -> [tokens/16, 16, channels/2, 2]
    keys = halves[..., 0, :].reshape(*lead, heads, block // 16, head // 2, 16, 2).transpose(-3, -2)
    # V: [channels/16, tokens/2, 16 channels, 2 tokens] -> [tokens/2, 2, channels/16, 16]
    values = halves[..., 1, :].reshape(*lead, heads, head // 16, block // 2, 16, 2)
    n = values.dim()
    values = values.permute(*range(n - 4), n - 3, n - 1, n - 4, n - 2)
    return keys.reshape(*lead, heads, block, head), values.reshape(*lead, heads, block, head)


def join_amx(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Inverse of `split_amx`: token rows back to the AMX kernel's tiles."""
    *lead, heads, block, head = keys.shape
    k = keys.reshape(*lead, heads, block // 16, 16, head // 2, 2).transpose(-3, -2)
    v = values.reshape(*lead, heads, block // 2, 2, head // 16, 16)
    n = v.dim()
    v = v.permute(*range(n - 4), n - 2, n - 4, n - 1, n - 3)
    packed = torch.stack([k.reshape(*lead, heads, block * head), v.reshape(*lead, heads, block * head)], dim=-2)
    return packed.reshape(*lead, heads, block, 2 * head)


def split_rows(chunk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of a `token-rows` chunk: the two halves of the last axis."""
    head = chunk.shape[-1] // 2
    return chunk[..., :head], chunk[..., head:]


def join_rows(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    return torch.cat([keys, values], dim=-1)


SPLIT: dict[str, Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]] = {
    CPU_PACKED: split,
    CPU_AMX: split_amx,
    TOKEN_ROWS: split_rows,
}
JOIN: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    CPU_PACKED: join,
    CPU_AMX: join_amx,
    TOKEN_ROWS: join_rows,
}

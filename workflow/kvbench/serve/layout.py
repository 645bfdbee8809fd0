"""vLLM's KV cache layouts, and K and V as token rows.

Every attention backend of vLLM 0.32+ gives a layer's cache the logical shape
[blocks, kv_heads, block_size, 2 * head_size]; what the last axis holds depends on the backend:

- `cpu-packed` (the CPU backend, `cpu_attn_reshape_and_cache`, ISA `vec`/`vec16`, 16- and 32-bit
  caches): one block of one head viewed as [2 * block_size, head_size] holds K channel-major
  (head_size rows of block_size tokens, i.e. K transposed) in its first half, V as token rows in
  its second. tests/test_serve_wire.py checks this against the kernel itself.
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
TOKEN_ROWS = "token-rows"
# ISAs of the CPU backend whose packing `split`/`join` follow (checked against the kernel in the tests).
TOKEN_ROW_ISAS = ("vec", "vec16")


def layout_of(device: torch.device | str) -> str:
    return CPU_PACKED if torch.device(device).type == "cpu" else TOKEN_ROWS


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


def split_rows(chunk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of a `token-rows` chunk: the two halves of the last axis."""
    head = chunk.shape[-1] // 2
    return chunk[..., :head], chunk[..., head:]


def join_rows(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    return torch.cat([keys, values], dim=-1)


SPLIT: dict[str, Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]] = {
    CPU_PACKED: split,
    TOKEN_ROWS: split_rows,
}
JOIN: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {CPU_PACKED: join, TOKEN_ROWS: join_rows}

"""vLLM's CPU attention cache layout, and K and V as token rows.

Each layer's cache is [blocks, kv_heads, block_size, 2 * head_size]. The attention kernel
(`cpu_attn_reshape_and_cache`, ISA `vec`/`vec16`, 16- and 32-bit caches) views one block of one
head as [2 * block_size, head_size]: the first half holds K channel-major (head_size rows of
block_size tokens, i.e. K transposed), the second half V as token rows. tests/test_serve_wire.py
checks this against the kernel itself.
"""

from __future__ import annotations

import torch

# ISAs whose packing `split`/`join` follow (checked against the kernel in the tests).
TOKEN_ROW_ISAS = ("vec", "vec16")


def split(chunk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of a chunk [..., kv_heads, block_size, 2 * head_size] as [..., kv_heads, block_size, head_size]
    token rows (views where the layout allows)."""
    *lead, heads, block, double = chunk.shape
    head = double // 2
    halves = chunk.reshape(*lead, heads, 2 * block, head)
    keys = halves[..., :block, :].reshape(*lead, heads, head, block).transpose(-1, -2)
    return keys, halves[..., block:, :]


def join(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Inverse of `split`: token rows back to the kernel's packed chunk."""
    *lead, heads, block, head = keys.shape
    packed = torch.cat([keys.transpose(-1, -2).reshape(*lead, heads, block, head), values], dim=-2)
    return packed.reshape(*lead, heads, block, 2 * head)

"""Bit packing of low-bit codes: 2-bit four per byte, 4-bit two per byte, 3-bit eight per three
bytes, 1-bit eight per byte. The cache's size is the bytes of these packed tensors."""

from __future__ import annotations

import torch


def packed_bytes(n_codes: int, bits: int) -> int:
    return -(-n_codes * bits // 8)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes in [0, 2**bits) along the flattened tensor into uint8."""
    if bits not in (1, 2, 3, 4, 8):
        raise ValueError(f"cannot pack {bits}-bit codes")
    flat = codes.reshape(-1).to(torch.int32)
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= 2**bits):
        raise ValueError(f"codes out of range for {bits} bits")
    per_group = 8 if bits == 3 else 8 // bits  # codes per packing group
    group_bytes = 3 if bits == 3 else 1
    pad = (-flat.numel()) % per_group
    groups = torch.cat([flat, flat.new_zeros(pad)]).reshape(-1, per_group)
    shifts = torch.arange(per_group, dtype=torch.int32) * bits
    words = (groups << shifts).sum(dim=1)  # at most 24 bits per group
    out = torch.stack([(words >> (8 * i)) & 0xFF for i in range(group_bytes)], dim=1)
    return out.to(torch.uint8).reshape(-1)[: packed_bytes(flat.numel(), bits)]


def unpack(packed: torch.Tensor, bits: int, n_codes: int) -> torch.Tensor:
    """Inverse of `pack`: the first `n_codes` codes as uint8."""
    per_group = 8 if bits == 3 else 8 // bits
    group_bytes = 3 if bits == 3 else 1
    n_groups = -(-n_codes // per_group)
    raw = packed.to(torch.int32)
    raw = torch.cat([raw, raw.new_zeros(n_groups * group_bytes - raw.numel())]).reshape(n_groups, group_bytes)
    words = sum(raw[:, i] << (8 * i) for i in range(group_bytes))
    shifts = torch.arange(per_group, dtype=torch.int32) * bits
    codes = (words[:, None] >> shifts) & (2**bits - 1)
    return codes.reshape(-1)[:n_codes].to(torch.uint8)

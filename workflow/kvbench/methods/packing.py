"""Bit packing of low-bit codes: 2-bit four per byte, 4-bit two per byte, 3-bit eight per three
bytes, 1-bit eight per byte. The cache's size is the bytes of these packed tensors."""

from __future__ import annotations

from functools import lru_cache

import torch


PLANE_BITS = (1, 2, 4, 8)  # widths that fill a byte with whole codes, as `pack_planes` needs


def packed_bytes(n_codes: int, bits: int) -> int:
    return -(-n_codes * bits // 8)


def _check_range(codes: torch.Tensor, bits: int) -> None:
    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= 2**bits):
        raise ValueError(f"codes out of range for {bits} bits")


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes in [0, 2**bits) along the flattened tensor into uint8."""
    if bits not in (1, 2, 3, 4, 8):
        raise ValueError(f"cannot pack {bits}-bit codes")
    flat = codes.reshape(-1).to(torch.int32)
    _check_range(flat, bits)
    per_group = 8 if bits == 3 else 8 // bits  # codes per packing group
    group_bytes = 3 if bits == 3 else 1
    pad = (-flat.numel()) % per_group
    groups = torch.cat([flat, flat.new_zeros(pad)]).reshape(-1, per_group)
    shifts = torch.arange(per_group, dtype=torch.int32, device=flat.device) * bits
    words = (groups << shifts).sum(dim=1)  # at most 24 bits per group
    out = torch.stack([(words >> (8 * i)) & 0xFF for i in range(group_bytes)], dim=1).to(torch.uint8).reshape(-1)
    n = packed_bytes(flat.numel(), bits)
    return out if out.numel() == n else out[:n].clone()  # no view onto the padding's bytes


def unpack(packed: torch.Tensor, bits: int, n_codes: int) -> torch.Tensor:
    """Inverse of `pack`: the first `n_codes` codes as uint8."""
    return _unpack_int32(packed, bits, n_codes).to(torch.uint8)


def _unpack_int32(packed: torch.Tensor, bits: int, n_codes: int) -> torch.Tensor:
    per_group = 8 if bits == 3 else 8 // bits
    group_bytes = 3 if bits == 3 else 1
    n_groups = -(-n_codes // per_group)
    raw = packed.to(torch.int32)
    raw = torch.cat([raw, raw.new_zeros(n_groups * group_bytes - raw.numel())]).reshape(n_groups, group_bytes)
    words = sum(raw[:, i] << (8 * i) for i in range(group_bytes))
    shifts = torch.arange(per_group, dtype=torch.int32, device=packed.device) * bits
    codes = (words[:, None] >> shifts) & (2**bits - 1)
    return codes.reshape(-1)[:n_codes]


@lru_cache(maxsize=64)
def _byte_table(bits: int, values: tuple[float, ...], device: str) -> torch.Tensor:
    """Row b (one packed byte) holds values[code] for each code in b, in packing order."""
    codes = (torch.arange(256)[:, None] >> (torch.arange(8 // bits) * bits)) & (2**bits - 1)
    return torch.tensor(values, dtype=torch.float32)[codes].to(device)


def unpack_as(packed: torch.Tensor, bits: int, n_codes: int, values: tuple[float, ...]) -> torch.Tensor:
    """The first `n_codes` codes of `packed`, each as the float32 `values[code]`.

    Decode steps unpack the whole quantized cache, so for 1/2/4 bits this is one table lookup per
    byte rather than shifting and masking each code (a 256-row table stays in L1; a 65536-row one
    for byte pairs measured slower once the model's weights stream through the caches)."""
    if bits == 3:  # codes straddle bytes: unpack the 24-bit words, then one lookup per code
        table = torch.tensor(values, dtype=torch.float32, device=packed.device)
        return torch.index_select(table, 0, _unpack_int32(packed, bits, n_codes))
    table = _byte_table(bits, values, str(packed.device))
    return torch.index_select(table, 0, packed.to(torch.int32)).reshape(-1)[:n_codes]


def pack_planes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack 1/2/4-bit codes along the last axis in planes: with w = last // (8 // bits), byte j of
    a row holds codes j, j + w, j + 2w, ... So unpacking is one shift-and-mask per plane, each
    written to a contiguous slice of the row: no per-code indexing at decode time."""
    if bits not in PLANE_BITS or codes.shape[-1] % (8 // bits):
        raise ValueError(f"cannot pack {bits}-bit codes in planes along an axis of {codes.shape[-1]}")
    _check_range(codes, bits)
    per = 8 // bits
    planes = codes.to(torch.uint8).chunk(per, dim=-1)
    out = planes[0].clone()
    for k, plane in enumerate(planes[1:], start=1):
        out |= plane << (k * bits)
    return out


def unpack_planes_into(packed: torch.Tensor, bits: int, out: torch.Tensor) -> None:
    """Inverse of `pack_planes`, converting on the fly into `out` (any float dtype and strides)."""
    width, mask = packed.shape[-1], 2**bits - 1
    for k in range(8 // bits):
        out[..., k * width : (k + 1) * width].copy_((packed >> (k * bits)) & mask)

"""Bit packing of low-bit codes: 2-bit four per byte, 4-bit two per byte, 3-bit eight per three
bytes, 1-bit eight per byte. The cache's size is the bytes of these packed tensors."""

from __future__ import annotations

import ctypes
from functools import lru_cache

import torch
import torch.nn.functional as F

from kvbench.methods import native

PLANE_BITS = (1, 2, 4, 8)  # widths that fill a byte with whole codes, as `pack_planes` needs


def packed_bytes(n_codes: int, bits: int) -> int:
    return -(-n_codes * bits // 8)


def _check_range(codes: torch.Tensor, bits: int) -> None:
    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= 2**bits):
        raise ValueError(f"codes out of range for {bits} bits")


def pack(codes: torch.Tensor, bits: int, check: bool = True) -> torch.Tensor:
    """Pack integer codes in [0, 2**bits) along the flattened tensor into uint8 (`check=False`:
    the caller's codes are in range by construction; skips two reductions per call)."""
    if bits not in (1, 2, 3, 4, 8):
        raise ValueError(f"cannot pack {bits}-bit codes")
    if check:
        _check_range(codes, bits)
    if bits in (1, 2, 4) and (library := _encoder(codes)) is not None:
        # in range (checked, or by the caller's construction), so uint8 loses nothing
        small = codes.reshape(-1).to(torch.uint8).contiguous()
        out = torch.empty(packed_bytes(small.numel(), bits), dtype=torch.uint8)
        if library.pack_codes(small.numel(), small.data_ptr(), bits, out.data_ptr(), _threads()) == native.OK:
            return out
    flat = codes.reshape(-1).to(torch.int32)
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
    raw = packed.reshape(-1).to(torch.int32)
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


# A row of 2 or 4 float32s gathered as one 8- or 16-byte element: index_select copies scalars in
# a tight loop but rows one memcpy at a time, so this is several times faster (1 ns -> 0.25 ns a value).
_ROW_AS = {2: torch.int64, 4: torch.complex128}


def gather_rows(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """table[index] for a float32 table [rows, width] and integer index [n]: flat float32 [n * width]."""
    width = table.shape[1]
    if width == 1:
        return torch.index_select(table.reshape(-1), 0, index)
    if width in _ROW_AS:
        return torch.index_select(table.view(_ROW_AS[width]).reshape(-1), 0, index).view(torch.float32)
    if width == 8:  # 1-bit codes: each nibble (four codes) as one 16-byte element
        nibbles = torch.stack([index & 15, index >> 4], dim=1).reshape(-1)
        return gather_rows(table[:16, :4].contiguous(), nibbles)
    return torch.index_select(table, 0, index).reshape(-1)


def unpack_as(packed: torch.Tensor, bits: int, n_codes: int, values: tuple[float, ...]) -> torch.Tensor:
    """The first `n_codes` codes of `packed`, each as the float32 `values[code]`.

    Decode steps read the whole quantized cache, so for 1/2/4/8 bits this is one table lookup
    per byte rather than shifting and masking each code (a 256-row table stays in L1; a
    65536-row one for byte pairs measured slower once the model's weights stream through the caches)."""
    if bits == 3:  # codes straddle bytes: unpack the 24-bit words, then one lookup per code
        table = torch.tensor(values, dtype=torch.float32, device=packed.device)
        return torch.index_select(table, 0, _unpack_int32(packed, bits, n_codes))
    table = _byte_table(bits, values, str(packed.device))
    return gather_rows(table, packed.reshape(-1).to(torch.int32))[:n_codes]


def byte_scores(packed: torch.Tensor, bits: int, values: tuple[float, ...], query: torch.Tensor) -> torch.Tensor:
    """query @ codes^T with codes as `values[code]`, scored straight from the packed bytes: packed
    [..., T, B] (one row of B bytes per token, from `pack`), query [..., R, 8 * B // bits] fp32 ->
    [..., R, T].

    Product-quantization style: per query row and byte position, a table holds that byte's partial
    dot product for each of the 256 byte values, so a token costs B lookups of R floats (one fused
    `embedding_bag`) instead of unpacking its codes to floats and a matmul. In a micro-benchmark on
    this CPU (4K tokens, d = 64; not a recorded bench) it took about half the time for 1-bit rows,
    and no less than unpacking for 2-4 bits, which therefore keep the unpacking path."""
    if bits not in (1, 2, 4, 8):  # a 3-bit code straddles bytes: no per-byte table
        raise ValueError(f"byte_scores: {bits}-bit codes do not fit whole in a byte")
    *lead, t, nb = packed.shape
    rows, g = query.shape[-2], packed[..., 0, 0].numel()
    table = _byte_table(bits, values, str(packed.device))  # [256, codes per byte]
    lut = torch.einsum("vi,grji->gjvr", table, query.reshape(g, rows, nb, -1))  # [g, B, 256, R]
    offsets = torch.arange(0, g * nb * 256, 256, dtype=torch.int32, device=packed.device).view(g, 1, nb)
    index = (packed.reshape(g, t, nb) + offsets).view(g * t, nb)  # uint8 + int32: int32
    sums = F.embedding_bag(index, lut.reshape(-1, rows), mode="sum")
    return sums.view(*lead, t, rows).transpose(-1, -2).contiguous()


def pack_planes(codes: torch.Tensor, bits: int, check: bool = True) -> torch.Tensor:
    """Pack 1/2/4-bit codes along the last axis in planes: with w = last // (8 // bits), byte j of
    a row holds codes j, j + w, j + 2w, ... So unpacking is one shift-and-mask per plane, each
    written to a contiguous slice of the row: no per-code indexing at decode time."""
    if bits not in PLANE_BITS or codes.shape[-1] % (8 // bits):
        raise ValueError(f"cannot pack {bits}-bit codes in planes along an axis of {codes.shape[-1]}")
    if check:
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


def pack_sign_magnitude(codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """3-bit codes of a symmetric codebook (levels[7 - c] = -levels[c]) as a 2-bit magnitude plane
    (3 - c below the middle, c - 4 above) and a 1-bit sign plane: 3 bits per code, as `pack(codes,
    3)`, but decodable by byte tables (`unpack_sign_magnitude_as`), with no 24-bit words."""
    codes = codes.reshape(-1).to(torch.int32)
    upper = codes >= 4
    return pack(torch.where(upper, codes - 4, 3 - codes), 2, check=False), pack(upper, 1, check=False)


def unpack_sign_magnitude(magnitude: torch.Tensor, signs: torch.Tensor, n_codes: int) -> torch.Tensor:
    """Inverse of `pack_sign_magnitude`: the first `n_codes` codes as uint8."""
    m, upper = unpack(magnitude, 2, n_codes).to(torch.int32), unpack(signs, 1, n_codes).bool()
    return torch.where(upper, m + 4, 3 - m).to(torch.uint8)


@lru_cache(maxsize=64)
def _sign_magnitude_table(values: tuple[float, ...], device: str) -> torch.Tensor:
    """Row (magnitude byte | sign nibble << 8) holds values[code] of the byte's four codes."""
    index = torch.arange(4096)
    shifts = torch.arange(4)
    magnitude = (index[:, None] >> (2 * shifts)) & 3
    upper = (index[:, None] >> (8 + shifts)) & 1
    codes = torch.where(upper.bool(), magnitude + 4, 3 - magnitude)
    return torch.tensor(values, dtype=torch.float32)[codes].to(device)


def unpack_sign_magnitude_as(
    magnitude: torch.Tensor, signs: torch.Tensor, n_codes: int, values: tuple[float, ...]
) -> torch.Tensor:
    """The first `n_codes` codes of `pack_sign_magnitude`, each as the float32 `values[code]`: one
    lookup per magnitude byte (four codes) in a 4096-row table, its four signs being one nibble
    of a sign byte."""
    m = magnitude.reshape(-1).to(torch.int32)
    s = signs.reshape(-1).to(torch.int32)
    nibbles = torch.stack([s & 15, s >> 4], dim=1).reshape(-1)[: m.numel()]
    table = _sign_magnitude_table(values, str(magnitude.device))
    return gather_rows(table, m | (nibbles << 8))[:n_codes]


@lru_cache(maxsize=64)
def _codebook16(values: tuple[float, ...], sign_magnitude: bool) -> torch.Tensor:
    """The kernels' 16-entry table: values by code; for sign-magnitude codes by (magnitude | sign << 2),
    as `pack_sign_magnitude` stores a code."""
    if sign_magnitude:
        m, s = torch.arange(8) % 4, torch.arange(8) // 4
        values = tuple(values[c] for c in torch.where(s.bool(), m + 4, 3 - m).tolist())
    return torch.tensor(values + (0.0,) * (16 - len(values)), dtype=torch.float32)


def _row_codes(packed: torch.Tensor, bits: int, signs: torch.Tensor | None) -> int:
    """Codes in one packed row: sign-magnitude rows hold four 2-bit magnitudes a byte (the signs apart)."""
    return packed.shape[-1] * 4 if signs is not None else packed.shape[-1] * 8 // bits


def _encoder(x: torch.Tensor) -> ctypes.CDLL | None:
    """The native kernels for an encode-side call on `x` (CPU only), or None: the torch path runs.
    Not counted in `native.CALLS`, which tells the decode kernels' calls (provenance)."""
    return native.library() if x.device.type == "cpu" else None


def _threads() -> int:
    return native.threads(torch.get_num_threads())


def count_below(x: torch.Tensor, edges: torch.Tensor) -> torch.Tensor | None:
    """uint8 codes of a scalar quantizer: how many of the sorted `edges` lie strictly below each
    element of float32 `x` (NaN: none), by the native kernel; None where the torch path runs
    (another dtype included: torch compares in x's dtype)."""
    library = _encoder(x) if x.dtype == torch.float32 else None
    if library is None:
        return None
    x = x.contiguous()
    edges = edges.to(device="cpu", dtype=torch.float32).contiguous()
    out = torch.empty(x.shape, dtype=torch.uint8)
    code = library.count_below(x.numel(), x.data_ptr(), edges.data_ptr(), edges.numel(), out.data_ptr(), _threads())
    return out if code == native.OK else None


def _native(
    name: str,
    packed: torch.Tensor,
    bits: int,
    values: tuple[float, ...],
    x: torch.Tensor,
    extent: int,
    x_lead: tuple[int, ...],
    out_shape: tuple[int, ...],
    signs: torch.Tensor | None,
    planes: bool,
) -> torch.Tensor | None:
    """Run kernel `name`; x must be exactly [*packed lead, *x_lead] (no broadcasting: the kernel
    reads raw memory). None, counted with its reason in `native.CALLS`, where the torch path runs."""
    if packed.device.type != "cpu":  # checked first: a GPU host builds nothing
        native.CALLS["torch (not on the CPU)"] += 1
        return None
    library = native.library()
    if library is None:
        native.CALLS["torch (no native kernels)"] += 1
        return None
    *lead, t, nb = packed.shape
    if tuple(x.shape) != (*lead, *x_lead) or (signs is not None and tuple(signs.shape) != (*lead, t, nb // 2)):
        raise ValueError(f"{name}: packed {tuple(packed.shape)} with x {tuple(x.shape)}: expected x {(*lead, *x_lead)}")
    layout = 2 if planes else 1 if signs is not None else 0  # PLANES, SIGN_MAGNITUDE, FLAT
    dim = _row_codes(packed, bits, signs)
    packed, x = packed.contiguous(), x.to(torch.float32).contiguous()
    signs = signs.contiguous() if signs is not None else None
    codebook = _codebook16(values, signs is not None)
    out = torch.empty(*lead, *out_shape, dtype=torch.float32)
    code = getattr(library, name)(
        packed[..., 0, 0].numel(),
        t,
        out_shape[0],
        dim,
        layout,
        bits,
        packed.data_ptr(),
        signs.data_ptr() if signs is not None else None,
        codebook.data_ptr(),
        x.data_ptr(),
        extent,
        out.data_ptr(),
        _threads(),
    )
    if code == native.NO_MEMORY:
        raise MemoryError(f"{name}: out of memory")
    native.CALLS["torch (a shape the kernels do not take)" if code == native.UNSUPPORTED else "native"] += 1
    return None if code == native.UNSUPPORTED else out


def lut_dots(
    packed: torch.Tensor,
    bits: int,
    values: tuple[float, ...],
    query: torch.Tensor,
    *,
    signs: torch.Tensor | None = None,
    planes: bool = False,
    span: int | None = None,
) -> torch.Tensor | None:
    """query @ codes^T with codes as `values[code]`, by the native kernel straight from the packed
    rows: packed [..., T, B] from `pack` (or `pack_planes` with `planes`, or the magnitude rows of
    `pack_sign_magnitude` with its sign rows `signs`); query [..., R, D], or [..., T / span, R, D]
    for one query per `span` tokens -> [..., R, T] fp32. None where the kernels do not run (not
    built here, not on the CPU, a shape they do not take): the caller's torch path runs instead."""
    t = packed.shape[-2]
    blocks = () if span is None else (-(-t // span),)
    rows, dim = query.shape[-2], query.shape[-1]
    return _native("level_dots", packed, bits, values, query, span or t, (*blocks, rows, dim), (rows, t), signs, planes)


def lut_sums(
    packed: torch.Tensor,
    bits: int,
    values: tuple[float, ...],
    weights: torch.Tensor,
    *,
    signs: torch.Tensor | None = None,
    planes: bool = False,
) -> torch.Tensor | None:
    """weights @ codes with codes as `values[code]` -> [..., R, D] fp32, by the native kernel; weights
    [..., R, T], or [..., R, T, C] for one weight per group of D / C channels. None where the kernel
    does not run (see `lut_dots`)."""
    dim = _row_codes(packed, bits, signs)
    grouped = weights.dim() == packed.dim() + 1
    rows, t = weights.shape[-3 if grouped else -2], packed.shape[-2]
    cols = weights.shape[-1] if grouped else 1
    return _native(
        "level_sums",
        packed,
        bits,
        values,
        weights,
        cols,
        (rows, t, cols) if grouped else (rows, t),
        (rows, dim),
        signs,
        planes,
    )

"""Storage dtypes for KV tensors (computed in fp32, stored and measured at lower precision)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

FP8_E4M3_MAX = 448.0  # largest finite float8_e4m3fn

# the integer dtype of each element width: a float tensor's bit patterns, viewed without a copy
INT_OF_ITEMSIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


@dataclass(frozen=True)
class Stored:
    data: bytes
    itemsize: int
    unique_values: int  # distinct bit patterns (32-bit for fp32, 16-bit for fp16/bf16, 8-bit for fp8)
    mean_abs: float  # of the stored values
    clipped: int  # values saturated to the fp8 range (0 for 16-bit dtypes)
    below_normal: int  # nonzero values below the dtype's smallest normal: stored with fewer bits
    flushed_to_zero: int  # nonzero values stored as +-0

    @property
    def values(self) -> int:
        return len(self.data) // self.itemsize


STORAGE_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,  # what a float32 vLLM server's cache holds (the serve stage's wire)
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp8_e4m3": torch.float8_e4m3fn,
}


def distinct(bits: np.ndarray) -> int:
    """Distinct bit patterns: a count per pattern for 8 and 16 bits, sorted runs for 32 (np.unique
    hashes, ~10x slower on a 1K-token cache: most of a kv job's time)."""
    if bits.itemsize <= 2:
        patterns = bits.view(np.uint8 if bits.itemsize == 1 else np.uint16).ravel()
        return int(np.count_nonzero(np.bincount(patterns, minlength=1)))
    ordered = np.sort(bits, axis=None)
    return int(ordered.size and 1 + np.count_nonzero(ordered[1:] != ordered[:-1]))


def store(tensor: torch.Tensor, dtype_name: str) -> Stored:
    """Cast an fp32 tensor to a storage dtype and return its raw bytes (C order)."""
    if dtype_name not in STORAGE_DTYPES:
        raise ValueError(f"unknown storage dtype {dtype_name!r}; known: {', '.join(STORAGE_DTYPES)}")
    dtype = STORAGE_DTYPES[dtype_name]
    # Underflow explains what a ratio measures: tiny values (dummy weights give |x| ~ 1e-6) keep
    # few distinct bit patterns as subnormals, or none at all as zeros, and then compress well.
    nonzero = tensor != 0
    below_normal = int((nonzero & (tensor.abs() < torch.finfo(dtype).tiny)).sum())
    clipped = 0
    if dtype == torch.float8_e4m3fn:
        # e4m3fn has no infinity: out-of-range casts become NaN, so saturate (as scale-1 fp8 KV does).
        clipped = int((tensor.abs() > FP8_E4M3_MAX).sum())
        tensor = tensor.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    cast = tensor.contiguous().to(dtype)
    itemsize = cast.element_size()
    bits = cast.view(INT_OF_ITEMSIZE[itemsize]).numpy()
    return Stored(
        data=bits.tobytes(),
        itemsize=itemsize,
        unique_values=distinct(bits),
        mean_abs=float(cast.float().abs().mean()),
        clipped=clipped,
        below_normal=below_normal,
        flushed_to_zero=int((nonzero & (cast == 0)).sum()),
    )

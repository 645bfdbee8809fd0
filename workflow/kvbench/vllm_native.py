"""vLLM's own quantized KV caches (`--kv-cache-dtype`, Triton kernels: GPU only) that correspond to a
method of the study, and the server command for each: what a GPU serve stage runs next to the
harness's methods, its numbers labelled as the engine's.

Named as what they are, not as the study's methods: vLLM's TurboQuant presets rotate (Hadamard),
quantize keys with a Lloyd-Max codebook and values uniformly, with norm correction and no QJL
residual (vllm/model_executor/layers/quantization/turboquant/config.py), so they are nearest to our
`turboquant*-mse` entries, not to `turboquant` (which adds the 1-bit QJL stage); the
`int*_per_token_head` caches give each token's head vector its own scale, a per-token scheme like
KIVI's values but not KIVI (whose keys are quantized per channel over groups of tokens, with a
full-precision residual window).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from kvbench.vllm_server import vllm_command


@dataclass(frozen=True)
class NativeKV:
    dtype: str  # the --kv-cache-dtype value
    label: str  # what a table calls it (engine: vllm)
    key_bits: int
    value_bits: int
    nearest: str  # the study's method kind it corresponds to
    difference: str  # what differs from that method


NATIVE_KV: tuple[NativeKV, ...] = (
    NativeKV("fp8", "vllm-fp8", 8, 8, "fp8", "vLLM's FP8 E4M3 cache with per-tensor scales; the harness's fp8 casts"),
    NativeKV(
        "turboquant_4bit_nc",
        "vllm-turboquant-4bit",
        4,
        4,
        "turboquant",
        "Hadamard rotation, Lloyd-Max 4-bit keys, uniform 4-bit values, norm correction, no QJL residual: "
        "nearest to turboquant4-mse",
    ),
    NativeKV(
        "turboquant_3bit_nc",
        "vllm-turboquant-3bit",
        3,
        3,
        "turboquant",
        "as turboquant_4bit_nc at 3 bits; boundary layers stay at the model's dtype",
    ),
    NativeKV(
        "int8_per_token_head",
        "vllm-int8-per-token-head",
        8,
        8,
        "kivi",
        "int8 with one scale per token and head (keys too): a per-token scheme, not KIVI's per-channel keys",
    ),
    NativeKV(
        "int4_per_token_head",
        "vllm-int4-per-token-head",
        4,
        4,
        "kivi",
        "int4 with one scale per token and head (keys too): a per-token scheme, not KIVI's per-channel keys "
        "and full-precision residual",
    ),
)
BY_DTYPE = {kv.dtype: kv for kv in NATIVE_KV}


def native_server_command(
    model_dir: str | Path, port: int, settings: Mapping[str, Any], seed: int, dtype: str
) -> list[str]:
    """The vLLM server command (`kvbench.vllm_server.vllm_command`) with a native quantized KV cache."""
    if dtype not in BY_DTYPE:
        raise ValueError(f"{dtype!r} is not one of the native KV caches kvbench maps ({', '.join(BY_DTYPE)})")
    if settings["device"] != "cuda":
        raise ValueError(f"--kv-cache-dtype {dtype}: vLLM serves it with GPU kernels only (vllm.device: cuda)")
    return vllm_command(model_dir, port, settings, seed) + ["--kv-cache-dtype", dtype]

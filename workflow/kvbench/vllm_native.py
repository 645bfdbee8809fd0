"""vLLM's own quantized KV caches (`--kv-cache-dtype`; GPU kernels, fp8 on CPUs with AVX-512 too)
that correspond to a method of the study. Each is a serve backend of its own (`serve.backends`,
by its label; kvbench.serve.backends builds the server's arguments), measured with the same
client as every backend next to the harness's methods, its numbers labelled as the engine's.

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


@dataclass(frozen=True)
class NativeKV:
    dtype: str  # the --kv-cache-dtype value
    label: str  # what a table calls it (engine: vllm)
    key_bits: int
    value_bits: int
    nearest: str  # the study's method kind it corresponds to
    difference: str  # what differs from that method
    harness: str | None = None  # the config method the report cross-checks it against (same samples)
    # the KV block sizes its kernels take (None: any the attention backend takes). vLLM pads
    # TurboQuant's pages and cannot split a padded page into kernel blocks, so a server block size
    # outside the list fails at start ("Padded KV pages do not support kernel block splitting")
    block_sizes: tuple[int, ...] | None = None


# vllm/v1/attention/backends/turboquant_attn.py, get_supported_kernel_block_sizes (vLLM 0.32.0)
TURBOQUANT_BLOCKS = (16, 32, 64, 128)
# ... and the first and last 2 attention layers of a dense model stay at the model's dtype
# (TurboQuantConfig.get_boundary_skip_layers, added to --kv-cache-dtype-skip-layers by vLLM itself)
TURBOQUANT_BOUNDARY_LAYERS = 2


def block_size_for(kv: NativeKV | None, requested: int) -> int:
    """The block size a server of this cache runs: the requested one where its kernels take it, else
    the largest they take below it (the smallest above where none is below)."""
    if kv is None or kv.block_sizes is None or requested in kv.block_sizes:
        return requested
    below = [b for b in kv.block_sizes if b < requested]
    return max(below) if below else min(kv.block_sizes)


NATIVE_KV: tuple[NativeKV, ...] = (
    NativeKV(
        "fp8", "vllm-fp8", 8, 8, "fp8", "vLLM's FP8 E4M3 cache with per-tensor scales; the harness's fp8 casts", "fp8"
    ),
    NativeKV(
        "turboquant_4bit_nc",
        "vllm-turboquant-4bit",
        4,
        4,
        "turboquant",
        "Hadamard rotation, Lloyd-Max 4-bit keys, uniform 4-bit values, norm correction, no QJL residual: "
        "nearest to turboquant4-mse; the first and last 2 attention layers stay at the model's dtype",
        "turboquant4-mse",
        TURBOQUANT_BLOCKS,
    ),
    NativeKV(
        "turboquant_3bit_nc",
        "vllm-turboquant-3bit",
        3,
        3,
        "turboquant",
        "as turboquant_4bit_nc at 3 bits; the first and last 2 attention layers stay at the model's dtype",
        "turboquant3-mse",
        TURBOQUANT_BLOCKS,
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

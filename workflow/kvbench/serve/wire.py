"""Wire formats of offloaded chunks: the kv stage's lossless codecs on the cache's own bytes, and
the method registry's quantizers on K and V as lossy formats (one implementation of each).

A chunk is one block of every layer, [layers, kv_heads, block_size, 2 * head_size] in vLLM's
packed CPU layout (see layout.py). Lossless formats compress those bytes as they are, so a load
restores them exactly. Lossy formats unpack K and V to token rows of head_size first, because the
methods define their statistics on those rows (KIVI: keys per channel over groups of G tokens,
values per token over groups of G channels; TurboQuant: one rotated vector per token and head).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Mapping, Protocol

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from kvbench.kv.codecs import get_codec
from kvbench.methods.fp8 import to_fp8_bytes
from kvbench.methods.kivi import QuantizedBlock
from kvbench.methods.turboquant import MseQuantizer, TurboBlock, layer_constants
from kvbench.serve import layout
from kvbench.serve.names import LOSSY_KINDS, is_lossless


@dataclass(frozen=True)
class ChunkSpec:
    layers: int
    kv_heads: int
    block_size: int
    head_size: int
    dtype: torch.dtype

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.layers, self.kv_heads, self.block_size, 2 * self.head_size)

    @property
    def token_rows(self) -> tuple[int, int, int, int]:
        return (self.layers, self.kv_heads, self.block_size, self.head_size)

    def nbytes(self) -> int:
        return self.layers * self.kv_heads * self.block_size * 2 * self.head_size * self.dtype.itemsize


class WireFormat(Protocol):
    name: str
    lossless: bool

    def encode(self, chunk: torch.Tensor) -> bytes | memoryview: ...

    def decode(self, data: bytes) -> torch.Tensor: ...


def raw_bytes(chunk: torch.Tensor) -> memoryview:
    """The chunk's bytes without a copy (the store client and the codecs read buffers)."""
    return chunk.contiguous().view(torch.uint8).reshape(-1).numpy().data


def read_only(data: bytes, dtype: torch.dtype) -> torch.Tensor:
    """A tensor over `data` without a copy; only ever read (copied into the paged cache)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(data, dtype=dtype)


class Lossless:
    """A kv-stage codec on the chunk's bytes; byte-plane splits elements of the cache's width."""

    lossless = True

    def __init__(self, name: str, spec: ChunkSpec) -> None:
        self.name, self.spec = name, spec
        self.codec = get_codec(name, spec.dtype.itemsize)

    def encode(self, chunk: torch.Tensor) -> bytes | memoryview:
        return self.codec.encode(raw_bytes(chunk))

    def decode(self, data: bytes) -> torch.Tensor:
        return read_only(self.codec.decode(data), torch.uint8).view(self.spec.dtype).reshape(self.spec.shape)


class KiviWire:
    """KIVI's quantizer (methods/kivi.py QuantizedBlock) on whole chunks. The residual window of
    full-precision recent tokens is not on the wire: the tokens after the last whole chunk are
    recomputed at full precision on every load."""

    lossless = False

    def __init__(self, name: str, spec: ChunkSpec, bits: int, group: int) -> None:
        if spec.block_size % group or spec.head_size % group:
            raise ValueError(f"{name}: group_size {group} must divide block_size and head_size")
        self.name, self.spec, self.bits, self.group = name, spec, bits, group

    def encode(self, chunk: torch.Tensor) -> bytes:
        keys, values = layout.split(chunk.float())
        parts = {}
        for part, x, per_channel in (("k", keys, True), ("v", values, False)):
            block = QuantizedBlock(x, self.bits, self.group, per_channel)
            parts |= {f"{part}.packed": block.packed, f"{part}.scale": block.scale, f"{part}.zero": block.zero}
        return save_tensors({k: v.contiguous() for k, v in parts.items()})

    def decode(self, data: bytes) -> torch.Tensor:
        t = load_tensors(data)
        keys, values = (
            QuantizedBlock.from_parts(self.spec.token_rows, self.bits, self.group, per_channel,
                                      t[f"{part}.packed"], t[f"{part}.scale"], t[f"{part}.zero"]).dequantize()
            for part, per_channel in (("k", True), ("v", False))
        )
        return layout.join(keys, values).to(self.spec.dtype)


class TurboWire:
    """TurboQuant (methods/turboquant.py TurboBlock): keys b-1 MSE bits + 1-bit QJL, values b bits,
    with the per-layer rotations and sketches the method draws from the run's seed (not on the wire)."""

    lossless = False

    def __init__(self, name: str, spec: ChunkSpec, bits: int, seed: int) -> None:
        if bits < 2:
            raise ValueError(f"{name}: bits must be >= 2")
        self.name, self.spec, self.bits = name, spec, bits
        rotations, self.sketches = layer_constants(spec.layers, spec.head_size, seed)
        self.key_mse = [MseQuantizer(r, bits - 1) for r in rotations]
        self.value_mse = [MseQuantizer(r, bits) for r in rotations]

    def encode(self, chunk: torch.Tensor) -> bytes:
        keys, values = layout.split(chunk.float())
        k = [TurboBlock(keys[i], self.key_mse[i], self.sketches[i]) for i in range(self.spec.layers)]
        v = [TurboBlock(values[i], self.value_mse[i], None) for i in range(self.spec.layers)]
        stack = lambda blocks, field: torch.stack([getattr(b, field) for b in blocks]).contiguous()  # noqa: E731
        return save_tensors({
            "k.packed": stack(k, "packed"), "k.norms": stack(k, "norms"), "k.signs": stack(k, "signs"),
            "k.residual_norms": stack(k, "residual_norms"), "v.packed": stack(v, "packed"), "v.norms": stack(v, "norms"),
        })

    def decode(self, data: bytes) -> torch.Tensor:
        t = load_tensors(data)
        rows = self.spec.token_rows[1:]
        keys = torch.stack([
            TurboBlock.from_parts(rows, self.bits - 1, t["k.packed"][i], t["k.norms"][i], t["k.signs"][i],
                                  t["k.residual_norms"][i]).decode(self.key_mse[i], self.sketches[i])
            for i in range(self.spec.layers)
        ])
        values = torch.stack([
            TurboBlock.from_parts(rows, self.bits, t["v.packed"][i], t["v.norms"][i], None, None).decode(self.value_mse[i], None)
            for i in range(self.spec.layers)
        ])
        return layout.join(keys, values).to(self.spec.dtype)


class Fp8Wire:
    """fp8 e4m3 (methods/fp8.py to_fp8_bytes): elementwise, so the packed layout needs no unpacking."""

    lossless = False

    def __init__(self, name: str, spec: ChunkSpec) -> None:
        self.name, self.spec = name, spec

    def encode(self, chunk: torch.Tensor) -> memoryview:
        return raw_bytes(to_fp8_bytes(chunk.float()))

    def decode(self, data: bytes) -> torch.Tensor:
        codes = read_only(data, torch.uint8).view(torch.float8_e4m3fn)
        return codes.to(self.spec.dtype).reshape(self.spec.shape)


def wire_format(name: str, spec: ChunkSpec, method: Mapping[str, Any] | None = None, seed: int = 0) -> WireFormat:
    """The wire format `name`: a kv-stage codec, or a method config entry {kind: kivi|turboquant|fp8, ...}."""
    if is_lossless(name):
        return Lossless(name, spec)
    kind = (method or {}).get("kind")
    if kind not in LOSSY_KINDS:
        raise ValueError(f"{name!r}: not a codec and not a quantizing method ({method})")
    if spec.dtype.itemsize == 1:
        raise ValueError(f"{name}: the cache is already 8-bit ({spec.dtype}); lossy formats need a 16/32-bit cache")
    if kind == "kivi":
        return KiviWire(name, spec, int(method["bits"]), int(method.get("group_size", 32)))
    if kind == "turboquant":
        return TurboWire(name, spec, int(method["bits"]), seed)
    return Fp8Wire(name, spec)

"""Wire formats of offloaded chunks: the kv stage's lossless codecs on the cache's own bytes, and
the method registry's quantizers on K and V as lossy formats (one implementation of each).

A chunk is one block of every layer, [layers, kv_heads, block_size, 2 * head_size] in the
cache's own layout (vLLM's packed CPU layouts or the CUDA backends' token rows, see layout.py).
Lossless formats compress those bytes as they are, so a load restores them exactly. Lossy
formats unpack K and V to token rows of head_size first, because the
methods define their statistics on those rows (KIVI: keys per channel over groups of G tokens,
values per token over groups of G channels; TurboQuant: one rotated vector per token and head).
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from typing import Any, Mapping, Protocol

import numpy as np
import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from kvbench.kv.codecs import get_codec
from kvbench.kv.storage import INT_OF_ITEMSIZE
from kvbench.methods import native
from kvbench.methods.base import ModelShape
from kvbench.methods.catalog import build_cache
from kvbench.methods.fp8 import to_fp8_bytes
from kvbench.methods.kinds import settings_of
from kvbench.methods.kivi import QuantizedBlock
from kvbench.methods.turboquant import TurboBlock
from kvbench.serve import layout
from kvbench.serve.layout import CPU_PACKED
from kvbench.serve.names import LOSSY_KINDS, is_lossless


@dataclass(frozen=True)
class ChunkSpec:
    layers: int
    kv_heads: int
    block_size: int
    head_size: int
    dtype: torch.dtype
    layout: str = CPU_PACKED  # see layout.py

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


def save_blocks(groups: Mapping[str, list[Any]]) -> bytes:
    """Blocks of a method's own classes as one safetensors object: per group, every tensor
    attribute stacked over the group's blocks (e.g. one block per layer); the other attributes
    (shape, bits, absent parts) once, as JSON metadata. No code travels, unlike a pickle."""
    tensors: dict[str, torch.Tensor] = {}
    attrs: dict[str, dict[str, Any]] = {}
    for group, blocks in groups.items():
        attrs[group] = {}
        for name, value in vars(blocks[0]).items():
            if isinstance(value, torch.Tensor):
                tensors[f"{group}.{name}"] = torch.stack([vars(b)[name] for b in blocks]).contiguous()
            else:
                attrs[group][name] = list(value) if isinstance(value, torch.Size) else value
    return save_tensors(tensors, metadata={"attrs": json.dumps(attrs)})


def load_blocks(data: bytes, classes: Mapping[str, type]) -> dict[str, list[Any]]:
    """Inverse of `save_blocks`: the blocks of each group, rebuilt without calling the encoder."""
    header = json.loads(bytes(data[8 : 8 + int.from_bytes(data[:8], "little")]))
    attrs = json.loads(header["__metadata__"]["attrs"])
    tensors = load_tensors(bytes(data))
    out = {}
    for group, cls in classes.items():
        stacked = {key.split(".", 1)[1]: t for key, t in tensors.items() if key.split(".", 1)[0] == group}
        count = len(next(iter(stacked.values())))
        blocks = []
        for i in range(count):
            block = cls.__new__(cls)
            for name, value in attrs[group].items():
                setattr(block, name, torch.Size(value) if name == "shape" else value)
            for name, tensor in stacked.items():
                setattr(block, name, tensor[i])
            blocks.append(block)
        out[group] = blocks
    return out


def token_rows(spec: ChunkSpec, chunk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of a chunk as dense float32 token rows [layers, kv_heads, block_size, head_size]:
    the same memory layout from either cache layout, so a lossy format computes on identical
    tensors (a matmul over a transposed or strided view may round differently on some CPUs)."""
    keys, values = layout.SPLIT[spec.layout](chunk.float())
    return keys.contiguous(), values.contiguous()


class KiviWire:
    """KIVI's quantizer (methods/kivi.py QuantizedBlock) on whole chunks, all layers in one block:
    keys per channel over groups of `group_size` tokens, values per token over groups of channels.
    The residual window of full-precision recent tokens is not on the wire: the tokens after the
    last whole chunk are recomputed at full precision on every load."""

    lossless = False

    def __init__(self, name: str, spec: ChunkSpec, bits: int, group: int) -> None:
        if spec.block_size % group or spec.head_size % group:
            raise ValueError(f"{name}: group_size {group} must divide block_size and head_size")
        self.name, self.spec, self.bits, self.group = name, spec, bits, group

    def encode(self, chunk: torch.Tensor) -> bytes:
        keys, values = token_rows(self.spec, chunk)
        return save_blocks(
            {
                "k": [QuantizedBlock(keys, self.bits, self.group, True)],
                "v": [QuantizedBlock(values, self.bits, self.group, False)],
            }
        )

    def decode(self, data: bytes) -> torch.Tensor:
        blocks = load_blocks(data, {"k": QuantizedBlock, "v": QuantizedBlock})
        return layout.JOIN[self.spec.layout](blocks["k"][0].dequantize(), blocks["v"][0].dequantize()).to(
            self.spec.dtype
        )


class TurboWire:
    """TurboQuant (methods/turboquant.py TurboBlock), one block per layer, with the quantizers and
    sketches of the method's own cache for this seed (the system stage's constants; not on the
    wire): keys b-1 MSE bits + 1-bit QJL (variant prod), values b bits."""

    lossless = False

    def __init__(self, name: str, spec: ChunkSpec, method: Mapping[str, Any], seed: int) -> None:
        shape = ModelShape(layers=spec.layers, kv_heads=spec.kv_heads, q_heads=spec.kv_heads, head_dim=spec.head_size)
        self.name, self.spec = name, spec
        self.layers = build_cache(dict(method), shape, seed).layers
        native.library()  # its encode kernels built now (seconds on a cold cache), not in the first store

    def encode(self, chunk: torch.Tensor) -> bytes:
        keys, values = token_rows(self.spec, chunk)
        return save_blocks(
            {
                "k": [TurboBlock(keys[i], layer.key_mse, layer.sketch) for i, layer in enumerate(self.layers)],
                "v": [TurboBlock(values[i], layer.value_mse, None) for i, layer in enumerate(self.layers)],
            }
        )

    def decode(self, data: bytes) -> torch.Tensor:
        blocks = load_blocks(data, {"k": TurboBlock, "v": TurboBlock})
        keys = torch.stack([b.decode(layer.key_mse, layer.sketch) for b, layer in zip(blocks["k"], self.layers)])
        values = torch.stack([b.decode(layer.value_mse, None) for b, layer in zip(blocks["v"], self.layers)])
        return layout.JOIN[self.spec.layout](keys, values).to(self.spec.dtype)


class Fp8Wire:
    """fp8 e4m3 (methods/fp8.py to_fp8_bytes): elementwise, so the packed layout needs no unpacking.
    Decoding, and encoding a 16-bit cache, look each element up in a table: for encoding, the
    method's own cast of every 16-bit pattern; for decoding, torch's cast of every code to the
    cache dtype. The same codes and values as those casts (one exception: torch's scalar tail of a
    vectorized fp16 cast drops a negative NaN's sign, code 0x7F where the table gives 0xFF; both
    decode to NaN). torch's elementwise casts between fp8 and bf16 ran at ~0.5 GB/s on one core,
    a fraction of the raw client's speed."""

    lossless = False

    def __init__(self, name: str, spec: ChunkSpec) -> None:
        self.name, self.spec = name, spec
        bits = INT_OF_ITEMSIZE[spec.dtype.itemsize]
        codes = torch.arange(256, dtype=torch.uint8)
        self._decode_table = codes.view(torch.float8_e4m3fn).to(spec.dtype).view(bits).numpy()
        self._encode_table = None
        if spec.dtype.itemsize == 2:  # every 16-bit pattern, through the same cast as the chunk
            patterns = torch.from_numpy(np.arange(2**16, dtype=np.uint16).view(np.int16)).view(spec.dtype)
            self._encode_table = to_fp8_bytes(patterns.float()).numpy()

    def encode(self, chunk: torch.Tensor) -> memoryview:
        if self._encode_table is None:
            return raw_bytes(to_fp8_bytes(chunk.float()))
        patterns = chunk.contiguous().view(torch.int16).numpy().view(np.uint16).reshape(-1)
        return np.take(self._encode_table, patterns).data

    def decode(self, data: bytes) -> torch.Tensor:
        values = np.take(self._decode_table, np.frombuffer(data, dtype=np.uint8))
        return torch.from_numpy(values).view(self.spec.dtype).reshape(self.spec.shape)


def unpacks(name: str, method: Mapping[str, Any] | None) -> bool:
    """Whether the format computes on K and V as token rows (KIVI, TurboQuant): it needs a layout
    layout.SPLIT knows; lossless and fp8 formats work on the cache's bytes or elements as they are."""
    return not is_lossless(name) and (method or {}).get("kind") in ("kivi", "turboquant")


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
        kivi = settings_of(method)
        return KiviWire(name, spec, kivi.bits, kivi.group_size)
    if kind == "turboquant":
        return TurboWire(name, spec, method, seed)
    return Fp8Wire(name, spec)

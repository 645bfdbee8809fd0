"""`turboquant`: random rotation + Lloyd-Max scalar codebook, plus a 1-bit QJL residual stage
for unbiased inner products (Zandieh et al. 2025, arXiv 2504.19874).

Per vector x: norm n = |x|, rotated unit vector y = R x / n, whose coordinates are close to
N(0, 1/d); each coordinate is quantized with the Lloyd-Max codebook of N(0, 1) scaled by 1/sqrt(d).
Keys (b bits total) use b-1 bits for that MSE stage and 1 bit for QJL on the residual
r = x - x_mse: signs s = sign(S r) with S Gaussian, and |r|. Since
E[sqrt(pi/2)/d * |r| * <S q, s>] = <q, r>, the key attention sees,
x_mse + sqrt(pi/2)/d * |r| * S^T s, gives unbiased scores q.k. Values use all b bits for MSE.
R and S are shared per layer and counted once.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any

import torch

from kvbench.methods.base import MethodCache, MethodLayer, ModelShape, register, tensor_bytes
from kvbench.methods.packing import pack, unpack, unpack_as


def _pdf(x: float) -> float:
    return math.exp(-x * x / 2) / math.sqrt(2 * math.pi) if math.isfinite(x) else 0.0


def _cdf(x: float) -> float:
    return 0.5 * (1 + math.erf(x / math.sqrt(2))) if math.isfinite(x) else float(x > 0)


@lru_cache(maxsize=None)
def lloyd_max(bits: int, iterations: int = 500) -> tuple[tuple[float, ...], float]:
    """Centroids of the optimal 2**bits-level scalar quantizer of N(0, 1), and its MSE distortion."""
    levels = 2**bits
    centroids = [(i + 0.5 - levels / 2) * 4 / levels for i in range(levels)]
    for _ in range(iterations):
        edges = [-math.inf] + [(a + b) / 2 for a, b in zip(centroids, centroids[1:])] + [math.inf]
        centroids = [
            (_pdf(lo) - _pdf(hi)) / max(_cdf(hi) - _cdf(lo), 1e-300) for lo, hi in zip(edges, edges[1:])
        ]
    edges = [-math.inf] + [(a + b) / 2 for a, b in zip(centroids, centroids[1:])] + [math.inf]
    distortion = 0.0
    for c, lo, hi in zip(centroids, edges, edges[1:]):
        mass = _cdf(hi) - _cdf(lo)
        first = _pdf(lo) - _pdf(hi)  # E[X 1{lo<X<hi}]
        second = mass + (lo * _pdf(lo) if math.isfinite(lo) else 0) - (hi * _pdf(hi) if math.isfinite(hi) else 0)
        distortion += second - 2 * c * first + c * c * mass
    return tuple(centroids), distortion


class MseQuantizer:
    """Rotation + Lloyd-Max codebook on unit vectors; norms kept in fp16."""

    def __init__(self, rotation: torch.Tensor, bits: int) -> None:
        self.rotation, self.bits = rotation, bits
        d = rotation.shape[0]
        centroids, _ = lloyd_max(bits)
        self.codebook = torch.tensor(centroids, dtype=torch.float32) / math.sqrt(d)
        self.edges = (self.codebook[1:] + self.codebook[:-1]) / 2
        self.levels = tuple(self.codebook.tolist())

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        norms = x.norm(dim=-1, keepdim=True)
        unit = x / norms.clamp_min(1e-12)
        rotated = unit @ self.rotation.T
        # The code is the number of edges below: a few vectorized comparisons beat bucketize's
        # per-element binary search several times over.
        codes = torch.zeros(rotated.shape, dtype=torch.uint8, device=rotated.device)
        for edge in self.edges.tolist():
            codes += rotated > edge
        return codes, norms.to(torch.float16)

    def decode(self, codes: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
        return (self.codebook[codes.long()] @ self.rotation) * norms.float()


MERGE_AFTER = 16  # decode blocks (one token each) merged into one packed block


def qjl_scale(d: int) -> float:
    return math.sqrt(math.pi / 2) / d


class TurboBlock:
    """Tokens of K or V, packed: codes, fp16 norms, and for keys QJL signs + fp16 residual norms."""

    def __init__(self, x: torch.Tensor, mse: MseQuantizer, sketch: torch.Tensor | None) -> None:
        codes, norms = mse.encode(x.float())
        signs = residual_norms = None
        if sketch is not None:
            residual = x.float() - mse.decode(codes, norms)
            signs = (residual @ sketch.T > 0).to(torch.uint8)
            residual_norms = residual.norm(dim=-1, keepdim=True).to(torch.float16)
        self._store(codes, norms, signs, residual_norms, mse.bits)

    def _store(self, codes: torch.Tensor, norms: torch.Tensor, signs: torch.Tensor | None,
               residual_norms: torch.Tensor | None, bits: int) -> None:
        self.shape, self.bits, self.norms, self.residual_norms = codes.shape, bits, norms, residual_norms
        self.packed = pack(codes, bits)
        self.signs = pack(signs, 1) if signs is not None else None

    def parts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        codes = unpack(self.packed, self.bits, self.shape.numel()).reshape(self.shape)
        signs = unpack(self.signs, 1, self.shape.numel()).reshape(self.shape) if self.signs is not None else None
        return codes, self.norms, signs, self.residual_norms

    @classmethod
    def merged(cls, blocks: list["TurboBlock"]) -> "TurboBlock":
        """One block holding the tokens of `blocks` (decode appends one token per block)."""
        parts = [b.parts() for b in blocks]
        out = cls.__new__(cls)
        cat = [torch.cat(items, dim=-2) if items[0] is not None else None for items in zip(*parts)]
        out._store(*cat, blocks[0].bits)
        return out

    def decode(self, mse: MseQuantizer, sketch: torch.Tensor | None) -> torch.Tensor:
        """Every token of the block at fp32; runs each decode step, so codes become codebook values
        (and signs +-1) by table lookup straight from the packed bytes."""
        n = self.shape.numel()
        out = (unpack_as(self.packed, self.bits, n, mse.levels).view(self.shape) @ mse.rotation).mul_(self.norms.float())
        if sketch is not None and self.signs is not None:
            signs = unpack_as(self.signs, 1, n, (-1.0, 1.0)).view(self.shape)
            out.add_((signs @ sketch).mul_(self.residual_norms.float() * qjl_scale(self.shape[-1])))
        return out

    def nbytes(self) -> int:
        return tensor_bytes(self.packed, self.norms, self.signs, self.residual_norms)


class TurboLayer(MethodLayer):
    def __init__(self, rotation: torch.Tensor, sketch: torch.Tensor, bits: int) -> None:
        super().__init__()
        self.key_mse, self.value_mse = MseQuantizer(rotation, bits - 1), MseQuantizer(rotation, bits)
        self.sketch = sketch
        self.key_blocks: list[TurboBlock] = []
        self.value_blocks: list[TurboBlock] = []
        self.tokens = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        prefill = not self.is_initialized
        if prefill:
            self.lazy_initialization(key_states, value_states)
        self.key_blocks.append(TurboBlock(key_states, self.key_mse, self.sketch))
        self.value_blocks.append(TurboBlock(value_states, self.value_mse, None))
        self.tokens += key_states.shape[-2]
        if prefill:  # the prompt attends in full precision; the cache holds the quantized form
            return key_states, value_states
        if len(self.key_blocks) > MERGE_AFTER:  # keep per-step work vectorized over few blocks
            self.key_blocks = [TurboBlock.merged(self.key_blocks)]
            self.value_blocks = [TurboBlock.merged(self.value_blocks)]
        dtype = key_states.dtype
        keys = torch.cat([b.decode(self.key_mse, self.sketch) for b in self.key_blocks], dim=-2)
        values = torch.cat([b.decode(self.value_mse, None) for b in self.value_blocks], dim=-2)
        return keys.to(dtype), values.to(dtype)

    def get_seq_length(self) -> int:
        return self.tokens

    def nbytes(self) -> int:
        return sum(b.nbytes() for b in self.key_blocks + self.value_blocks)


def random_rotation(d: int, generator: torch.Generator) -> torch.Tensor:
    q, r = torch.linalg.qr(torch.randn(d, d, generator=generator))
    return q * torch.sign(torch.diagonal(r))  # Haar-distributed


@register("turboquant")
def turboquant(settings: dict[str, Any], shape: ModelShape, seed: int) -> MethodCache:
    bits = int(settings["bits"])
    if bits < 2:
        raise ValueError("turboquant: bits must be >= 2 (b-1 MSE bits + 1 QJL bit for keys)")
    gen = torch.Generator().manual_seed(seed)
    rotations = [random_rotation(shape.head_dim, gen) for _ in range(shape.layers)]
    sketches = [torch.randn(shape.head_dim, shape.head_dim, generator=gen) for _ in range(shape.layers)]
    layers = [TurboLayer(r, s, bits) for r, s in zip(rotations, sketches)]
    # Rotations and sketches are per-layer constants: stored once at fp16.
    shared = [t.to(torch.float16) for t in rotations + sketches]
    return MethodCache(layers, shared=shared)

"""`turboquant`: random rotation + Lloyd-Max scalar codebook, optionally plus a 1-bit QJL residual
stage for unbiased inner products (Zandieh et al. 2025, arXiv 2504.19874).

Per vector x: norm n = |x|, rotated unit vector y = R x / n, whose coordinates are close to
N(0, 1/d); each coordinate is quantized with the Lloyd-Max codebook of N(0, 1) scaled by 1/sqrt(d).
`variant: prod` (TurboQuant_prod, the default): keys (b bits total) use b-1 bits for that MSE stage
and 1 bit for QJL on the residual r = x - x_mse: signs s = sign(S r) with S Gaussian, and |r|. Since
E[sqrt(pi/2)/d * |r| * <S q, s>] = <q, r>, scores q.k against x_mse + sqrt(pi/2)/d * |r| * S^T s are
unbiased. `variant: mse` (TurboQuant_mse): keys use all b bits for the MSE stage, no QJL (biased
inner products, lower variance). Values always use b bits for the MSE stage.

Decode attends in the rotated domain (the method's own attention, installed by `attach`): the query
is rotated once per step, R q and S q, and scored against the stored codes as they are:
<q, k_hat> = n <R q, c> + sqrt(pi/2)/d |r| <S q, s>, with c the codebook values read from the packed
bytes and norms applied per token; the output sum_t p_t n_t c_t is rotated back once (R^T). No key
or value is rebuilt: O(T d) per step, not O(T d^2). R and S are per-layer fp32 constants held by the
cache and counted once, like the codebooks.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any

import torch

from kvbench.methods.attention import RoutedLayer, attach_routed
from kvbench.methods.base import MethodCache, MethodLayer, ModelShape, register, tensor_bytes
from kvbench.methods.kinds import TurboQuantSettings
from kvbench.methods.packing import (
    byte_scores,
    count_below,
    lut_dots,
    lut_sums,
    pack,
    pack_sign_magnitude,
    unpack,
    unpack_as,
    unpack_sign_magnitude,
    unpack_sign_magnitude_as,
)

QJL_SIGNS = (-1.0, 1.0)  # a sign bit's value


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
        centroids = [(_pdf(lo) - _pdf(hi)) / max(_cdf(hi) - _cdf(lo), 1e-300) for lo, hi in zip(edges, edges[1:])]
    edges = [-math.inf] + [(a + b) / 2 for a, b in zip(centroids, centroids[1:])] + [math.inf]
    distortion = 0.0
    for c, lo, hi in zip(centroids, edges, edges[1:]):
        mass = _cdf(hi) - _cdf(lo)
        first = _pdf(lo) - _pdf(hi)  # E[X 1{lo<X<hi}]
        second = mass + (lo * _pdf(lo) if math.isfinite(lo) else 0) - (hi * _pdf(hi) if math.isfinite(hi) else 0)
        distortion += second - 2 * c * first + c * c * mass
    return tuple(centroids), distortion


class MseQuantizer:
    """Rotation + Lloyd-Max codebook on unit vectors; norms kept in fp16. With `TurboBlock`, the
    block-level codec: `TurboBlock(x, mse, sketch)` encodes x [..., tokens, head_dim],
    `.decode(mse, sketch)` decodes to fp32 in the original domain, `.nbytes()` is what it holds."""

    def __init__(self, rotation: torch.Tensor, bits: int) -> None:
        self.rotation, self.bits = rotation, bits
        d = rotation.shape[0]
        centroids, _ = lloyd_max(bits)
        self.codebook = torch.tensor(centroids, dtype=torch.float32) / math.sqrt(d)
        self.edges = (self.codebook[1:] + self.codebook[:-1]) / 2
        self.levels, self.edge_values = tuple(self.codebook.tolist()), tuple(self.edges.tolist())

    def to(self, device: torch.device) -> None:
        """Move the rotation, codebook and edges to `device` (that of the K/V it encodes)."""
        self.rotation, self.codebook, self.edges = (t.to(device) for t in (self.rotation, self.codebook, self.edges))

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        norms = x.norm(dim=-1, keepdim=True)
        unit = x / norms.clamp_min(1e-12)
        rotated = unit @ self.rotation.T
        # The code is the number of edges below: the native kernel counts them in one pass; in
        # torch, for a prompt, a few vectorized comparisons beat bucketize's per-element binary
        # search several times over, and a decode step's few vectors take one op.
        if (codes := count_below(rotated, self.edges)) is not None:
            return codes, norms.to(torch.float16)
        if rotated.numel() < 1 << 14:  # NaN codes to 0 as in the comparisons (bucketize puts it last)
            codes = torch.bucketize(rotated, self.edges).masked_fill_(rotated.isnan(), 0)
            return codes.to(torch.uint8), norms.to(torch.float16)
        codes = torch.zeros(rotated.shape, dtype=torch.uint8, device=rotated.device)
        for edge in self.edge_values:
            codes += rotated > edge
        return codes, norms.to(torch.float16)

    def decode(self, codes: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
        return (self.codebook[codes.long()] @ self.rotation) * norms.float()

    def nbytes(self) -> int:
        """The codebook and its edges (the rotation is the layer's, counted there)."""
        return tensor_bytes(self.codebook, self.edges)


def qjl_scale(d: int) -> float:
    return math.sqrt(math.pi / 2) / d


def _rows(packed: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Packed codes as one row of bytes per token, so later tokens append along the token axis
    (head_dim * bits is a multiple of 8 for head_dim a multiple of 8)."""
    return packed.view(*shape[:-1], -1)


class TurboBlock:
    """Tokens of K or V, packed: codes, fp16 norms, and for keys QJL signs + fp16 residual norms.
    Each token's codes are one row of bytes; 1/2/4-bit codes are packed whole, 3-bit codes as a
    2-bit magnitude and a 1-bit sign plane (same bytes), so every code is read by byte-table lookups."""

    def __init__(self, x: torch.Tensor, mse: MseQuantizer, sketch: torch.Tensor | None) -> None:
        if x.shape[-1] % 8:
            raise ValueError(f"turboquant: head_dim {x.shape[-1]} must be a multiple of 8")
        codes, norms = mse.encode(x.float())
        signs = residual_norms = None
        if sketch is not None:
            residual = x.float() - mse.decode(codes, norms)
            signs = (residual @ sketch.T > 0).to(torch.uint8)
            residual_norms = residual.norm(dim=-1, keepdim=True).to(torch.float16)
        self.shape, self.bits, self.norms, self.residual_norms = codes.shape, mse.bits, norms, residual_norms
        if self.bits == 3:
            magnitude, code_signs = pack_sign_magnitude(codes)
            self.packed, self.code_signs = _rows(magnitude, self.shape), _rows(code_signs, self.shape)
        else:
            self.packed, self.code_signs = _rows(pack(codes, self.bits, check=False), self.shape), None
        self.signs = _rows(pack(signs, 1, check=False), self.shape) if signs is not None else None

    def append(self, later: "TurboBlock") -> None:
        """Take the tokens of `later` after this block's (one decode step's, usually)."""
        for name in ("packed", "code_signs", "norms", "signs", "residual_norms"):
            mine = getattr(self, name)
            if mine is not None:
                setattr(self, name, torch.cat([mine, getattr(later, name)], dim=-2))
        self.shape = torch.Size((*self.shape[:-2], self.shape[-2] + later.shape[-2], self.shape[-1]))

    def codes(self) -> torch.Tensor:
        n = self.shape.numel()
        if self.code_signs is not None:
            return unpack_sign_magnitude(self.packed, self.code_signs, n).reshape(self.shape)
        return unpack(self.packed, self.bits, n).reshape(self.shape)

    def levels(self, mse: MseQuantizer) -> torch.Tensor:
        """Each coordinate's codebook value (rotated domain, unit norm), by table lookup straight
        from the packed bytes: [..., tokens, d] fp32."""
        n = self.shape.numel()
        if self.code_signs is not None:
            return unpack_sign_magnitude_as(self.packed, self.code_signs, n, mse.levels).view(self.shape)
        return unpack_as(self.packed, self.bits, n, mse.levels).view(self.shape)

    def qjl_signs(self) -> torch.Tensor:
        """The QJL signs as +-1: [..., tokens, d] fp32."""
        return unpack_as(self.signs, 1, self.shape.numel(), QJL_SIGNS).view(self.shape)

    def level_scores(self, mse: MseQuantizer, x: torch.Tensor) -> torch.Tensor:
        """x @ levels^T: [..., R, d] -> [..., R, tokens], by the native kernel from the packed bytes;
        without it, 1-bit codes by per-query byte tables (`byte_scores`), wider codes unpacked then
        a matmul (see `byte_scores` for why)."""
        native = lut_dots(self.packed, self.bits, mse.levels, x, signs=self.code_signs)
        if native is not None:
            return native
        if self.bits == 1:
            return byte_scores(self.packed, 1, mse.levels, x)
        return x @ self.levels(mse).transpose(-1, -2)

    def level_sums(self, mse: MseQuantizer, weights: torch.Tensor) -> torch.Tensor:
        """weights @ levels: [..., R, tokens] -> [..., R, d] (native kernel, else unpack and matmul)."""
        native = lut_sums(self.packed, self.bits, mse.levels, weights, signs=self.code_signs)
        return native if native is not None else weights @ self.levels(mse)

    def qjl_scores(self, x: torch.Tensor) -> torch.Tensor:
        """x @ qjl_signs^T from the packed sign bits: [..., R, d] -> [..., R, tokens]."""
        native = lut_dots(self.signs, 1, QJL_SIGNS, x)
        return native if native is not None else byte_scores(self.signs, 1, QJL_SIGNS, x)

    def qjl_weights(self) -> torch.Tensor:
        """sqrt(pi/2)/d |r| per token: [..., tokens]."""
        return self.residual_norms.float()[..., 0] * qjl_scale(self.shape[-1])

    def decode(self, mse: MseQuantizer, sketch: torch.Tensor | None) -> torch.Tensor:
        """Every token of the block at fp32 in the original domain (rotated back, QJL term added)."""
        out = (self.levels(mse) @ mse.rotation).mul_(self.norms.float())
        if sketch is not None and self.signs is not None:
            out.add_((self.qjl_signs() @ sketch).mul_(self.qjl_weights()[..., None]))
        return out

    def nbytes(self) -> int:
        return tensor_bytes(self.packed, self.code_signs, self.norms, self.signs, self.residual_norms)


class TurboLayer(RoutedLayer, MethodLayer):
    def __init__(self, rotation: torch.Tensor, sketch: torch.Tensor | None, bits: int) -> None:
        super().__init__()
        self.rotation, self.sketch = rotation, sketch  # sketch None: the MSE-only variant
        self.key_mse = MseQuantizer(rotation, bits - 1 if sketch is not None else bits)
        self.value_mse = MseQuantizer(rotation, bits)
        self.key_block: TurboBlock | None = None
        self.value_block: TurboBlock | None = None

    def follow(self, device: torch.device) -> None:
        """Keep the constants (built on the CPU from the seed, so every device draws the same ones)
        on the device of the K/V this layer receives."""
        if self.rotation.device != device:
            self.rotation = self.rotation.to(device)
            self.sketch = self.sketch.to(device) if self.sketch is not None else None
            for mse in (self.key_mse, self.value_mse):
                mse.to(device)
                mse.rotation = self.rotation  # one copy per layer, as on the CPU

    def constants(self) -> list[torch.Tensor]:
        return [t for t in (self.rotation, self.sketch) if t is not None]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        self.follow(key_states.device)
        keys, values = TurboBlock(key_states, self.key_mse, self.sketch), TurboBlock(value_states, self.value_mse, None)
        if not self.is_initialized:  # the prompt attends in full precision; the cache holds the quantized form
            self.lazy_initialization(key_states, value_states)
            self.key_block, self.value_block = keys, values
            return key_states, value_states
        self.require_attached("turboquant")
        self.key_block.append(keys)
        self.value_block.append(values)
        self.pending = True
        return key_states, value_states  # unused: `attend` reads the blocks

    def rotate_query(self, query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(R q, S q): scores against the codebook values and the QJL signs."""
        q = query.float()
        return q @ self.rotation.T, (q @ self.sketch.T if self.sketch is not None else None)

    def scores(self, query: torch.Tensor) -> torch.Tensor:
        """<q, k_hat> for every cached key, computed in the rotated domain: query [b, Hq, n, d]
        (GQA: consecutive query heads share a KV head) -> [b, Hq, n, T]."""
        b, hq, n, d = query.shape
        block = self.key_block
        hkv, t = block.shape[1], block.shape[-2]
        rotated, sketched = (
            x.reshape(b, hkv, hq // hkv * n, d) if x is not None else None for x in self.rotate_query(query)
        )
        scores = block.level_scores(self.key_mse, rotated).mul_(block.norms.float()[..., 0][:, :, None])
        if sketched is not None:
            scores.add_(block.qjl_scores(sketched).mul_(block.qjl_weights()[:, :, None]))
        return scores.view(b, hq, n, t)

    def weighted_values(self, probs: torch.Tensor) -> torch.Tensor:
        """sum_t p_t v_hat_t for probs [b, Hq, n, T] -> [b, n, Hq, d]: summed in the rotated domain
        (norms folded into the weights), rotated back once."""
        b, hq, n, t = probs.shape
        block = self.value_block
        hkv = block.shape[1]
        p = probs.reshape(b, hkv, hq // hkv * n, t) * block.norms.float()[..., 0][:, :, None]
        out = block.level_sums(self.value_mse, p)
        return (out @ self.rotation).view(b, hq, n, -1).transpose(1, 2)

    def decoded(self, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """Every key and value in the original domain (rebuilt through R and S): a reference for
        tests and the block-level codec, not what decode attends through."""
        keys = self.key_block.decode(self.key_mse, self.sketch)
        values = self.value_block.decode(self.value_mse, None)
        return keys.to(dtype), values.to(dtype)

    def get_seq_length(self) -> int:
        return self.key_block.shape[-2] if self.key_block is not None else 0

    def nbytes(self) -> int:
        blocks = sum(b.nbytes() for b in (self.key_block, self.value_block) if b is not None)
        return blocks + self.key_mse.nbytes() + self.value_mse.nbytes()


class TurboCache(MethodCache):
    def nbytes(self) -> int:
        """The layers' blocks and codebooks plus their rotations and sketches, each storage once."""
        constants = {id(t): t for layer in self.layers for t in layer.constants()}
        return sum(layer.nbytes() for layer in self.layers) + tensor_bytes(*constants.values())

    def attach(self, model: torch.nn.Module) -> list[Any]:
        return attach_routed(model, self.layers)


def random_rotation(d: int, generator: torch.Generator) -> torch.Tensor:
    q, r = torch.linalg.qr(torch.randn(d, d, generator=generator))
    return q * torch.sign(torch.diagonal(r))  # Haar-distributed


@register("turboquant")
def turboquant(settings: TurboQuantSettings, shape: ModelShape, seed: int) -> MethodCache:
    bits, variant = settings.bits, settings.variant
    gen = torch.Generator().manual_seed(seed)
    rotations = [random_rotation(shape.head_dim, gen) for _ in range(shape.layers)]
    sketches = [torch.randn(shape.head_dim, shape.head_dim, generator=gen) for _ in range(shape.layers)]
    if variant == "mse":  # drawn anyway: both variants of one seed share their rotations
        sketches = [None] * shape.layers
    # Rotations and sketches are per-layer fp32 constants, counted once each (see TurboCache.nbytes).
    return TurboCache([TurboLayer(r, s, bits) for r, s in zip(rotations, sketches)])

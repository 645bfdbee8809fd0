"""The method registry: every KV method is a transformers Cache whose layers report their bytes.

A method is one module that registers a factory under its `kind` (declared, with its settings, in
methods/kinds.py); config entries such as `kivi2: {kind: kivi, bits: 2, group_size: 32, residual: 128}`
pick the kind and its settings, and `kvbench.methods.catalog.build_cache` builds the cache.

`nbytes()` is every byte the cache object holds: codes, scales, zero points, residual windows, kept
tokens, spare room, and method state (scores, buffered queries, rotations): it counts the storages
behind the tensors a layer holds, so a view counts the whole storage it keeps alive. Layers release
captured queries as soon as they are used; tests walk every cache's storages to check it.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
from transformers.cache_utils import Cache, DynamicLayer

from kvbench.methods.attention import RoutedLayer
from kvbench.methods.kinds import KINDS, MethodSettings

STORAGE = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
# A growing cache's new room has 1/GROWTH of its tokens spare (MethodLayer.append): at most that
# share of bytes held beyond the used ones, and one whole-cache copy per T/GROWTH decode steps.
GROWTH = 64


@dataclass(frozen=True)
class ModelShape:
    layers: int
    kv_heads: int
    q_heads: int
    head_dim: int

    @classmethod
    def of(cls, config: Any) -> "ModelShape":
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(config.num_hidden_layers, config.num_key_value_heads, config.num_attention_heads, head_dim)

    def full_bytes(self, tokens: int, bytes_per_value: int = 2) -> int:
        """Bytes of a full K+V cache for `tokens` tokens at a 16-bit storage dtype."""
        return 2 * self.layers * self.kv_heads * self.head_dim * tokens * bytes_per_value


def tensor_bytes(*tensors: torch.Tensor | None) -> int:
    """Bytes of the storages behind `tensors`, each once: a view counts all the storage it keeps alive."""
    # Keyed by address; tensors without one (the meta device) each count on their own.
    storages = {t.untyped_storage().data_ptr() or id(t): t.untyped_storage().nbytes() for t in tensors if t is not None}
    return sum(storages.values())


def owned(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`x` (at `dtype` if given) in a contiguous storage of its own: never the caller's tensor, nor a
    view of it (a slice would keep its parent's whole storage alive)."""
    return x.to(dtype=dtype or x.dtype, copy=True, memory_format=torch.contiguous_format)


def layer_seed(seed: int, layer: int, event: int = 0) -> int:
    """A distinct, reproducible seed per (run seed, layer, event): random draws need no held state."""
    return (seed * 1_000_003 + layer) * 1_000_003 + event


class MethodLayer(DynamicLayer):
    """A cache layer that can say how many bytes it holds (codes, scales, zero points, windows)."""

    def nbytes(self) -> int:
        return tensor_bytes(self.keys, self.values)

    def append(self, name: str, new: torch.Tensor) -> torch.Tensor:
        """Attribute `name` ([B, H, T, d]) with `new` appended along the tokens, written in place into
        room this layer allocated after them (T/GROWTH + 1 tokens ahead): torch.cat, as DynamicLayer
        does, copies the whole cache at every decode step and layer, about 15 ms of a 4K step on a
        2-core CPU. The attribute becomes a view of the room, and nbytes counts the room. Only the
        very tensor this method last returned is extended in place; anything else (a prefill, a
        cache rebuilt by eviction, a cropped view) is copied into a new room, so no view handed out
        earlier ever changes."""
        held, last = getattr(self, name), self.__dict__.setdefault("appended", {})
        b, h, t, d = held.shape
        if new.shape[:2] != (b, h) or new.shape[-1] != d or new.dtype != held.dtype or new.device != held.device:
            raise ValueError(
                f"{name}: cannot append {tuple(new.shape)} {new.dtype} on {new.device} "
                f"to {tuple(held.shape)} {held.dtype} on {held.device}"
            )
        n, ref = new.shape[-2], last.get(name)
        if ref is None or ref() is not held or t + n > held.stride(1) // d:
            room = held.new_empty(b, h, t + n + (t + n) // GROWTH + 1, d)
            room[:, :, :t] = held
            held = room[:, :, :t]
        grown = held.as_strided((b, h, t + n, d), held.stride())
        grown[:, :, t:] = new
        setattr(self, name, grown)
        last[name] = weakref.ref(grown)  # a weak reference: a replaced room is freed
        return grown


class MethodCache(Cache):
    """A Cache of MethodLayers."""

    def __init__(self, layers: list[MethodLayer]) -> None:
        super().__init__(layers=layers)

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)

    def attach(self, model: torch.nn.Module) -> list[Any]:
        """Install what the method needs on `model` for a prefill through this cache (query capture);
        returns handles with `.remove()`. Decode steps go through `attend` instead (kvbench.decode)."""
        return []

    def attend(
        self,
        index: int,
        original: Callable,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask: torch.Tensor | None,
        **kwargs: Any,
    ):
        """One forward pass's attention at layer `index` through this cache (one row of the decode
        loop): store the new K/V, then attend over what the layer returns, or over its own stored
        form where the layer attends itself (KIVI, TurboQuant)."""
        layer = self.layers[index]
        keys, values = layer.update(key, value)
        if isinstance(layer, RoutedLayer):
            return layer.attend(original, module, query, keys, values, mask, **kwargs)
        return original(module, query, keys, values, mask, **kwargs)

    def decoding(self, on: bool) -> None:
        """Entering (leaving) the decode loop's per-row attention: layers that attend over their
        stored form do so only there."""
        for layer in self.layers:
            if isinstance(layer, RoutedLayer):
                layer.attached = on

    def fork(self, model: torch.nn.Module, prefill: Any, upto: int) -> None:
        """Build this (fresh) cache from a shared full-precision prefill (kvbench.prefill.Prefill): each
        layer receives the first `upto` positions' K/V as a prefill through this cache would pass them
        (bit for bit when `upto` is the whole prefill; within kernel rounding for a prefix, see
        kvbench.prefill), and whatever else the method reads then (queries, from the captured inputs)."""
        for index, layer in enumerate(self.layers):
            self.before_fork(model, index, prefill, upto)
            layer.update(prefill.keys[index][..., :upto, :], prefill.values[index][..., :upto, :])

    def before_fork(self, model: torch.nn.Module, index: int, prefill: Any, upto: int) -> None:
        pass


# The factory of a kind: its settings (typed, defaults filled in), the model's shape, the run seed.
Factory = Callable[[MethodSettings, ModelShape, int], MethodCache]
METHODS: dict[str, Factory] = {}


def register(kind: str) -> Callable[[Factory], Factory]:
    """Register the factory of `kind` (declared in methods/kinds.py)."""

    def wrap(factory: Factory) -> Factory:
        if kind not in KINDS or kind in METHODS:
            raise ValueError(f"method kind {kind!r} is not declared in kvbench.methods.kinds or registered twice")
        METHODS[kind] = factory
        return factory

    return wrap

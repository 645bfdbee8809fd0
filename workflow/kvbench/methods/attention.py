"""Attention a cache layer runs itself (TurboQuant attends in its rotated domain).

transformers picks each attention module's function by `config._attn_implementation`. While a
cache that routes attention is attached, that function is wrapped: modules with a route call it
(with the original function, to delegate to), every other call runs exactly as before. The last
handle removed restores the original function.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any, Callable

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

# route(original, module, query, key, value, attention_mask, **kwargs) -> (output, weights)
Route = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]

_ROUTES: "weakref.WeakKeyDictionary[torch.nn.Module, Route]" = weakref.WeakKeyDictionary()
_WRAPPED: dict[str, tuple[Callable | None, int]] = {}  # name -> (local override it replaced, handles)


def _original(name: str, module: torch.nn.Module) -> Callable:
    previous, _ = _WRAPPED[name]
    if previous is not None:
        return previous
    if name == "eager":  # not in the registry: each model file defines its own
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS._global_mapping[name]


def _dispatcher(name: str) -> Callable:
    def attention(module: torch.nn.Module, *args: Any, **kwargs: Any):
        original = _original(name, module)
        route = _ROUTES.get(module)
        return original(module, *args, **kwargs) if route is None else route(original, module, *args, **kwargs)

    return attention


class RouteHandle:
    def __init__(self, name: str, module: torch.nn.Module) -> None:
        self.name, self.module = name, module

    def remove(self) -> None:
        if self.module is None:
            return
        _ROUTES.pop(self.module, None)
        previous, count = _WRAPPED[self.name]
        if count > 1:
            _WRAPPED[self.name] = (previous, count - 1)
        else:
            del _WRAPPED[self.name]
            if previous is None:
                del ALL_ATTENTION_FUNCTIONS[self.name]
            else:
                ALL_ATTENTION_FUNCTIONS[self.name] = previous
        self.module = None


def route_attention(model: torch.nn.Module, routes: dict[int, Route]) -> list[RouteHandle]:
    """Route the attention of decoder layer i of `model` through routes[i]; returns the handles."""
    name = model.config._attn_implementation or "eager"
    handles = []
    for index, route in routes.items():
        module = model.model.layers[index].self_attn
        if name not in _WRAPPED:
            previous = ALL_ATTENTION_FUNCTIONS._local_mapping.get(name)
            _WRAPPED[name] = (previous, 0)
            ALL_ATTENTION_FUNCTIONS[name] = _dispatcher(name)
        previous, count = _WRAPPED[name]
        _WRAPPED[name] = (previous, count + 1)
        _ROUTES[module] = route
        handles.append(RouteHandle(name, module))
    return handles


class RoutedLayer:
    """Mixin for a cache layer that attends over its compressed form itself while decoding: its
    `update` marks the step `pending` (and returns the new K/V, unused), `attend` computes softmax
    attention from the layer's `scores(query)` and `weighted_values(probs)`, then runs
    `after_attention` (e.g. KIVI's flush, which the reference does after the step's attention)."""

    attached = False  # set while the cache's attention route is installed
    pending = False  # this step's attention is the layer's own

    def require_attached(self, kind: str) -> None:
        if not self.attached:
            raise RuntimeError(
                f"{kind}: decode attends through the cache's own attention; "
                "run the model with the cache attached (cache.attach(model))"
            )

    def scores(self, query: torch.Tensor) -> torch.Tensor:  # [b, Hq, n, d] -> [b, Hq, n, T]
        raise NotImplementedError

    def weighted_values(self, probs: torch.Tensor) -> torch.Tensor:  # [b, Hq, n, T] -> [b, n, Hq, d]
        raise NotImplementedError

    def after_attention(self) -> None:
        pass

    def attend(
        self,
        original: Callable,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        *args: Any,
        scaling: float | None = None,
        **kwargs: Any,
    ):
        """The model's own attention function on the prompt; while decoding, softmax attention the
        layer computes over its stored form (no full-precision K or V is rebuilt for it)."""
        if not self.pending:
            return original(module, query, key, value, attention_mask, *args, scaling=scaling, **kwargs)
        self.pending = False
        n = query.shape[-2]
        scores = self.scores(query) * (scaling if scaling is not None else query.shape[-1] ** -0.5)
        if attention_mask is not None:
            mask = attention_mask[..., -scores.shape[-1] :]
            scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
        elif n > 1:  # several new tokens: each sees the cache up to itself
            t = scores.shape[-1]
            later = torch.arange(t, device=scores.device) > torch.arange(t - n, t, device=scores.device)[:, None]
            scores = scores.masked_fill(later, float("-inf"))
        out = self.weighted_values(scores.softmax(dim=-1)).to(query.dtype)
        self.after_attention()
        return out, None


class Detach:
    """Handle that marks routed layers detached again."""

    def __init__(self, layers: list) -> None:
        self.layers = layers

    def remove(self) -> None:
        for layer in self.layers:
            layer.attached = False


def attach_routed(model: torch.nn.Module, layers: list) -> list:
    """Install every routed layer's `attend` on `model`; returns the handles."""
    for layer in layers:
        layer.attached = True
    return [*route_attention(model, {i: layer.attend for i, layer in enumerate(layers)}), Detach(layers)]

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

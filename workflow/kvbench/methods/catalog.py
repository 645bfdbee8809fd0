"""Every method's implementation, and the factory that builds a cache from a config entry.

Above the method modules: each registers itself when imported (kvbench.methods.base.register),
this module imports them all, and base imports none of them.
"""

from __future__ import annotations

from typing import Any, Mapping

from kvbench.methods import cam, fp8, full, h2o, kivi, snapkv, streamingllm, turboquant  # noqa: F401
from kvbench.methods.base import METHODS, MethodCache, ModelShape
from kvbench.methods.kinds import settings_of


def build_cache(spec: Mapping[str, Any], shape: ModelShape, seed: int = 0) -> MethodCache:
    """A fresh cache for one prompt, from a config entry like {kind: kivi, bits: 2, ...}."""
    settings = settings_of(spec)  # checked first: an unknown kind is named, not a KeyError
    return METHODS[settings.kind](settings, shape, seed)

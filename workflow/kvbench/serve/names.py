"""Wire-format names, checked without torch (the workflow checks the config while it parses)."""

from __future__ import annotations

from typing import Any, Mapping

from kvbench.kv.codecs import codec_names

LOSSY_KINDS = ("kivi", "turboquant", "fp8")


def is_lossless(name: str) -> bool:
    return name in codec_names()


def check_codec(name: str, methods: Mapping[str, Mapping[str, Any]]) -> None:
    """A wire format is a kv-stage codec or a key of `methods` whose kind keeps every token."""
    if is_lossless(name):
        return
    kind = methods.get(name, {}).get("kind")
    if kind is None:
        raise ValueError(f"{name!r} is neither a codec ({', '.join(codec_names())}) nor a key of methods")
    if kind not in LOSSY_KINDS:
        raise ValueError(
            f"method {name!r} (kind {kind}) is not a wire format: only {', '.join(LOSSY_KINDS)} "
            "keep the token count (eviction and merging do not fit vLLM's paged cache)"
        )

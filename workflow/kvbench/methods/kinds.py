"""Method kinds and the settings a config entry of each kind may carry.

Torch-free on purpose: the workflow checks `methods:` while it parses, before any job starts.
Each kind's implementation registers itself under the same name (kvbench.methods.base.register).
"""

from __future__ import annotations

from typing import Any

KIND_SETTINGS: dict[str, tuple[str, ...]] = {
    "full": ("storage",),
    "fp8": (),
    "kivi": ("bits", "group_size", "residual", "storage"),
    "turboquant": ("bits", "variant"),
    "snapkv": ("window", "kernel", "pooling", "keep_ratio", "capacity", "storage"),
    "cam": ("window", "kernel", "pooling", "keep_ratio", "capacity", "interval", "target", "buffer",
            "merge_budget", "selection", "storage"),
    "streamingllm": ("sinks", "window", "storage"),
    "h2o": ("heavy", "recent", "keep_ratio", "storage"),
}


def check_spec(spec: dict[str, Any]) -> None:
    kind = spec.get("kind")
    if kind not in KIND_SETTINGS:
        raise ValueError(f"unknown method kind {kind!r}; known: {', '.join(sorted(KIND_SETTINGS))}")
    unknown = set(spec) - {"kind"} - set(KIND_SETTINGS[kind])
    if unknown:
        raise ValueError(f"unknown setting(s) {sorted(unknown)} for kind {kind!r} "
                         f"(allowed: {', '.join(sorted(KIND_SETTINGS[kind])) or 'none'})")

"""Method kinds and the settings each accepts: the one place that declares them (type, range,
supported values, required or not). A new setting is one line in its kind's entry.

Torch-free on purpose: the workflow checks `methods:` while it parses, before any job starts.
Each kind's implementation registers itself under the same name (kvbench.methods.base.register);
defaults live with the implementation, since a missing optional setting means "use the paper's".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping


@dataclass(frozen=True)
class Setting:
    type: type  # int, float or str; a float setting accepts integers, no setting accepts booleans
    minimum: float | None = None
    maximum: float | None = None
    above: float | None = None  # exclusive minimum
    choices: tuple[Any, ...] = ()
    required: bool = False
    odd: bool = False
    divides_head_dim: bool = False

    def problems(self, value: Any, head_dim: int | None = None) -> list[str]:
        allowed = (int, float) if self.type is float else (self.type,)
        if isinstance(value, bool) or not isinstance(value, allowed):
            return [f"{value!r} is not of type {self.type.__name__}"]
        if self.choices and value not in self.choices:
            return [f"{value!r} is not one of {list(self.choices)}"]
        found = []
        if self.minimum is not None and value < self.minimum:
            found.append(f"{value!r} is below the minimum {self.minimum}")
        if self.maximum is not None and value > self.maximum:
            found.append(f"{value!r} is above the maximum {self.maximum}")
        if self.above is not None and value <= self.above:
            found.append(f"{value!r} must be greater than {self.above}")
        if self.odd and value % 2 == 0:
            found.append(f"{value!r} must be odd (a centred pooling window)")
        if self.divides_head_dim and head_dim is not None and value > 0 and head_dim % value:
            found.append(f"{value!r} does not divide the model's head_dim {head_dim}")
        return found


def integer(minimum: int | None = None, **kw: Any) -> Setting:
    return Setting(int, minimum=minimum, **kw)


def ratio(**kw: Any) -> Setting:
    return Setting(float, above=0.0, maximum=1.0, **kw)


def choice(*values: Any, **kw: Any) -> Setting:
    return Setting(type(values[0]), choices=values, **kw)


@dataclass(frozen=True)
class Kind:
    settings: dict[str, Setting]
    exclusive: tuple[tuple[str, str], ...] = ()  # at most one of each pair
    together: tuple[tuple[str, ...], ...] = ()  # all or none of each group
    rules: tuple[Callable[[Mapping[str, Any]], list[str]], ...] = ()  # checks across settings


STORAGE = choice("fp16", "bf16", "fp32")  # the dtype the cache holds its kept values in
# 1/2/4/8-bit codes pack in byte planes (kvbench.methods.packing.PLANE_BITS).
KIVI_BITS = (1, 2, 4, 8)
KIVI_GROUP_SIZE, KIVI_RESIDUAL = 32, 128  # the paper's defaults (kivi.py uses them too)
# Variant prod: keys use b-1 Lloyd-Max bits + 1 QJL bit (so b >= 2), values b bits; variant mse: b
# bits for both. The packer takes 1-4 bit codes.
TURBOQUANT_BITS = (1, 2, 3, 4)
EVICTION = {
    "window": integer(1),  # observation window (last queries), kept as is
    "kernel": integer(1, odd=True),  # pooling kernel over scores
    "pooling": choice("avg", "max"),  # SnapKV's reference pools with avg (kvpress) or max (paper code)
    "keep_ratio": ratio(),  # fraction of the prompt kept ...
    "capacity": integer(1),  # ... or a fixed token count per head
    "storage": STORAGE,
}


def kivi_residual(spec: Mapping[str, Any]) -> list[str]:
    group, residual = spec.get("group_size", KIVI_GROUP_SIZE), spec.get("residual", KIVI_RESIDUAL)
    if isinstance(group, int) and isinstance(residual, int) and group > 0 < residual and (residual < group or residual % group):
        return [f"residual: {residual} must be a positive multiple of group_size {group} "
                "(keys are quantized R at a time in per-channel groups of G tokens)"]
    return []


def turboquant_prod_bits(spec: Mapping[str, Any]) -> list[str]:
    if spec.get("variant", "prod") == "prod" and spec.get("bits") == 1:
        return ["bits: 1 is too few for variant prod (b-1 MSE bits + 1 QJL bit for keys); use variant mse"]
    return []


def cam_compresses(spec: Mapping[str, Any]) -> list[str]:
    if not {"keep_ratio", "capacity", "target"} & set(spec):
        return ["keep_ratio: cam needs keep_ratio or capacity (compress at prefill) and/or target (while decoding)"]
    return []


KINDS: dict[str, Kind] = {
    "full": Kind({"storage": STORAGE}),
    "fp8": Kind({}),
    "kivi": Kind({
        "bits": choice(*KIVI_BITS, required=True),
        "group_size": integer(1, divides_head_dim=True),
        "residual": integer(1),  # recent tokens kept in full precision (the reference's R)
        "storage": STORAGE,
    }, rules=(kivi_residual,)),
    "turboquant": Kind({"bits": choice(*TURBOQUANT_BITS, required=True), "variant": choice("prod", "mse")},
                       rules=(turboquant_prod_bits,)),
    "snapkv": Kind(dict(EVICTION), exclusive=(("keep_ratio", "capacity"),)),
    "cam": Kind({**EVICTION, "merge_budget": integer(0),
                 "interval": integer(1),  # decoding: compress every `interval` new tokens ...
                 "target": integer(1),  # ... down to `target` tokens per head
                 "buffer": integer(1),  # decode queries kept for scoring
                 "selection": choice("shared", "per_head")},
                exclusive=(("keep_ratio", "capacity"),), rules=(cam_compresses,)),
    "streamingllm": Kind({"sinks": integer(0), "window": integer(1, required=True), "storage": STORAGE}),
    "h2o": Kind({"heavy": integer(0), "recent": integer(1), "keep_ratio": ratio(), "storage": STORAGE},
                exclusive=(("keep_ratio", "heavy"),), together=(("heavy", "recent"),)),
}
KIND_SETTINGS: dict[str, tuple[str, ...]] = {name: tuple(kind.settings) for name, kind in KINDS.items()}


def spec_problems(spec: Mapping[str, Any], head_dim: int | None = None) -> list[str]:
    """Every problem of one method entry, each starting with the setting it concerns (or `kind`).

    `head_dim` (from the model's config, when known) enables the checks that depend on the model.
    """
    kind_name = spec.get("kind")
    if kind_name not in KINDS:
        return [f"kind: unknown method kind {kind_name!r}; known: {', '.join(sorted(KINDS))}"]
    kind = KINDS[kind_name]
    found = [f"{name}: unknown setting for kind {kind_name!r} (allowed: {', '.join(kind.settings) or 'none'})"
             for name in spec if name != "kind" and name not in kind.settings]
    for name, setting in kind.settings.items():
        if name in spec:
            found += [f"{name}: {p}" for p in setting.problems(spec[name], head_dim)]
        elif setting.required:
            found.append(f"{name}: required for kind {kind_name!r}")
    for a, b in kind.exclusive:
        if a in spec and b in spec:
            found.append(f"{b}: cannot be combined with {a} (kind {kind_name!r} takes one of them)")
    for group in kind.together:
        given = [name for name in group if name in spec]
        if given and len(given) < len(group):
            missing = [name for name in group if name not in spec]
            found.append(f"{missing[0]}: required together with {', '.join(given)}")
    for rule in kind.rules:
        found += rule(spec)
    return found


def check_spec(spec: Mapping[str, Any], head_dim: int | None = None) -> None:
    problems = spec_problems(spec, head_dim)
    if problems:
        raise ValueError("; ".join(problems))

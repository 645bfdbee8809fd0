"""Method kinds, each declared once: a frozen dataclass per kind holds its settings (type from the
annotation; default, allowed values and a one-line doc from `setting`), the kind's one-line doc
(the class docstring) and its reference. From it come the config check (`spec_problems`), the
typed, defaults-filled settings each implementation receives (`settings_of`) and the methods table
of docs/methods.md (`methods_table`). A new setting is one field in its kind's class.

Torch-free on purpose: the workflow checks `methods:` while it parses, before any job starts.
Each kind's implementation registers itself under the same name (kvbench.methods.base.register).
"""

from __future__ import annotations

import dataclasses
import types
from dataclasses import MISSING, dataclass, field
from functools import cache
from typing import Any, Callable, ClassVar, Mapping, get_type_hints

# 1/2/4/8-bit codes pack in byte planes (kvbench.methods.packing.PLANE_BITS).
KIVI_BITS = (1, 2, 4, 8)
# Variant prod: keys use b-1 Lloyd-Max bits + 1 QJL bit (so b >= 2), values b bits; variant mse: b
# bits for both. The packer takes 1-4 bit codes.
TURBOQUANT_BITS = (1, 2, 3, 4)
STORAGES = ("fp16", "bf16", "fp32")


@dataclass(frozen=True)
class Allowed:
    """The values a setting accepts besides its type."""

    minimum: float | None = None
    maximum: float | None = None
    above: float | None = None  # exclusive minimum
    choices: tuple[Any, ...] = ()
    odd: bool = False
    divides_head_dim: bool = False

    def problems(self, value: Any, head_dim: int | None) -> list[str]:
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

    def describe(self) -> str:
        if self.choices:
            return "one of " + ", ".join(map(str, self.choices))
        parts = [
            f"> {self.above:g}" if self.above is not None else "",
            f"≥ {self.minimum:g}" if self.minimum is not None else "",
            f"≤ {self.maximum:g}" if self.maximum is not None else "",
            "odd" if self.odd else "",
            "divides head_dim" if self.divides_head_dim else "",
        ]
        return ", ".join(p for p in parts if p)


def setting(default: Any = MISSING, *, doc: str, **allowed: Any) -> Any:
    """A field of a kind's dataclass; no default: required. A default of None means "not used
    unless given" (the field's type then includes None)."""
    return field(default=default, metadata={"doc": doc, "allowed": Allowed(**allowed)})


@dataclass(frozen=True)
class Setting:
    """One setting as the check and the docs read it (built from a kind's field)."""

    name: str
    type: type  # int, float or str; a float setting accepts integers, no setting accepts booleans
    default: Any  # MISSING: required
    doc: str
    allowed: Allowed

    @property
    def required(self) -> bool:
        return self.default is MISSING

    def problems(self, value: Any, head_dim: int | None = None) -> list[str]:
        accepted = (int, float) if self.type is float else (self.type,)
        if isinstance(value, bool) or not isinstance(value, accepted):
            return [f"{value!r} is not of type {self.type.__name__}"]
        return self.allowed.problems(value, head_dim)


Rule = Callable[[Mapping[str, Any]], list[str]]


@dataclass(frozen=True, kw_only=True)
class MethodSettings:
    """The settings of one config entry of a kind, defaults filled in (see `settings_of`)."""

    kind: ClassVar[str]
    reference: ClassVar[str]
    exclusive: ClassVar[tuple[tuple[str, str], ...]] = ()  # at most one of each pair given
    together: ClassVar[tuple[tuple[str, ...], ...]] = ()  # all or none of each group given
    # Checks across settings; each reads the settings with defaults filled in (None if missing)
    # and its docstring's first line documents it.
    rules: ClassVar[tuple[Rule, ...]] = ()


def _storage(default: str | None = "fp16", doc: str = "dtype the cache holds its kept keys and values in") -> Any:
    return setting(default, choices=STORAGES, doc=doc)


def kivi_residual(values: Mapping[str, Any]) -> list[str]:
    """R is a multiple of G: `residual` of `group_size`."""
    group, residual = values["group_size"], values["residual"]
    if (
        isinstance(group, int)
        and isinstance(residual, int)
        and group > 0 < residual
        and (residual < group or residual % group)
    ):
        return [
            f"residual: {residual} must be a positive multiple of group_size {group} "
            "(keys are quantized R at a time in per-channel groups of G tokens)"
        ]
    return []


def turboquant_prod_bits(values: Mapping[str, Any]) -> list[str]:
    """Variant `prod` needs `bits` ≥ 2 (b-1 MSE bits + 1 QJL bit for keys)."""
    if values["variant"] == "prod" and values["bits"] == 1:
        return ["bits: 1 is too few for variant prod (b-1 MSE bits + 1 QJL bit for keys); use variant mse"]
    return []


def cam_compresses(values: Mapping[str, Any]) -> list[str]:
    """At least one schedule: `keep_ratio` or `capacity` (prefill) and/or `target` (decoding)."""
    if all(values[name] is None for name in ("keep_ratio", "capacity", "target")):
        return ["keep_ratio: cam needs keep_ratio or capacity (compress at prefill) and/or target (while decoding)"]
    return []


# Scoring and budget settings that SnapKV and CaM share (their defaults differ).
def _window(default: int) -> Any:
    return setting(
        default,
        minimum=1,
        doc="observation window: the last queries, whose attention scores the other tokens (it is kept)",
    )


def _kernel() -> Any:
    return setting(
        7, minimum=1, odd=True, doc="pooling kernel over the scores (keeps clusters of attended tokens whole)"
    )


def _pooling() -> Any:
    return setting("avg", choices=("avg", "max"), doc="`avg` as kvpress, `max` as the SnapKV paper's code")


def _capacity() -> Any:
    return setting(None, minimum=1, doc="a fixed count of tokens kept per KV head, instead of `keep_ratio`")


@dataclass(frozen=True, kw_only=True)
class FullSettings(MethodSettings):
    """The whole cache: the baseline."""

    kind = "full"
    reference = "plain `generate` (reproduced exactly when `storage` is not set)"
    storage: str | None = _storage(None, doc="dtype the cache is held in (not set: the dtype the model computes in)")


@dataclass(frozen=True, kw_only=True)
class Fp8Settings(MethodSettings):
    """Every key and value as float8 e4m3 (one byte, saturating at ±448), decoded by a 256-entry table."""

    kind = "fp8"
    reference = "the OCP FP8 e4m3 format, without scaling"


@dataclass(frozen=True, kw_only=True)
class KiviSettings(MethodSettings):
    """Asymmetric low-bit quantization: keys per channel, values per token; the newest tokens at full precision."""

    kind = "kivi"
    reference = "Liu et al. 2024, jy-yuan/KIVI (`models/llama_kivi.py`)"
    rules = (kivi_residual,)
    bits: int = setting(choices=KIVI_BITS, doc="bits per code (packed in byte planes)")
    group_size: int = setting(
        32,
        minimum=1,
        divides_head_dim=True,
        doc="G: tokens per key statistic, channels per value statistic (fp16 scale and zero point)",
    )
    residual: int = setting(128, minimum=1, doc="R: recent tokens kept at full precision (keys quantized R at a time)")
    storage: str = _storage(doc="dtype of the full-precision tokens (fp16: the reference's model dtype)")


@dataclass(frozen=True, kw_only=True)
class TurboQuantSettings(MethodSettings):
    """Random rotation + Lloyd-Max codes per coordinate and an fp16 norm per vector; keys optionally + 1-bit QJL."""

    kind = "turboquant"
    reference = "Zandieh et al. 2025, arXiv 2504.19874"
    rules = (turboquant_prod_bits,)
    bits: int = setting(choices=TURBOQUANT_BITS, doc="bits per coordinate (keys in variant `prod`: b-1 MSE + 1 QJL)")
    variant: str = setting(
        "prod",
        choices=("prod", "mse"),
        doc="`prod`: unbiased inner products (QJL on the keys' residual); `mse`: every bit to the codes",
    )


@dataclass(frozen=True, kw_only=True)
class SnapKVSettings(MethodSettings):
    """At prefill, keep per KV head the prompt positions the last `window` queries attend to most; decode appends."""

    kind = "snapkv"
    reference = "Li et al. 2024, FasterDecoding/SnapKV; scores as kvpress `SnapKVPress`"
    exclusive = (("keep_ratio", "capacity"),)
    window: int = _window(32)
    kernel: int = _kernel()
    pooling: str = _pooling()
    keep_ratio: float = setting(
        0.25, above=0.0, maximum=1.0, doc="fraction of the prompt kept per KV head (rounded down)"
    )
    capacity: int | None = _capacity()
    storage: str = _storage()


@dataclass(frozen=True, kw_only=True)
class CaMSettings(MethodSettings):
    """SnapKV-scored eviction that merges evicted values into the kept tokens after them, at prefill and/or decoding."""

    kind = "cam"
    reference = "Zhang et al., ICML 2024, zyxxmu/cam; as kvpress `CAMPress`"
    exclusive = (("keep_ratio", "capacity"),)
    rules = (cam_compresses,)
    window: int = _window(16)
    kernel: int = _kernel()
    pooling: str = _pooling()
    keep_ratio: float | None = setting(
        None,
        above=0.0,
        maximum=1.0,
        doc="fraction of the prompt kept per KV head at prefill (not set: no prefill compression)",
    )
    capacity: int | None = _capacity()
    storage: str = _storage()
    merge_budget: int = setting(32, minimum=0, doc="kept tokens after an evicted one that its value may merge into")
    interval: int = setting(32, minimum=1, doc="decoding: compress every `interval` new tokens ...")
    target: int | None = setting(
        None, minimum=1, doc="... down to `target` tokens per KV head (not set: no decode compression)"
    )
    buffer: int = setting(64, minimum=1, doc="decode queries kept for scoring")
    selection: str = setting(
        "shared",
        choices=("shared", "per_head"),
        doc="`shared`: one eviction set for every KV head (kvpress); `per_head`: as `snapkv`",
    )


@dataclass(frozen=True, kw_only=True)
class StreamingLLMSettings(MethodSettings):
    """The first `sinks` tokens (attention sinks) plus the last `window` tokens."""

    kind = "streamingllm"
    reference = "Xiao et al. 2024, mit-han-lab/streaming-llm"
    sinks: int = setting(4, minimum=0, doc="first tokens always kept")
    window: int = setting(minimum=1, doc="recent tokens kept")
    storage: str = _storage()


@dataclass(frozen=True, kw_only=True)
class H2OSettings(MethodSettings):
    """Heavy hitters by attention accumulated over every query so far, plus a window of recent tokens."""

    kind = "h2o"
    reference = "Zhang et al. 2023, FMInference/H2O"
    exclusive = (("keep_ratio", "heavy"),)
    together = (("heavy", "recent"),)
    heavy: int | None = setting(None, minimum=0, doc="heavy-hitter tokens kept per KV head (with `recent`)")
    recent: int | None = setting(None, minimum=1, doc="recent tokens kept per KV head (with `heavy`)")
    keep_ratio: float = setting(
        0.25,
        above=0.0,
        maximum=1.0,
        doc="fraction of the prompt kept (rounded up), half heavy hitters and half recent, "
        "unless `heavy` and `recent` are given",
    )
    storage: str = _storage()


KINDS: dict[str, type[MethodSettings]] = {
    cls.kind: cls
    for cls in (
        FullSettings,
        KiviSettings,
        TurboQuantSettings,
        SnapKVSettings,
        CaMSettings,
        StreamingLLMSettings,
        H2OSettings,
        Fp8Settings,
    )
}


@cache
def declared(cls: type[MethodSettings]) -> dict[str, Setting]:
    """The settings `cls` declares, in order: the type from each field's annotation (without None)."""
    hints = get_type_hints(cls)
    found = {}
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        kinds = [t for t in hint.__args__ if t is not type(None)] if isinstance(hint, types.UnionType) else [hint]
        found[f.name] = Setting(f.name, kinds[0], f.default, f.metadata["doc"], f.metadata["allowed"])
    return found


def spec_problems(spec: Mapping[str, Any], head_dim: int | None = None) -> list[str]:
    """Every problem of one method entry, each starting with the setting it concerns (or `kind`).

    `head_dim` (from the model's config, when known) enables the checks that depend on the model.
    """
    kind_name = spec.get("kind")
    if kind_name not in KINDS:
        return [f"kind: unknown method kind {kind_name!r}; known: {', '.join(sorted(KINDS))}"]
    kind = KINDS[kind_name]
    decls = declared(kind)
    found = [
        f"{name}: unknown setting for kind {kind_name!r} (allowed: {', '.join(decls) or 'none'})"
        for name in spec
        if name != "kind" and name not in decls
    ]
    for name, decl in decls.items():
        if name in spec:
            found += [f"{name}: {p}" for p in decl.problems(spec[name], head_dim)]
        elif decl.required:
            found.append(f"{name}: required for kind {kind_name!r}")
    for a, b in kind.exclusive:
        if a in spec and b in spec:
            found.append(f"{b}: cannot be combined with {a} (kind {kind_name!r} takes one of them)")
    for group in kind.together:
        given = [name for name in group if name in spec]
        if given and len(given) < len(group):
            missing = [name for name in group if name not in spec]
            found.append(f"{missing[0]}: required together with {', '.join(given)}")
    values = {name: spec.get(name, None if decl.required else decl.default) for name, decl in decls.items()}
    for rule in kind.rules:
        found += rule(values)
    return found


def check_spec(spec: Mapping[str, Any], head_dim: int | None = None) -> None:
    problems = spec_problems(spec, head_dim)
    if problems:
        raise ValueError("; ".join(problems))


def settings_of(spec: Mapping[str, Any]) -> MethodSettings:
    """The typed settings of a config entry like {kind: kivi, bits: 2}, defaults filled in (checked first)."""
    check_spec(spec)
    kind = KINDS[spec["kind"]]
    decls = declared(kind)
    return kind(
        **{name: float(value) if decls[name].type is float else value for name, value in spec.items() if name != "kind"}
    )


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def methods_table() -> str:
    """The method kinds as a Markdown table: each kind's doc and reference, its settings with their
    defaults and allowed values, and the constraints across settings."""
    rows = ["| kind | what it does | reference | settings: default (allowed values) — meaning |", "|---|---|---|---|"]
    for name, kind in KINDS.items():
        lines = []
        for decl in declared(kind).values():
            default = "required" if decl.required else "not set" if decl.default is None else f"`{decl.default}`"
            allowed = ", ".join(p for p in (decl.type.__name__, decl.allowed.describe()) if p)
            lines.append(f"`{decl.name}`: {default} ({allowed}) — {decl.doc}")
        lines += [f"At most one of `{a}`, `{b}`" for a, b in kind.exclusive]
        lines += ["All or none of " + ", ".join(f"`{n}`" for n in group) for group in kind.together]
        lines += [rule.__doc__.strip().splitlines()[0].rstrip(".") for rule in kind.rules]
        rows.append(
            f"| `{name}` | {_cell(kind.__doc__.strip())} | {_cell(kind.reference)} | "
            f"{_cell('<br>'.join(lines)) or '—'} |"
        )
    return "\n".join(rows)

"""Each method kind is declared once (kvbench.methods.kinds): its check, its implementation's
settings and the docs' table all come from that declaration, and the registry has no import cycle."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvbench.methods.base import ModelShape
from kvbench.methods.catalog import build_cache
from kvbench.methods.kinds import (
    KINDS,
    CaMSettings,
    H2OSettings,
    KiviSettings,
    SnapKVSettings,
    StreamingLLMSettings,
    declared,
    methods_table,
    settings_of,
)
from kvbench.tinyrun import REPO

METHODS_DIR = REPO / "workflow" / "kvbench" / "methods"
SHAPE = ModelShape(layers=2, kv_heads=3, q_heads=9, head_dim=64)


def test_docs_table_is_the_declarations_rendering():
    text = (REPO / "docs" / "methods.md").read_text()
    block = re.search(r"<!-- generated:method-kinds -->\n(.*)\n<!-- end generated:method-kinds -->", text, re.S)
    assert block and block.group(1).strip() == methods_table(), "docs/methods.md is stale: run `make readme`"


def test_the_table_shows_every_kind_setting_and_default():
    table = methods_table()
    rows = {line.split("|")[1].strip(): line for line in table.splitlines()[2:]}
    assert list(rows) == [f"`{kind}`" for kind in KINDS]
    assert "`window`: `32` (int, ≥ 1)" in rows["`snapkv`"] and "`window`: `16` (int, ≥ 1)" in rows["`cam`"]
    assert "`bits`: required (int, one of 1, 2, 4, 8)" in rows["`kivi`"]
    assert "`keep_ratio`: `0.25` (float, > 0, ≤ 1)" in rows["`snapkv`"]
    assert "At most one of `keep_ratio`, `capacity`" in rows["`snapkv`"]
    assert "R is a multiple of G: `residual` of `group_size`" in rows["`kivi`"]


def test_every_declared_default_passes_its_own_check_and_is_documented():
    for kind in KINDS.values():
        assert kind.__doc__ and kind.reference, kind.kind
        for decl in declared(kind).values():
            assert decl.doc, (kind.kind, decl.name)
            if not decl.required and decl.default is not None:
                assert decl.problems(decl.default, head_dim=64) == [], (kind.kind, decl.name)


def test_settings_are_typed_and_filled_from_the_declaration():
    kivi = settings_of({"kind": "kivi", "bits": 2})
    assert kivi == KiviSettings(bits=2, group_size=32, residual=128, storage="fp16")
    assert settings_of({"kind": "snapkv", "keep_ratio": 1}).keep_ratio == 1.0  # an integer ratio becomes a float
    assert isinstance(settings_of({"kind": "snapkv", "keep_ratio": 1}).keep_ratio, float)
    with pytest.raises(ValueError, match="bits: required for kind 'kivi'"):
        settings_of({"kind": "kivi"})


def test_the_implementations_use_the_declared_defaults():
    snap = build_cache({"kind": "snapkv"}, SHAPE).layers[0]
    assert (
        (snap.window, snap.kernel, snap.pooling)
        == (32, 7, "avg")
        == tuple(declared(SnapKVSettings)[n].default for n in ("window", "kernel", "pooling"))
    )
    cam = build_cache({"kind": "cam", "target": 100}, SHAPE).layers[0]
    defaults = CaMSettings(target=100)
    assert (
        (cam.window, cam.merge_budget, cam.interval, cam.buffer, cam.shared)
        == (defaults.window, defaults.merge_budget, defaults.interval, defaults.buffer, True)
        == (16, 32, 32, 64, True)
    )
    kivi = build_cache({"kind": "kivi", "bits": 2}, SHAPE).layers[0]
    assert (kivi.group, kivi.residual) == (KiviSettings(bits=2).group_size, KiviSettings(bits=2).residual) == (32, 128)
    sinks = build_cache({"kind": "streamingllm", "window": 8}, SHAPE).layers[0]
    assert sinks.sinks == StreamingLLMSettings(window=8).sinks == 4
    h2o = build_cache({"kind": "h2o"}, SHAPE).layers[0]
    assert h2o.settings == H2OSettings() and h2o._budget(100) == (12, 13)  # ceil(0.25 * 100) = 25: 12 heavy, 13 recent


def _imports(path: Path) -> set[str]:
    """kvbench.methods modules `path` imports anywhere (module level or inside functions)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "kvbench.methods":
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvbench.methods."):
            found.add(node.module.split(".")[2])
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[2] for a in node.names if a.name.startswith("kvbench.methods.")}
    return found


def test_the_method_modules_import_no_cycle():
    graph = {p.stem: _imports(p) for p in METHODS_DIR.glob("*.py")}
    assert graph["kinds"] == set() and "catalog" not in set().union(*(graph[m] for m in graph if m != "catalog"))

    def visit(module: str, path: tuple[str, ...]) -> None:
        assert module not in path, " -> ".join((*path, module))
        for imported in graph.get(module, ()):
            visit(imported, (*path, module))

    for module in graph:
        visit(module, ())


def _fresh(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


# In a fresh interpreter that has imported torch and transformers (what every method module needs,
# loaded once to keep the test short) and no kvbench module, one forked child per module imports
# that module first and alone, and checks what registered.
IMPORT_ALONE = """
import importlib, os, sys, traceback
import torch, transformers.cache_utils, transformers.models.llama.modeling_llama
assert not [m for m in sys.modules if m.startswith("kvbench")]
failed = []
for module, expected in {cases!r}.items():
    pid = os.fork()
    if pid == 0:
        try:
            importlib.import_module(module)
            registered = sorted(sys.modules["kvbench.methods.base"].METHODS)
            assert registered == expected, (module, registered)
            os._exit(0)
        except BaseException:
            traceback.print_exc()
            os._exit(1)
    if os.waitpid(pid, 0)[1]:
        failed.append(module)
assert not failed, failed
"""


def test_each_method_module_imported_first_and_alone_registers_its_kind():
    cases = {f"kvbench.methods.{kind}": [kind] for kind in KINDS} | {"kvbench.methods.catalog": sorted(KINDS)}
    result = _fresh(IMPORT_ALONE.format(cases=cases))
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_config_check_imports_neither_torch_nor_a_stage_from_config():
    code = (
        "import sys\nimport kvbench.config\n"
        "stages = [m for m in sys.modules if m.split('.')[:2] in (['kvbench', s] for s in "
        "('methods', 'serve', 'quality', 'corpus', 'kv', 'system', 'report'))]\n"
        "assert not stages, stages\n"
        "import kvbench.checks\nassert 'torch' not in sys.modules"
    )
    result = _fresh(code)
    assert result.returncode == 0, result.stdout + result.stderr

"""The code hash a rule carries as a param covers the library modules its script imports."""

from __future__ import annotations

import ast
import shutil

import pytest

from kvbench import codehash
from workflow_helpers import REPO

SCRIPTS = REPO / "workflow" / "scripts"


def names(script: str) -> set[str]:
    return {str(p.relative_to(codehash.LIBRARY)) for p in codehash.library_files(SCRIPTS / script)}


def test_each_script_depends_on_the_modules_it_imports_transitively():
    kv = names("kv_capture.py")
    assert {"kv/study.py", "kv/codecs.py", "kv/storage.py", "models.py", "jobs.py", "servers.py", "__init__.py"} <= kv
    assert not {p for p in kv if p.startswith(("methods/", "corpus/"))}
    system = names("system_method.py")
    assert {"harness.py", "methods/kivi.py", "methods/catalog.py", "prompts.py"} <= system  # catalog's imports too
    assert "data/medical.yaml" in names("corpus_realistic.py")  # fact-sheet vocabularies, read as data
    assert "data/medical.yaml" not in system


@pytest.fixture
def library_copy(tmp_path, monkeypatch):
    copy = tmp_path / "kvbench"
    shutil.copytree(codehash.LIBRARY, copy, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(codehash, "LIBRARY", copy)
    codehash._direct_imports.cache_clear()
    yield copy
    codehash._direct_imports.cache_clear()


def test_a_module_change_changes_the_hash_of_exactly_its_importers(library_copy):
    before = {s.name: codehash.code_hash(s) for s in SCRIPTS.glob("*.py")}
    codecs = library_copy / "kv" / "codecs.py"
    codecs.write_text(codecs.read_text() + "# changed\n")
    after = {s.name: codehash.code_hash(s) for s in SCRIPTS.glob("*.py")}
    changed = {name for name in before if before[name] != after[name]}
    # system imports kv.study; serve offloads through the same codecs
    assert changed == {"kv_capture.py", "kv_memory_probe.py", "system_method.py", "serve_server.py", "quality_method.py"}


def test_modules_loaded_by_name_count_for_the_script_that_names_them():
    # vLLM imports our connector from the module path in --kv-transfer-config, in its own process.
    serve = names("serve_server.py")
    assert {"serve/connector.py", "serve/wire.py", "serve/transfer.py", "serve/keys.py"} <= serve
    named = {node.value for path in codehash.library_files(SCRIPTS / "serve_server.py")
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("kvbench.")}
    assert "kvbench.serve.connector" in named
    for module in named:
        found = codehash._module_file(module)
        assert found is None or str(found.relative_to(codehash.LIBRARY)) in serve, module


def test_a_connector_change_reruns_the_serve_servers(library_copy):
    before = {s.name: codehash.code_hash(s) for s in SCRIPTS.glob("*.py")}
    connector = library_copy / "serve" / "connector.py"
    connector.write_text(connector.read_text() + "# changed\n")
    after = {s.name: codehash.code_hash(s) for s in SCRIPTS.glob("*.py")}
    assert {name for name in before if before[name] != after[name]} == {"serve_server.py"}

"""The code hash a rule carries as a param covers the library modules its script imports."""

from __future__ import annotations

import ast
import re
import shutil

import pytest

from kvbench import codehash
from kvbench.tinyrun import REPO

SCRIPTS = REPO / "workflow" / "scripts"


def names(script: str) -> set[str]:
    return {str(p.relative_to(codehash.LIBRARY)) for p in codehash.library_files(SCRIPTS / script)}


def test_each_script_depends_on_the_modules_it_imports_transitively():
    kv = names("kv_capture.py")
    assert {"kv/study.py", "kv/codecs.py", "kv/storage.py", "models.py", "jobs.py", "servers.py", "__init__.py"} <= kv
    assert not {p for p in kv if p.startswith(("methods/", "corpus/"))}
    system = names("system_job.py")
    assert {"harness.py", "methods/kivi.py", "methods/catalog.py", "prompts.py"} <= system  # catalog's imports too
    assert "methods/lut_kernels.c" in system  # the C source native.py builds
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
    # system imports kv.study; serve offloads through the same codecs; the quality job reaches them
    # no more (kvbench.config, which it imports, imports no stage package)
    assert changed == {"kv_capture.py", "kv_memory_probe.py", "system_job.py", "system_summary.py", "serve_server.py"}


def rule_extra(script: str) -> tuple[str, ...]:
    """The modules a rule adds by hand to its script's code hash (the `extra` of library_code)."""
    from kvbench.serve.backends import CONNECTOR_MODULE

    rules = "".join(p.read_text() for p in (REPO / "workflow" / "rules").glob("*.smk"))
    found = re.search(rf'library_code\("{script}", extra=\(([^)]*)\)\)', rules)
    return tuple(eval(found.group(1), {"CONNECTOR_MODULE": CONNECTOR_MODULE})) if found else ()


def test_modules_vllm_loads_by_name_count_for_serve_server():
    # vLLM imports our connector from the module path in --kv-transfer-config, in its own process.
    extra = rule_extra("serve_server.py")
    serve = {str(p.relative_to(codehash.LIBRARY)) for p in codehash.library_files(SCRIPTS / "serve_server.py", extra)}
    assert {"serve/connector.py", "serve/wire.py", "serve/transfer.py", "serve/keys.py"} <= serve
    paths = {
        node.values[node.keys.index(key)]
        for path in codehash.LIBRARY.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Dict)
        for key in node.keys
        if isinstance(key, ast.Constant) and key.value == "kv_connector_module_path"
    }
    assert paths and all(isinstance(v, ast.Name) and v.id == "CONNECTOR_MODULE" for v in paths)  # one constant
    assert extra == ("kvbench.serve.connector",)


def test_a_connector_change_reruns_the_serve_servers_alone(library_copy):
    def hashes():
        return {s.name: codehash.code_hash(s, rule_extra(s.name)) for s in SCRIPTS.glob("*.py")}

    before = hashes()
    connector = library_copy / "serve" / "connector.py"
    connector.write_text(connector.read_text() + "# changed\n")
    after = hashes()
    assert {name for name in before if before[name] != after[name]} == {"serve_server.py"}

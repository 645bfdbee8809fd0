"""Every method on the real model and a real ~1K-token prompt: `nbytes()` equals every storage the
cache object holds (walked independently, deduplicated) after prefill and after decode, and every
method's prefill attends to the same compute-precision K/V (identical prefill logits and first token)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvbench.harness import generate
from kvbench.methods.base import METHODS
from kvbench.methods.catalog import build_cache
from kvbench.tinyrun import default_config

FIXTURE = Path(__file__).parent / "data" / "legal-contract-00.txt"
# Every config entry, plus settings the default config does not exercise: the fp32 compute cache,
# CaM's decode schedule (compressing within the few steps run here) alone and after a prefill
# compression, TurboQuant's MSE variant.
EXTRA = {
    "full-fp32": {"kind": "full"},
    "cam-decode": {
        "kind": "cam",
        "window": 8,
        "kernel": 7,
        "interval": 3,
        "target": 600,
        "buffer": 16,
        "merge_budget": 32,
    },
    "cam-both": {"kind": "cam", "window": 16, "capacity": 700, "interval": 2, "target": 500, "selection": "per_head"},
    "turboquant3-mse": {"kind": "turboquant", "bits": 3, "variant": "mse"},
}
SPECS = default_config()["methods"] | EXTRA


def held_storages(obj: Any, seen: set[int] | None = None, found: dict[int, int] | None = None) -> dict[int, int]:
    """Bytes of every tensor storage reachable from `obj` through attributes, lists, tuples and
    dicts, keyed by storage address (so a storage shared by several tensors counts once)."""
    seen = set() if seen is None else seen
    found = {} if found is None else found
    if id(obj) in seen or isinstance(obj, (str, bytes, int, float, bool, type(None), torch.dtype, torch.device)):
        return found
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        storage = obj.untyped_storage()
        found[storage.data_ptr()] = storage.nbytes()
    elif isinstance(obj, dict):
        for item in obj.values():
            held_storages(item, seen, found)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for item in obj:
            held_storages(item, seen, found)
    elif hasattr(obj, "__dict__"):
        for item in vars(obj).values():
            held_storages(item, seen, found)
    return found


def test_every_registered_kind_is_exercised():
    from kvbench.methods import catalog  # noqa: F401

    assert {spec["kind"] for spec in SPECS.values()} == set(METHODS)


def test_the_walk_sees_views_and_shared_storages():
    base = torch.zeros(100, 10)
    held = held_storages({"view": base[:5], "again": [base[50:]], "other": torch.ones(3)})
    assert sorted(held.values()) == [12, 4000]


@pytest.fixture(scope="module")
def runs(model_dir, tokenizer):
    from kvbench.models import load_model

    model = load_model(model_dir)
    ids = tokenizer(FIXTURE.read_text()).input_ids
    assert 900 <= len(ids) <= 1200
    logits: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda module, args, out: logits.append(out[0, -1].clone()))
    results = {}
    try:
        for name, spec in SPECS.items():
            walks: list[tuple[int, int]] = []

            def make_cache(spec, shape, seed, walks=walks):
                cache = build_cache(spec, shape, seed)
                counted = cache.nbytes
                # generate() reads nbytes() after prefill and after decode: walk the storages then.
                cache.nbytes = lambda: walks.append((counted(), sum(held_storages(cache).values()))) or walks[-1][0]
                return cache

            logits.clear()
            result = generate(model, spec, ids, 7, seed=3, make_cache=make_cache)
            results[name] = {"walks": walks, "first_logits": logits[0], "result": result}
    finally:
        hook.remove()
    return results


@pytest.mark.parametrize("name", list(SPECS))
def test_nbytes_is_every_storage_the_cache_holds(runs, name):
    run = runs[name]
    assert run["result"]["new_tokens"] == 7  # decode really ran (no early end of sequence)
    (prefill, prefill_walk), (end, end_walk) = run["walks"]
    assert prefill == prefill_walk, f"{name}: nbytes() {prefill} but the cache holds {prefill_walk} after prefill"
    assert end == end_walk, f"{name}: nbytes() {end} but the cache holds {end_walk} after decode"


@pytest.mark.parametrize("name", list(SPECS))
def test_prefill_attends_to_the_same_kv_for_every_method(runs, name):
    reference = runs["full-fp32"]
    assert torch.equal(runs[name]["first_logits"], reference["first_logits"])
    assert runs[name]["result"]["tokens"][0] == reference["result"]["tokens"][0]

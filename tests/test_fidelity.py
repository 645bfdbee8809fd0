"""Closeness to `full` on the real model and a real ~1K-token prompt: teacher-forced on full's
greedy answer, the mean next-token KL(full || method).

Bounds. fp8 e4m3 (3 mantissa bits, served as near-lossless) measures 0.007 nats here; KIVI-4
(4-bit codes, fp16 statistics per 32 values, the newest 128 values at fp16) must stay in that
regime: below 0.02, while KIVI-2 measures 0.14, so the bound fails a cache that lost about a bit.
TurboQuant-4 (prod: 3-bit MSE stage + 1-bit QJL on keys) measures 0.39 on this prompt (16 tokens:
see the figure asserted below), as bench/turboquant_scores.py explains: the QJL estimate is unbiased
but its score noise at head_dim 64 is 2.3x the MSE-only variant's at equal bits; the bound 0.8 is
twice that and below TurboQuant-3's 1.9, so a bug that costs about a bit (or doubles the noise)
fails. Orderings the method's structure implies are asserted too: KIVI-2 farther than KIVI-4, the
MSE-only variant closer than the product variant at equal bits.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvbench.harness import generate, teacher_forced

FIXTURE = Path(__file__).parent / "data" / "legal-contract-00.txt"
TOKENS = 16
SPECS = {
    "kivi2": {"kind": "kivi", "bits": 2, "group_size": 32, "residual": 128},
    "kivi4": {"kind": "kivi", "bits": 4, "group_size": 32, "residual": 128},
    "turboquant4": {"kind": "turboquant", "bits": 4},
    "turboquant4-mse": {"kind": "turboquant", "bits": 4, "variant": "mse"},
}


@pytest.fixture(scope="module")
def kl(model_dir, tokenizer):
    from kvbench.models import load_model

    model = load_model(model_dir)
    ids = tokenizer(FIXTURE.read_text()).input_ids
    full = {"kind": "full", "storage": "fp16"}
    answer = generate(model, full, ids, TOKENS)["tokens"]
    assert len(answer) == TOKENS
    reference = teacher_forced(model, full, ids, answer)
    assert [int(row.argmax()) for row in reference] == answer  # teacher forcing reproduces full's decode
    out = {}
    for name, spec in SPECS.items():
        logp = teacher_forced(model, spec, ids, answer)
        out[name] = float((reference.exp() * (reference - logp)).sum(-1).mean())
    print(out)
    return out


def test_kivi4_is_close_to_full(kl):
    assert 0 < kl["kivi4"] < 0.02


def test_kivi2_is_farther_from_full_than_kivi4(kl):
    assert kl["kivi2"] > 5 * kl["kivi4"]


def test_turboquant4_within_its_bound_and_mse_closer_than_prod(kl):
    assert 0 < kl["turboquant4"] < 0.8
    assert kl["turboquant4-mse"] < kl["turboquant4"]

"""KL(full || method) and top-1 agreement on known distributions; exact and top-k references."""

import math

import pytest
import torch

from kvbench.quality.fidelity import compare, load_references, reference_from_logits, save_references


def test_kl_and_agreement_on_known_distributions():
    full = torch.tensor([[0.5, 0.5, 0.0], [0.7, 0.2, 0.1]]).clamp_min(1e-12).log()
    method = torch.tensor([[0.9, 0.1, 0.0], [0.7, 0.2, 0.1]]).clamp_min(1e-12).log()
    ref = reference_from_logits([0, 0], full, [1, 2, 3], top_k=None)
    scores = compare(ref, method)
    first = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    assert scores["kl_mean"] == pytest.approx(first / 2, abs=1e-5) and scores["kl_max"] == pytest.approx(first, abs=1e-5)
    assert scores["top1_agreement"] == 1.0 and scores["fidelity_positions"] == 2
    assert compare(ref, full)["kl_mean"] == pytest.approx(0.0, abs=1e-6)


def test_top_k_reference_bounds_the_exact_kl_from_below():
    gen = torch.Generator().manual_seed(0)
    full, method = torch.randn(6, 500, generator=gen) * 3, torch.randn(6, 500, generator=gen) * 3
    tokens = full.argmax(-1).tolist()
    exact = compare(reference_from_logits(tokens, full, [], None), method)
    whole = compare(reference_from_logits(tokens, full, [], 500), method)
    top = compare(reference_from_logits(tokens, full, [], 50), method)
    assert whole["kl_mean"] == pytest.approx(exact["kl_mean"], rel=1e-5)
    assert top["kl_mean"] <= exact["kl_mean"] + 1e-6 and top["kl_mean"] > 0.5 * exact["kl_mean"]
    assert top["top1_agreement"] == exact["top1_agreement"]


@pytest.mark.parametrize("top_k", [None, 4])
def test_references_round_trip(tmp_path, top_k):
    logits = torch.randn(3, 10)
    refs = {"kvbench_qa/0": reference_from_logits([1, 2, 3], logits, [5, 6], top_k)}
    save_references(refs, tmp_path / "ref.safetensors")
    back = load_references(tmp_path / "ref.safetensors")["kvbench_qa/0"]
    assert back.tokens == [1, 2, 3] and back.prompt_hash == refs["kvbench_qa/0"].prompt_hash
    torch.testing.assert_close(back.logprobs, refs["kvbench_qa/0"].logprobs)
    assert (back.indices is None) == (top_k is None)

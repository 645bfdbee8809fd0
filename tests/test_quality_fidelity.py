"""KL(full || method) and top-1 agreement on known distributions; exact and top-k references."""

import math

import pytest
import torch

from kvbench.fidelity import compare, kl_top_lists, load_references, reference_from_logits, save_references


def test_kl_and_agreement_on_known_distributions():
    # position 0 (after the uncompressed prefill) differs here only to show it is kept apart
    full = torch.tensor([[0.6, 0.4, 0.0], [0.5, 0.5, 0.0], [0.7, 0.2, 0.1], [0.1, 0.8, 0.1]]).clamp_min(1e-12).log()
    method = torch.tensor([[0.4, 0.6, 0.0], [0.9, 0.1, 0.0], [0.7, 0.2, 0.1], [0.6, 0.3, 0.1]]).clamp_min(1e-12).log()
    ref = reference_from_logits([0, 0, 0, 1], full, [1, 2, 3], top_k=None)
    scores = compare(ref, method)
    first = 0.6 * math.log(0.6 / 0.4) + 0.4 * math.log(0.4 / 0.6)
    second = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    fourth = 0.1 * math.log(0.1 / 0.6) + 0.8 * math.log(0.8 / 0.3)
    assert scores["kl_first"] == pytest.approx(first, abs=1e-5)
    assert scores["kl_mean"] == pytest.approx((second + fourth) / 3, abs=1e-5)
    assert scores["kl_max"] == pytest.approx(max(second, fourth), abs=1e-5)
    # decode positions 1-3 only: the method's argmax is 0, 0, 0 against the reference's 0, 0, 1
    assert scores["top1_agreement"] == pytest.approx(2 / 3) and scores["fidelity_positions"] == 3
    assert compare(ref, full)["kl_mean"] == pytest.approx(0.0, abs=1e-6)


def test_a_one_token_reference_has_no_decode_position():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    scores = compare(reference_from_logits([0], logits, [1], top_k=None), logits.flip(-1))
    assert scores["fidelity_positions"] == 0 and scores["kl_mean"] is None and scores["top1_agreement"] is None
    assert scores["kl_first"] > 0


def test_top_k_reference_against_a_hand_computed_kl():
    # vocabulary 4, k = 3 (one less than the vocabulary): the last token is the rest, as one outcome
    full_p = torch.tensor([[0.25, 0.25, 0.25, 0.25], [0.5, 0.3, 0.15, 0.05]])
    method_p = torch.tensor([[0.25, 0.25, 0.25, 0.25], [0.2, 0.2, 0.2, 0.4]])
    ref = reference_from_logits([0, 0], full_p.log(), [], top_k=3)
    assert ref.indices is not None and ref.indices[1].tolist() == [0, 1, 2]
    scores = compare(ref, method_p.log())
    kl = (
        0.5 * math.log(0.5 / 0.2)
        + 0.3 * math.log(0.3 / 0.2)
        + 0.15 * math.log(0.15 / 0.2)
        + 0.05 * math.log(0.05 / 0.4)
    )
    assert scores["kl_mean"] == pytest.approx(kl, abs=1e-5)
    # with two tokens in the rest, the bound is strictly below the exact KL
    exact = compare(reference_from_logits([0, 0], full_p.log(), [], None), method_p.log())["kl_mean"]
    bound = compare(reference_from_logits([0, 0], full_p.log(), [], 2), method_p.log())["kl_mean"]
    assert bound < exact - 1e-3 and exact == pytest.approx(kl, abs=1e-5)


def test_top_k_reference_bounds_the_exact_kl_from_below():
    gen = torch.Generator().manual_seed(0)
    full, method = torch.randn(6, 500, generator=gen) * 3, torch.randn(6, 500, generator=gen) * 3
    tokens = full.argmax(-1).tolist()
    exact = compare(reference_from_logits(tokens, full, [], None), method)
    top = compare(reference_from_logits(tokens, full, [], 50), method)
    assert top["kl_mean"] <= exact["kl_mean"] + 1e-6 and top["kl_mean"] > 0.5 * exact["kl_mean"]


@pytest.mark.parametrize("top_k", [None, 4])
def test_references_round_trip(tmp_path, top_k):
    logits = torch.randn(3, 10)
    refs = {"kvbench_qa/0": reference_from_logits([1, 2, 3], logits, [5, 6], top_k)}
    save_references(refs, tmp_path / "ref.safetensors")
    back = load_references(tmp_path / "ref.safetensors")["kvbench_qa/0"]
    assert back.tokens == [1, 2, 3] and back.prompt_hash == refs["kvbench_qa/0"].prompt_hash
    torch.testing.assert_close(back.logprobs, refs["kvbench_qa/0"].logprobs)
    assert (back.indices is None) == (top_k is None)


def _lists(probs: dict[int, float]) -> dict[int, float]:
    return {t: math.log(p) for t, p in probs.items()}


def test_kl_from_two_servers_top_lists_is_exact_when_they_hold_every_token():
    p, q = {0: 0.5, 1: 0.3, 2: 0.2}, {0: 0.2, 1: 0.3, 2: 0.5}
    exact = sum(p[t] * math.log(p[t] / q[t]) for t in p)
    assert kl_top_lists(_lists(p), _lists(q)) == pytest.approx(exact, rel=1e-12)
    assert kl_top_lists(_lists(p), _lists(p)) == 0.0


def test_kl_from_top_lists_bounds_the_exact_kl_from_below_when_lists_differ():
    vocab_p = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    vocab_q = torch.tensor([0.1, 0.3, 0.2, 0.05, 0.3, 0.05])
    exact = float((vocab_p * (vocab_p / vocab_q).log()).sum())
    ref = _lists({0: 0.4, 1: 0.25, 2: 0.15})  # top 3 of each: they share tokens 1 and 2 only
    method = _lists({4: 0.3, 1: 0.3, 2: 0.2})
    # the shared tokens and the rest as one outcome, by hand
    by_hand = 0.25 * math.log(0.25 / 0.3) + 0.15 * math.log(0.15 / 0.2) + 0.6 * math.log(0.6 / 0.5)
    assert kl_top_lists(ref, method) == pytest.approx(by_hand, rel=1e-12)
    assert 0 < kl_top_lists(ref, method) < exact

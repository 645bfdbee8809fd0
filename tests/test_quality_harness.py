"""`generate_scored` on the real model: one prefill serves the free generation and the
teacher-forced pass, and both equal what separate runs give; fidelity orders the methods."""

import pytest
import torch

from kvbench.harness import generate, generate_scored
from kvbench.methods.base import ModelShape
from kvbench.methods.catalog import build_cache
from kvbench.models import load_model, load_tokenizer
from kvbench.prompts import chat_ids
from kvbench.quality.fidelity import Reference, compare

TEXT = (
    "Discharge summary. Maria Lopez, a 67-year-old woman, was admitted to Riverside General Hospital on March 12, "
    "2024 with community-acquired pneumonia. A chest X-ray showed right lower lobe consolidation. She was treated "
    "with ceftriaxone 1 g IV daily and improved over four days. Her history includes hypertension and obstructive "
    "sleep apnea. The attending physician, Dr. Omar Haddad, reviewed her oxygen needs each morning. On day three "
    "the fever resolved, cultures stayed negative, and she walked the hallway without help. She was discharged "
    "home on March 16, 2024 with oral cefpodoxime for three more days and a follow-up visit in one week. "
    "Contract. This Software License Agreement between Cooper-Williamson and Carter Group runs for 24 months "
    "from December 8, 2020, for a fee of $412,750, governed by the law of Texas. The confidentiality clause "
    "survives termination. "
)
QUESTION = "\n\nDescribe the patient's hospital stay and the contract in detail."
KIVI2 = {"kind": "kivi", "bits": 2, "group_size": 32, "residual": 32}
H2O = {"kind": "h2o", "keep_ratio": 0.1}  # keeps scoring at every decode step: its hooks must follow the copy


@pytest.fixture(scope="module")
def model(model_dir):
    return load_model(model_dir)


@pytest.fixture(scope="module")
def ids(model_dir):
    return chat_ids(load_tokenizer(model_dir), TEXT + QUESTION)


@pytest.fixture(scope="module")
def reference(model, ids):
    return generate_scored(model, {"kind": "full"}, ids, 16)


def teacher_forced_logits(model, spec, ids, tokens):
    """Independent recomputation: a fresh cache, the prompt, then each reference token in turn."""
    from kvbench.harness import decode_step

    cache = build_cache(spec, ModelShape.of(model.config))
    handles = cache.attach(model)
    try:
        with torch.inference_mode():
            out = [model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True).logits[0, -1]]
            for i, token in enumerate(tokens[:-1]):
                out.append(decode_step(model, cache, token, len(ids) + i))
    finally:
        for handle in handles:
            handle.remove()
    return torch.stack(out)


def test_free_run_equals_generate_and_stores_its_distributions(model, ids, reference):
    assert len(reference["tokens"]) == 16
    assert reference["tokens"] == generate(model, {"kind": "full"}, ids, 16)["tokens"]
    assert reference["first_divergence"] is None
    assert reference["logits"].shape == (len(reference["tokens"]), model.config.vocab_size)
    assert reference["logits"].argmax(-1).tolist() == reference["tokens"]


def test_a_diverging_method_gets_its_own_output_and_teacher_forced_logits(model, ids, reference):
    ref = reference["tokens"]
    result = generate_scored(model, H2O, ids, 16, reference=ref)
    # The free branch (a copy of the cache at the divergence) is exactly the method's own greedy run ...
    assert result["tokens"] == generate(model, H2O, ids, 16)["tokens"]
    # ... and the teacher-forced logits are what a separate teacher-forced run computes.
    torch.testing.assert_close(result["logits"], teacher_forced_logits(model, H2O, ids, ref), rtol=1e-4, atol=1e-4)
    d = result["first_divergence"]
    assert d is not None and result["tokens"][:d] == ref[:d] and result["tokens"][d] != ref[d]
    assert result["logits"][d].argmax() != ref[d] and (result["logits"][:d].argmax(-1) == torch.tensor(ref[:d])).all()


def test_the_reference_against_itself_has_zero_kl(model, ids, reference):
    tokens = reference["tokens"]
    again = generate_scored(model, {"kind": "full"}, ids, 16, reference=tokens)
    stored = Reference(tokens, torch.log_softmax(reference["logits"], -1), "")
    scores = compare(stored, again["logits"])
    assert again["first_divergence"] is None and again["tokens"] == tokens
    assert scores["kl_mean"] < 1e-6 and scores["top1_agreement"] == 1.0


def test_a_stop_rule_ends_generation(model, ids):
    result = generate_scored(model, {"kind": "full"}, ids, 16, stop=lambda tokens: len(tokens) >= 3)
    assert len(result["tokens"]) == 3 and result["logits"].shape[0] == 3


def test_fidelity_orders_methods_by_how_much_they_keep(model, ids, reference):
    # Teacher-forced KL to the full cache on a real prompt: fewer bits or fewer kept tokens, farther.
    stored = Reference(reference["tokens"], torch.log_softmax(reference["logits"], -1), "")

    def kl(spec):
        return compare(stored, generate_scored(model, spec, ids, 16, reference=stored.tokens)["logits"])["kl_mean"]

    assert kl(KIVI2) > kl({**KIVI2, "bits": 4})
    assert kl({"kind": "snapkv", "keep_ratio": 0.25}) > kl({"kind": "snapkv", "keep_ratio": 0.5})
    assert kl({"kind": "turboquant", "bits": 3}) > kl({"kind": "turboquant", "bits": 4})

"""The quality engine on the real model: one shared prefill per prompt, every method forked from it
under both protocols, decoded together (kvbench.decode); each piece equals what separate runs give."""

import pytest
import torch

from kvbench.decode import Row, eos_ids, extend_rows, forward_rows, run_rows
from kvbench.fidelity import Reference, compare
from kvbench.harness import generate, prefill, teacher_forced
from kvbench.methods.base import MethodCache, ModelShape
from kvbench.methods.catalog import build_cache
from kvbench.models import load_model, load_tokenizer
from kvbench.prefill import fork, shared_prefill
from kvbench.prompts import chat_ids
from kvbench.quality import engine
from kvbench.quality.engine import CONTEXT_ONLY, QUERY_AWARE, Prompt

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


SPECS = {
    "full": {"kind": "full", "storage": "fp16"},
    "kivi2": KIVI2,
    "kivi4": {**KIVI2, "bits": 4},
    "turboquant4": {"kind": "turboquant", "bits": 4},
    "snapkv": {"kind": "snapkv", "keep_ratio": 0.25, "window": 8},
    "cam": {"kind": "cam", "keep_ratio": 0.25, "window": 8, "merge_budget": 8, "selection": "per_head"},
    "cam-decoding": {"kind": "cam", "window": 8, "interval": 4, "target": 64, "merge_budget": 8},
    "streamingllm": {"kind": "streamingllm", "sinks": 4, "window": 60},
    "h2o": H2O,
    "fp8": {"kind": "fp8"},
}


@pytest.fixture(scope="module")
def model(model_dir):
    return load_model(model_dir)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return load_tokenizer(model_dir)


@pytest.fixture(scope="module")
def ids(tokenizer):
    return chat_ids(tokenizer, TEXT + QUESTION)


@pytest.fixture(scope="module")
def split(tokenizer, ids):
    from kvbench.quality.adapter import split_point

    point, note = split_point(tokenizer, TEXT + QUESTION, ids, True, TEXT)
    assert note is None
    return point


@pytest.fixture(scope="module")
def shared(model, ids):
    return shared_prefill(model, ids)


@pytest.mark.parametrize("name", list(SPECS))
def test_a_forked_cache_is_the_cache_its_own_prefill_builds(model, ids, shared, name):
    # Same bytes after the prompt, same first distribution, and every decode step bitwise the same
    # (one row: the same arithmetic as a separate run).
    spec = SPECS[name]
    own = build_cache(spec, ModelShape.of(model.config), 5)
    logits, _ = prefill(model, own, ids)
    forked, _ = fork(model, shared, spec, len(ids), 5)
    assert forked.nbytes() == own.nbytes()
    assert torch.equal(shared.logits, logits)
    rows = [Row(c, logits, len(ids), 12, eos_ids(model), keep_logprobs=True) for c in (own, forked)]
    for row in rows:
        run_rows(model, [row])
    assert rows[0].tokens == rows[1].tokens and rows[0].bytes_end == rows[1].bytes_end
    assert all(torch.equal(a, b) for a, b in zip(rows[0].logprobs, rows[1].logprobs))


def test_rows_in_one_batch_do_not_read_each_others_caches(model, ids, shared):
    # Every method decodes next to the others; each row equals, bit for bit, the same row decoded at
    # the same place in a batch of as many full caches (a batch's shared projections round by batch
    # size and row, so only the neighbours change; any difference is one row reading another's state).
    answer = generate(model, {"kind": "full"}, ids, 10)["tokens"]
    forced = Reference(answer, None, "")

    def rows(names):
        out = [
            Row(
                fork(model, shared, SPECS[n], len(ids), 5)[0],
                shared.logits,
                len(ids),
                len(answer),
                reference=forced,
                branch_free=False,
                keep_logprobs=True,
            )
            for n in names
        ]
        run_rows(model, out)
        return out

    names = list(SPECS)
    together = rows(names)
    for i, name in enumerate(names[1:], start=1):
        alone = rows(["full"] * i + [name] + ["full"] * (len(names) - i - 1))[i]
        assert all(torch.equal(a, b) for a, b in zip(together[i].logprobs, alone.logprobs)), name
    assert not torch.equal(together[1].logprobs[-1], together[0].logprobs[-1])  # the rows do differ


def test_context_only_is_the_context_compressed_alone_then_the_question_through_it(model, ids, split, shared):
    # 1. A fork of the context alone, then the question through it in one pass, is bit for bit a cache
    #    prefilled on the context alone and then fed the question.
    names = ["full", "kivi2", "snapkv", "h2o", "turboquant4", "cam-decoding", "fp8"]
    context = shared_prefill(model, ids[:split])
    question, positions = torch.tensor([ids[split:]]), torch.arange(split, len(ids))[None]
    for name in names:
        forked = fork(model, context, SPECS[name], split, 5)[0]
        own = build_cache(SPECS[name], ModelShape.of(model.config), 5)
        prefill(model, own, ids[:split])
        assert forked.nbytes() == own.nbytes(), name
        ours, theirs = (forward_rows(model, [c], question, positions)[0][0] for c in (forked, own))
        assert torch.equal(ours, theirs), name
    # 2. The whole prompt's prefill holds the context's K/V as a prefill of the context alone computes
    #    them, up to summation order: the engine forks both protocols from that one pass.
    for layer in (0, 15, 29):
        for whole, alone in ((shared.keys, context.keys), (shared.values, context.values)):
            torch.testing.assert_close(whole[layer][..., :split, :], alone[layer], rtol=1e-4, atol=1e-4)
    # 3. One batched pass for every method's question, as the engine runs it.
    caches = [fork(model, shared, SPECS[n], split, 5)[0] for n in names]
    assert caches[2].layers[0].keys.shape[-2] < split  # SnapKV compressed the context alone
    batch, errors, _ = extend_rows(model, caches, ids[split:], split)
    assert not errors

    def kl(logits):
        return float(
            torch.nn.functional.kl_div(
                logits.log_softmax(-1), shared.logits.log_softmax(-1), log_target=True, reduction="sum"
            )
        )

    assert kl(batch[0]) < 1e-4  # the full cache (16-bit): the whole prompt's answer, up to its storage rounding
    assert kl(batch[2]) > 1e-2  # SnapKV's first answer token now depends on what it kept


@pytest.fixture(scope="module")
def outcomes(model, ids, split):
    prompt = Prompt("t/0", ids, split, 16)
    return engine.run(
        model,
        [prompt],
        {n: SPECS[n] for n in ("full", "h2o", "kivi2", "kivi4", "snapkv")},
        protocols=(QUERY_AWARE, CONTEXT_ONLY),
        seed=5,
        reference="full",
        log=lambda _: None,
    )


def test_the_reference_runs_first_and_against_itself_has_zero_kl(model, ids, outcomes):
    results, references = outcomes
    full = results[("full", QUERY_AWARE, "t/0")]
    assert full.error is None and full.tokens == generate(model, {"kind": "full", "storage": "fp16"}, ids, 16)["tokens"]
    ref = references[f"{QUERY_AWARE}/t/0"]
    assert ref.tokens == full.tokens and ref.logprobs.shape == (len(full.tokens), model.config.vocab_size)
    assert ref.logprobs.argmax(-1).tolist() == full.tokens
    again = engine.run(
        model,
        [Prompt("t/0", ids, None, 16)],
        {"full": SPECS["full"]},
        protocols=(QUERY_AWARE,),
        seed=5,
        references=references,
        log=lambda _: None,
    )[0][("full", QUERY_AWARE, "t/0")]
    assert again.tokens == full.tokens and again.record["first_divergence"] is None
    assert again.record["kl_mean"] < 1e-6 and again.record["top1_agreement"] == 1.0


def test_a_diverging_method_gets_its_own_output_and_teacher_forced_fidelity(model, ids, outcomes):
    # Alone in its decode loop (one row, so the same arithmetic as separate runs): the branch at the
    # divergence is the method's own greedy run, the forced row a separate teacher-forced run.
    results, references = outcomes
    ref = references[f"{QUERY_AWARE}/t/0"]
    alone = engine.run(
        model,
        [Prompt("t/0", ids, None, 16)],
        {"h2o": H2O},
        protocols=(QUERY_AWARE,),
        seed=5,
        references=references,
        log=lambda _: None,
    )[0][("h2o", QUERY_AWARE, "t/0")]
    assert alone.tokens == generate(model, H2O, ids, 16, seed=5)["tokens"]
    expected = compare(ref, teacher_forced(model, H2O, ids, ref.tokens, seed=5))
    for key in ("kl_first", "kl_mean", "kl_max", "top1_agreement", "fidelity_positions"):
        assert alone.record[key] == pytest.approx(expected[key], rel=1e-4, abs=1e-6), key
    d = alone.record["first_divergence"]
    assert d is not None and alone.tokens[:d] == ref.tokens[:d] and alone.tokens[d] != ref.tokens[d]
    assert results[("h2o", QUERY_AWARE, "t/0")].record["first_divergence"] == d  # in the batch too


def test_context_only_fidelity_includes_the_first_answer_token(outcomes):
    results, references = outcomes
    for method in ("kivi2", "snapkv", "h2o"):
        query_aware = results[(method, QUERY_AWARE, "t/0")].record
        context_only = results[(method, CONTEXT_ONLY, "t/0")].record
        assert query_aware["kl_first"] < 1e-6 < context_only["kl_first"], method
    assert set(references) == {f"{QUERY_AWARE}/t/0", f"{CONTEXT_ONLY}/t/0"}


def test_fidelity_orders_methods_by_how_much_they_keep(model, ids, outcomes):
    results, references = outcomes

    def kl(name, spec=None):
        if spec is None:
            return results[(name, QUERY_AWARE, "t/0")].record["kl_mean"]
        return engine.run(
            model,
            [Prompt("t/0", ids, None, 16)],
            {name: spec},
            protocols=(QUERY_AWARE,),
            seed=5,
            references=references,
            log=lambda _: None,
        )[0][(name, QUERY_AWARE, "t/0")].record["kl_mean"]

    assert kl("kivi2") > kl("kivi4")
    assert kl("snapkv") > kl("snapkv50", {**SPECS["snapkv"], "keep_ratio": 0.5})
    assert kl("tq3", {"kind": "turboquant", "bits": 3}) > kl("tq4", {"kind": "turboquant", "bits": 4})


@pytest.mark.parametrize("name", ["full", "kivi2"])
def test_fidelity_positions_cap_the_forced_part_but_never_the_answer(model, ids, outcomes, name):
    # Teacher-forced on the first 4 positions only; the answer is whole either way: a row that agreed
    # on all 4 goes on by itself, one that diverged branched off.
    results, references = outcomes
    capped = engine.run(
        model,
        [Prompt("t/0", ids, None, 16)],
        {name: SPECS[name]},
        protocols=(QUERY_AWARE,),
        seed=5,
        references=references,
        fidelity_positions=4,
        log=lambda _: None,
    )[0][(name, QUERY_AWARE, "t/0")]
    assert capped.tokens == generate(model, SPECS[name], ids, 16, seed=5)["tokens"]
    assert capped.record["fidelity_positions"] == 3  # positions 1-3: decode positions of the forced 4
    if name != "full":  # (full is the reference there: no fidelity of its own)
        whole = results[(name, QUERY_AWARE, "t/0")].record
        assert capped.record["kl_first"] == pytest.approx(whole["kl_first"], abs=1e-6)
        assert whole["fidelity_positions"] > 3
    assert capped.record["same_output_as_reference"] == (capped.tokens == references[f"{QUERY_AWARE}/t/0"].tokens)


def test_a_stop_rule_ends_generation(model, ids):
    result = engine.run(
        model,
        [Prompt("t/0", ids, None, 16, stop=lambda tokens: len(tokens) >= 3)],
        {"full": SPECS["full"]},
        protocols=(QUERY_AWARE,),
        seed=5,
        log=lambda _: None,
    )[0]
    assert len(result[("full", QUERY_AWARE, "t/0")].tokens) == 3


class _BrokenAtDecode(MethodCache):
    """A fake fault: a cache that raises at its third decode step (no real method fails on demand)."""

    def attend(self, index, *args, **kwargs):
        self.calls = getattr(self, "calls", 0) + (index == 0)
        if self.calls > 3:
            raise RuntimeError("fake fault at decode")
        return super().attend(index, *args, **kwargs)


def test_fake_fault_in_one_row_leaves_the_others_running(model, ids, shared, monkeypatch):
    broken, _ = fork(model, shared, {"kind": "full"}, len(ids))
    broken.__class__ = _BrokenAtDecode
    healthy, _ = fork(model, shared, {"kind": "full"}, len(ids))
    rows = [
        Row(broken, shared.logits, len(ids), 8, eos_ids(model)),
        Row(healthy, shared.logits, len(ids), 8, eos_ids(model)),
    ]
    run_rows(model, rows)
    assert rows[0].error == "RuntimeError: fake fault at decode" and rows[0].done
    assert rows[1].error is None and len(rows[1].tokens) == 8


def test_a_method_that_cannot_build_its_cache_is_an_outcome_with_its_error(model, ids, split):
    results, _ = engine.run(
        model,
        [Prompt("t/0", ids, split, 4)],
        {"full": SPECS["full"], "broken": {"kind": "kivi", "bits": 2, "group_size": 7, "residual": 14}},
        protocols=(QUERY_AWARE, CONTEXT_ONLY),
        seed=5,
        reference="full",
        log=lambda _: None,
    )
    for protocol in (QUERY_AWARE, CONTEXT_ONLY):
        assert results[("broken", protocol, "t/0")].error == "ValueError: kivi: group_size 7 must divide head_dim 64"
        assert results[("full", protocol, "t/0")].error is None

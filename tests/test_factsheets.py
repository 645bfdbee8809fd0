from kvbench.corpus.factsheets import plan_documents, vocabulary
from kvbench.corpus.realistic import header_text, section_messages


def test_plans_cover_domains_and_three_doc_types_each():
    plans = plan_documents(["medical", "legal"], 2, seed=7)
    assert len(plans) == 12
    for domain in ("medical", "legal"):
        types = {p.doc_type for p in plans if p.domain == domain}
        assert len(types) >= 3


def test_same_seed_same_fact_sheets_other_seed_differs():
    a = plan_documents(["medical", "legal"], 2, seed=7)
    b = plan_documents(["medical", "legal"], 2, seed=7)
    c = plan_documents(["medical", "legal"], 2, seed=8)
    assert [(p.doc_id, p.facts, p.seed) for p in a] == [(p.doc_id, p.facts, p.seed) for p in b]
    assert [p.facts for p in a] != [p.facts for p in c]


def test_fact_sheets_are_consistent_with_the_vocabulary():
    for plan in plan_documents(["medical", "legal"], 3, seed=1):
        vocab = vocabulary(plan.domain)
        spec = vocab["doc_types"][plan.doc_type]
        assert list(plan.facts) == spec["facts"]
        assert set(plan.header_keys) <= set(plan.facts)
        assert all(isinstance(v, str) and v for v in plan.facts.values())
        assert all(key in vocab["facts"] for key in plan.facts)
        if plan.domain == "medical" and "drug" in plan.facts:
            cond = next(c for c in vocab["conditions"] if c["diagnosis"] == plan.facts["diagnosis"])
            assert (cond["drug"], cond["dose"]) == (plan.facts["drug"], plan.facts["dose"])


def test_header_and_prompt_split_the_facts():
    plan = plan_documents(["medical"], 1, seed=3)[0]
    header = header_text(plan)
    for key in plan.header_keys:
        assert plan.facts[key] in header
    prompt = section_messages(plan, "Hospital Course")[0]["content"]
    assert "Hospital Course" in prompt
    for key, value in plan.prompt_facts().items():
        assert value in prompt
    assert not set(plan.prompt_facts()) & set(plan.header_keys)

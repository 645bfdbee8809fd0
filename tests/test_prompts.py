import pandas as pd

from kvbench.kv.study import pick_documents
from kvbench.prompts import SYNTHETIC_QUESTION, build_prompts, middle_truncate, question_for


def test_middle_truncation_keeps_both_ends():
    assert middle_truncate(list(range(10)), 4) == [0, 1, 8, 9]
    assert middle_truncate(list(range(10)), 5) == [0, 1, 7, 8, 9]
    assert middle_truncate([1, 2], 5) == [1, 2]


def test_questions_prefer_facts_the_model_wrote():
    facts = pd.DataFrame(
        {
            "doc_id": ["d", "d", "e"],
            "fact": ["mrn", "drug", "x"],
            "value": ["123", "aspirin", "y"],
            "question": ["MRN?", "Drug?", "X?"],
            "char_start": [5, 900, 1],
            "source": ["header", "generated", "header"],
        }
    )
    doc = pd.Series({"corpus": "realistic", "doc_id": "d", "text": "..."})
    assert question_for(doc, facts) == ("Drug?", "aspirin")
    assert question_for(pd.Series({"corpus": "synthetic", "doc_id": "s", "text": "17 hi hi"}), None) == (
        SYNTHETIC_QUESTION,
        "17",
    )


def test_prompts_fit_the_context_and_end_with_the_question(tokenizer):
    docs = pd.DataFrame(
        {
            "doc_id": ["s0"],
            "corpus": ["synthetic"],
            "domain": ["synthetic"],
            "doc_type": ["hi"],
            "text": ["4 " + " ".join(["hi"] * 3000)],
        }
    )
    (prompt,) = build_prompts(docs, None, tokenizer, 1, 512, pick_documents)
    assert 500 <= len(prompt["input_ids"]) <= 512
    tail = tokenizer.decode(prompt["input_ids"][-40:])
    assert SYNTHETIC_QUESTION in tail and tail.endswith("assistant\n")
    assert tokenizer.decode(prompt["input_ids"][:40]).count("4 hi") == 1  # the head survives truncation
    assert prompt["answer"] == "4" and prompt["prompt_id"] == "s0@512"

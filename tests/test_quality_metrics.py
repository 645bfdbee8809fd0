"""lm-eval's LongBench metrics through kvbench's process_results functions, on known strings."""

import pytest

from kvbench.quality import metrics
from kvbench.quality.adapter import cut_at_stop


def doc(*answers, classes=None):
    return {"answers": list(answers), "all_classes": classes}


def test_qa_f1_uses_longbench_normalisation():
    # Articles, punctuation and case are dropped before token F1.
    assert metrics.qa_f1(doc("Ceftriaxone"), ["The ceftriaxone."])["score"] == 1.0
    # "1 g iv daily" vs "ceftriaxone 1 g": 2 shared tokens, P = 2/3, R = 2/4 -> F1 = 4/7.
    assert metrics.qa_f1(doc("1 g IV daily"), ["ceftriaxone 1 g"])["qa_f1_score"] == pytest.approx(4 / 7)
    # The best of several references counts.
    assert metrics.qa_f1(doc("Paris", "City of Paris"), ["city of paris"])["score"] == 1.0
    assert metrics.qa_f1(doc("aspirin"), [""])["score"] == 0.0


def test_rouge_l_f():
    # LCS "the patient was discharged" = 4 of 5 and 4 of 4 words: P = 4/5, R = 1, F = 8/9.
    result = metrics.rouge(doc("the patient was discharged"), ["the patient was quickly discharged"])
    assert result["rouge_score"] == pytest.approx(8 / 9, abs=1e-6)
    assert metrics.rouge(doc("anything"), [""])["score"] == 0.0  # rouge raises on empty text: 0, as LongBench


def test_classification_and_longbench_first_line_rule():
    classes = ["contract", "court opinion", "deposition"]
    answer = doc("deposition", classes=classes)
    assert metrics.classification(answer, ["deposition"])["score"] == 1.0
    # Two classes named: 1/2 (LongBench's rule).
    assert metrics.classification(answer, ["deposition or contract"])["score"] == 0.5
    # Few-shot answers are scored on their first line after leading newlines.
    assert metrics.classification(answer, ["\n\ndeposition\nType: contract"])["score"] == 0.5
    assert metrics.classification_first_line(answer, ["\n\ndeposition\nType: contract"])["score"] == 1.0
    assert metrics.qa_f1_first_line(doc("Paris"), ["\nParis\nQuestion: Where is Rome?"])["score"] == 1.0
    assert metrics.first_line("\n\nfirst\nsecond") == "first"


def test_retrieval_score():
    answer = doc("Paragraph 3")
    assert metrics.retrieval(answer, ["Paragraph 3"])["retrieval_score"] == 1.0
    assert metrics.retrieval(answer, ["Paragraph 3 or Paragraph 13"])["score"] == 0.5  # every number counts
    assert metrics.retrieval(answer, ["I do not know"])["score"] == 0.0


def test_stop_strings_follow_longbench_first_line():
    assert cut_at_stop("\n\ndeposition\nmore", ["\n"]) == "deposition"
    assert cut_at_stop("answer\n", ["\n"]) == "answer"
    assert cut_at_stop("  keep\nall", []) == "  keep\nall"
    assert cut_at_stop("a</s>b", ["</s>"]) == "a"

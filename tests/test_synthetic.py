from kvbench.corpus.build import build_synthetic
from kvbench.corpus.stats import token_stats
from kvbench.corpus.synthetic import synthetic_corpus, synthetic_document


def test_formula_byte_for_byte():
    # LMCache long_doc_qa / vLLM long-document benchmark: str(i) + " " + " ".join(["hi"] * L)
    assert synthetic_document(0, 3) == "0 hi hi hi"
    assert synthetic_document(12, 1) == "12 hi"
    docs = synthetic_corpus(20, 500)
    assert docs == [str(i) + " " + " ".join(["hi"] * 500) for i in range(20)]
    assert [d.encode() for d in docs] == [(str(i) + " " + "hi " * 499 + "hi").encode() for i in range(20)]


def test_table_carries_the_formula_text():
    table = build_synthetic(3, 7)
    assert list(table.text) == [synthetic_document(i, 7) for i in range(3)]
    assert list(table.doc_id) == ["synthetic-0000", "synthetic-0001", "synthetic-0002"]
    assert (table.chars == table.text.str.len()).all()


def test_real_tokenizer_sees_two_or_three_unique_tokens(tokenizer):
    for i in (0, 7, 10, 123):
        ids = tokenizer(synthetic_document(i, 2000), add_special_tokens=False).input_ids
        stats = token_stats(ids)
        assert 2 <= stats["unique_tokens"] <= 3 + len(str(i)) - 1
        assert stats["tokens"] >= 2000
        assert stats["diversity_pct"] < 0.2

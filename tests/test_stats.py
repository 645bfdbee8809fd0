import math

import pandas as pd
import pytest

from kvbench.corpus.stats import REFERENCE_DIVERSITY_PCT, summarize, text_zstd_ratio, token_stats


def test_token_stats_known_values():
    s = token_stats([1, 1, 2, 2])
    assert s == {"tokens": 4, "unique_tokens": 2, "diversity_pct": 50.0, "entropy_bits": 1.0}
    s = token_stats(list(range(8)))
    assert s["entropy_bits"] == pytest.approx(3.0)
    assert s["diversity_pct"] == 100.0
    assert token_stats([5] * 10)["entropy_bits"] == 0.0


def test_entropy_of_skewed_distribution():
    s = token_stats([0, 0, 0, 1])
    assert s["entropy_bits"] == pytest.approx(-(0.75 * math.log2(0.75) + 0.25 * math.log2(0.25)))


def test_zstd_ratio_orders_repetitive_above_varied_text():
    repetitive = "0 " + " ".join(["hi"] * 2000)
    varied = " ".join(f"word{i * 7919 % 10007}" for i in range(2000))
    assert text_zstd_ratio(repetitive) > 50
    assert 1.0 < text_zstd_ratio(varied) < text_zstd_ratio(repetitive)


def test_summary_groups_and_attaches_references():
    stats = pd.DataFrame(
        {
            "corpus": ["realistic", "realistic", "synthetic"],
            "domain": ["medical", "medical", "synthetic"],
            "doc_type": ["a", "b", "c"],
            "doc_id": ["1", "2", "3"],
            "tokens": [100, 300, 1000],
            "unique_tokens": [50, 60, 2],
            "diversity_pct": [50.0, 20.0, 0.2],
            "entropy_bits": [5.0, 6.0, 0.1],
            "text_zstd_ratio": [2.0, 3.0, 100.0],
        }
    )
    summary = summarize(stats).set_index(["corpus", "domain"])
    assert summary.loc[("realistic", "medical"), "docs"] == 2
    assert summary.loc[("realistic", "medical"), "diversity_pct_mean"] == pytest.approx(35.0)
    assert summary.loc[("realistic", "medical"), "tokens_total"] == 400
    assert (
        summary.loc[("realistic", "medical"), "reference_diversity_pct"]
        == REFERENCE_DIVERSITY_PCT[("realistic", "medical")]
    )
    assert summary.loc[("synthetic", "synthetic"), "reference_diversity_pct"] == 0.02


def test_pooled_diversity_counts_shared_tokens_once():
    from kvbench.corpus.stats import corpus_stats

    docs = pd.DataFrame(
        {
            "doc_id": ["a", "b"],
            "corpus": ["c", "c"],
            "domain": ["d", "d"],
            "doc_type": ["t", "t"],
            "title": ["", ""],
            "text": ["x y", "y z"],
            "chars": [3, 3],
        }
    )
    per_doc, summary = corpus_stats(docs, lambda text: [ord(ch) for ch in text.split()[0] + text.split()[1]])
    assert list(per_doc.diversity_pct) == [100.0, 100.0]
    assert summary.pooled_diversity_pct.iloc[0] == 75.0  # x, y, z unique in 4 tokens

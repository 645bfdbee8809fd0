"""The long_doc_qa protocol: rounds, repeat modes, hit:miss, seeded order; documents of one length;
chunk keys; the server's metric deltas."""

import random

import pytest

from kvbench.serve.keys import chunk_keys, namespace
from kvbench.serve.metrics import delta, parse
from kvbench.serve.protocol import parse_ratio, poisson_arrivals, query_round, repeat, warmup_round

PROMPTS = {"a": "doc a", "b": "doc b", "c": "doc c"}


def test_warmup_round_sends_every_document_once_in_order():
    planned = warmup_round(PROMPTS)
    assert [(p.index, p.doc_id, p.prompt, p.miss) for p in planned] == [
        (0, "a", "doc a", False),
        (1, "b", "doc b", False),
        (2, "c", "doc c", False),
    ]


def test_repeat_modes_match_long_doc_qa():
    rng = random.Random(0)
    assert repeat(["a", "b", "c"], 2, "tile", rng) == ["a", "b", "c", "a", "b", "c"]
    assert repeat(["a", "b", "c"], 2, "interleave", rng) == ["a", "a", "b", "b", "c", "c"]
    shuffled = repeat(["a", "b", "c"], 2, "random", random.Random(0))
    assert sorted(shuffled) == ["a", "a", "b", "b", "c", "c"]
    with pytest.raises(ValueError, match="repeat mode 'zigzag'"):
        repeat(["a"], 1, "zigzag", rng)


def test_query_round_misses_every_fourth_request_at_3_to_1_with_unique_prefixes():
    planned = query_round(PROMPTS, 4, "tile", "3:1", seed=7)
    assert len(planned) == 12
    assert [p.miss for p in planned] == [False, False, False, True] * 3
    for p in planned:
        if p.miss:
            number, rest = p.prompt.split(" ", 1)
            assert int(number) and rest == PROMPTS[p.doc_id]
        else:
            assert p.prompt == PROMPTS[p.doc_id]
    assert len({p.prompt for p in planned if p.miss}) == 3


def test_query_round_is_deterministic_under_its_seed():
    one = query_round(PROMPTS, 3, "random", "1:1", seed=3)
    assert one == query_round(PROMPTS, 3, "random", "1:1", seed=3)
    assert one != query_round(PROMPTS, 3, "random", "1:1", seed=4)


@pytest.mark.parametrize("text", ["3", "a:b", "0:0", "-1:2"])
def test_bad_hit_miss_ratio_is_refused(text):
    with pytest.raises(ValueError, match="ratio"):
        parse_ratio(text)


def test_chunk_keys_chain_over_the_token_prefix():
    space = namespace("run", "m", "float32", 4, "zstd-3")
    tokens = list(range(12))
    keys = chunk_keys(space, tokens, 4, 3)
    assert len(set(keys)) == 3 and all(k.startswith(space + ":") for k in keys)
    # same prefix, same keys; a change in chunk 1 changes chunks 1 and 2 only
    assert chunk_keys(space, tokens + [99], 4, 3) == keys
    changed = chunk_keys(space, tokens[:5] + [-1] + tokens[6:], 4, 3)
    assert changed[0] == keys[0] and changed[1] != keys[1] and changed[2] != keys[2]
    # equal tokens later in the prompt do not make equal keys (the prefix differs)
    assert chunk_keys(space, [0, 0, 0, 0, 0, 0, 0, 0], 4, 2)[0] != chunk_keys(space, [0, 0, 0, 0, 0, 0, 0, 0], 4, 2)[1]
    # the codec, dtype, block size and run are part of the namespace
    for other in (
        namespace("run", "m", "float32", 4, "lz4"),
        namespace("run", "m", "bfloat16", 4, "zstd-3"),
        namespace("run2", "m", "float32", 4, "zstd-3"),
    ):
        assert not set(chunk_keys(other, tokens, 4, 3)) & set(keys)
    with pytest.raises(ValueError, match="need more than 12 tokens"):
        chunk_keys(space, tokens, 4, 4)


METRICS = """# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 3.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 3.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 6.0
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 3072.0
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 768.0
# TYPE vllm:prompt_tokens_by_source counter
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_compute"} 2304.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="external_kv_transfer"} 512.0
"""


def test_metric_deltas_of_a_round():
    before = parse(METRICS)
    assert before["server_ttft_sum_s"] == 6.0 and before["prompt_tokens_local_compute"] == 2304.0
    after = parse(METRICS.replace("3.0\n", "5.0\n").replace(" 6.0", " 10.5").replace("512.0", "1024.0"))
    d = delta(before, after)
    assert d["server_ttft_count"] == 2.0 and d["server_ttft_mean_s"] == pytest.approx(2.25)
    assert d["prompt_tokens_external_kv_transfer"] == 512.0 and d["prefix_cache_hits"] == 0.0


def test_poisson_arrivals_start_at_zero_span_their_count_over_the_rate_and_are_seeded():
    for n in (2, 5, 30):  # the offered rate is the configured one exactly, whatever the draws
        times = poisson_arrivals(n, 2.0, seed=7)
        assert len(times) == n and times[0] == 0.0 and times[-1] == pytest.approx((n - 1) / 2.0)
    assert poisson_arrivals(1, 2.0, seed=7) == [0.0]
    times = poisson_arrivals(4000, 2.0, seed=7)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert all(g > 0 for g in gaps)
    assert times == poisson_arrivals(4000, 2.0, seed=7) and times != poisson_arrivals(4000, 2.0, seed=8)
    mean = sum(gaps) / len(gaps)
    sd = (sum((g - mean) ** 2 for g in gaps) / len(gaps)) ** 0.5
    assert abs(sd / mean - 1) < 0.1  # exponential gaps: sd equals the mean (evenly spaced would give 0)
    with pytest.raises(ValueError, match="rate_rps"):
        poisson_arrivals(3, 0.0, seed=0)

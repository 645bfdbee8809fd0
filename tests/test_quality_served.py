"""kvbench.quality.served without a server: the teacher-forced request's slicing on a reply shaped
as vLLM returns it, the continuation cut where the harness's reference stops, and the API key
kept out of lm-eval's log records. (The servers themselves run in the tiny workflow run.)"""

from __future__ import annotations

import logging

import pytest

from kvbench.quality import served


class RecordingClient:
    """Answers /v1/completions as vLLM does with prompt_logprobs (entry 0 None; each entry the
    top-k plus the prompt's own token), and keeps the request."""

    def __init__(self, reply: dict) -> None:
        self.reply, self.body = reply, None

    def complete(self, **body):
        self.body = body
        return self.reply


def test_forced_returns_the_positions_of_the_continuation_only():
    entries = [None, {"2": {"logprob": -0.1}}, {"9": {"logprob": -0.3}, "4": {"logprob": -2}}, {"5": {"logprob": -0.5}}]
    client = RecordingClient({"choices": [{"prompt_logprobs": entries}]})
    lists = served.forced(client, [1, 2], [9, 5], top_k=3, seed=0)
    assert client.body["prompt"] == [1, 2, 9, 5] and client.body["prompt_logprobs"] == 3
    assert lists == [{9: -0.3, 4: -2.0}, {5: -0.5}]  # entry i predicts prompt token i: the continuation's


def test_the_reference_continuation_ends_where_the_harness_stops(tokenizer):
    ids = tokenizer("Paris is the answer.\nMore text follows here", add_special_tokens=False).input_ids
    shared = served._Pass(tokenizer, None, {"t": {"until": ["\n"]}}, {}, {}, None, None, 5, 1, 0, 4096)
    cut = shared.until_stop("t", ids)
    assert "\n" in tokenizer.decode(cut) and "\n" not in tokenizer.decode(cut[:-1])
    assert shared.until_stop("t", ids[:3]) == ids[:3]  # no stop string reached: all of it


def test_the_api_key_never_reaches_lm_evals_log_records(caplog):
    logger = logging.getLogger(served.API_LOGGER)
    with caplog.at_level(logging.ERROR, logger=served.API_LOGGER), served._api_key("s3cret-key"):
        logger.error("Exception:ClientResponseError(headers={'Authorization': 'Bearer s3cret-key'})")
        logger.error("retry %s", "Bearer s3cret-key")
    assert "s3cret-key" not in caplog.text and caplog.text.count("<redacted>") == 2
    assert not logger.filters  # removed again


def test_the_harness_decodes_answers_as_vllms_detokenizer_does(tokenizer):
    """vLLM's detokenizer never applies clean_up_tokenization_spaces; the harness's decode does not
    either for a BPE tokenizer (transformers 5 ignores the flag there, Llama 3.1's `true` included),
    so the served and harness answers are the same text for the same tokens."""
    ids = tokenizer("Hello , world ! It is n't so .", add_special_tokens=False).input_ids
    kept = tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    assert kept == "Hello , world ! It is n't so ."
    assert tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=True) == kept


def test_continuation_reads_each_decode_steps_top_k_as_vllm_returns_it():
    steps = {
        "tokens": ["token_id:7", "token_id:3"],
        "top_logprobs": [{"token_id:7": -0.1, "token_id:2": -2.5}, {"token_id:3": -0.2}],
    }
    client = RecordingClient({"choices": [{"logprobs": steps}]})
    tokens, lists = served.continuation(client, [1, 2], 2, top_k=5, seed=0)
    assert client.body["logprobs"] == 5 and client.body["return_tokens_as_token_ids"]
    assert tokens == [7, 3] and lists == [{7: -0.1, 2: -2.5}, {3: -0.2}]


def test_decode_fidelity_compares_the_steps_taken_from_the_same_context():
    import math

    ref = [{1: math.log(0.9), 2: math.log(0.1)}] * 4
    other = [{1: math.log(0.6), 2: math.log(0.4)}] * 4
    one_step = 0.9 * math.log(0.9 / 0.6) + 0.1 * math.log(0.1 / 0.4)
    # identical tokens: every decode step (position 0, the prefill's, apart); the server's prefill
    # saw what the reference saw, its decode steps did not
    same = served.decode_fidelity([1, 1, 1, 1], ref, [1, 1, 1, 1], other, ref)
    assert same["decode_positions"] == 3 and same["first_divergence"] is None
    assert same["decode_kl_mean"] == pytest.approx(one_step) == pytest.approx(same["prefill_decode_kl"])
    # the server's token differs at position 2: positions 1 and 2 share the reference's context, 3 does not
    steps = [ref[0], ref[0], other[0], other[0]]
    parted = served.decode_fidelity([1, 1, 1, 1], ref, [1, 1, 2, 1], steps, other)
    assert parted["first_divergence"] == 2 and parted["decode_positions"] == 2
    assert parted["decode_kl_mean"] == pytest.approx(one_step / 2)
    assert parted["prefill_decode_kl"] == pytest.approx((kl(other[0], ref[0]) + 0) / 2)
    # at position 0 already: nothing at decode time
    assert served.decode_fidelity([1, 1], ref, [2, 1], other, other) == {
        "decode_kl_mean": None,
        "decode_positions": 0,
        "first_divergence": 0,
        "prefill_decode_kl": None,
    }


def kl(p: dict, q: dict) -> float:
    import math

    return sum(math.exp(lp) * (lp - q[t]) for t, lp in p.items())

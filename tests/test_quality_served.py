"""kvbench.quality.served without a server: the teacher-forced request's slicing on a reply shaped
as vLLM returns it, the continuation cut where the harness's reference stops, and the API key
kept out of lm-eval's log records. (The servers themselves run in the tiny workflow run.)"""

from __future__ import annotations

import logging

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
    shared = served._Pass(tokenizer, None, {"t": {"until": ["\n"]}}, {}, {}, None, 5, 1, 0, 4096)
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

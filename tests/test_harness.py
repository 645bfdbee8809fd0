"""The harness on the real model: `full` reproduces `generate`, metrics and bytes are consistent."""

import pytest
import torch

from kvbench.harness import context_bucket, generate, run_row
from kvbench.methods.base import ModelShape
from kvbench.models import load_model, load_tokenizer

PROMPT = ("Discharge summary. The patient, Maria Lopez, age 67, was admitted on March 12, 2024 with "
          "community-acquired pneumonia and treated with ceftriaxone 1 g IV daily. ") * 6 + "Question: which drug was given? Answer:"


@pytest.fixture(scope="module")
def model(model_dir):
    return load_model(model_dir)


@pytest.fixture(scope="module")
def ids(model_dir):
    return load_tokenizer(model_dir)(PROMPT).input_ids


def test_full_reproduces_transformers_generate_exactly(model, ids):
    ours = generate(model, {"kind": "full"}, ids, 24)["tokens"]
    with torch.inference_mode():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids):].tolist()
    assert ours == ref


def test_eviction_keeping_everything_matches_full(model, ids):
    full = generate(model, {"kind": "full"}, ids, 12)["tokens"]
    for spec in ({"kind": "snapkv", "keep_ratio": 1.0, "storage": "fp32"},
                 {"kind": "streamingllm", "sinks": 4, "window": 4096, "storage": "fp32"}):
        assert generate(model, spec, ids, 12)["tokens"] == full


def test_decode_after_eviction_sees_every_kept_token(model, ids):
    # After eviction the cache is shorter than the true position: the decode mask must still
    # expose every kept key (none hidden, none invented), for SDPA and eager attention.
    from transformers.masking_utils import create_causal_mask

    from kvbench.methods.base import build_cache

    cache = build_cache({"kind": "streamingllm", "sinks": 4, "window": 32}, ModelShape.of(model.config))
    with torch.inference_mode():
        model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True)
    embeds = model.model.embed_tokens(torch.tensor([[5]]))
    impl = model.config._attn_implementation
    try:
        for name in ("sdpa", "eager"):
            model.config._attn_implementation = name
            mask = create_causal_mask(config=model.config, inputs_embeds=embeds, attention_mask=None,
                                      past_key_values=cache, position_ids=torch.tensor([[len(ids)]]))
            assert mask is None or (mask.shape[-1] == 37 and (mask == 0).all())
    finally:
        model.config._attn_implementation = impl
    result = generate(model, {"kind": "streamingllm", "sinks": 4, "window": 32}, ids, 8)
    assert 1 <= result["new_tokens"] <= 8
    assert result["kv_bytes_end"] == 2 * ModelShape.of(model.config).layers * 3 * 64 * (4 + 32) * 2


def test_run_row_takes_medians_over_the_same_runs(model, ids):
    row = run_row(model, "kivi2", {"kind": "kivi", "bits": 2, "group_size": 32, "residual": 32}, ids, 6, 3, 0, 8192)
    assert row["error"] is None and row["repeats"] == 3 and 2 <= row["new_tokens"] <= 6
    # Per run decode_tok_s = 1 / tpot; the median of an odd count is one of the runs, so the two
    # medians are exact reciprocals (they were not when each median of two timings was taken apart).
    assert row["decode_tok_s"] == pytest.approx(1 / row["tpot_s"], rel=1e-12)
    assert row["prefill_tok_s"] == pytest.approx(len(ids) / row["ttft_s"], rel=1e-12)
    assert row["full16_bytes_prefill"] == ModelShape.of(model.config).full_bytes(len(ids))
    assert row["ratio_prefill"] == row["full16_bytes_prefill"] / row["kv_bytes_prefill"] and row["bucket"] == "0-4k"
    assert row["memory_increase_mb"] is not None and row["memory_increase_mb"] >= 0


def test_median_is_the_true_median_and_spread_the_sample_std():
    from kvbench.harness import median_and_std

    assert median_and_std([3.0, 1.0, 2.0]) == (2.0, 1.0)
    assert median_and_std([1.0, 2.0]) == (1.5, pytest.approx(0.5**0.5))  # torch.median would say 1.0
    assert median_and_std([4.0]) == (4.0, 0.0)


def test_peak_memory_restarts_from_the_baseline():
    from pathlib import Path

    from kvbench.harness import peak_memory_mb, reset_peak_memory

    cpu = torch.device("cpu")
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("the peak RSS cannot be reset on this OS")
    big = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    del big
    baseline = reset_peak_memory(cpu)
    assert peak_memory_mb(cpu) - baseline < 16  # the 64 MiB peak before the reset is forgotten
    block = torch.ones(128 * 2**20 // 4)
    assert 120 < peak_memory_mb(cpu) - baseline < 200  # ... and a 128 MiB one after it is seen
    del block


def test_fake_failing_method_becomes_a_row_with_its_error(model, ids):
    row = run_row(model, "broken", {"kind": "kivi", "bits": 2, "group_size": 7, "residual": 14}, ids, 4, 1, 0, 8192)
    assert row["error"] == "ValueError: kivi: group_size 7 must divide head_dim 64"
    assert "ttft_s" not in row


def test_context_buckets_scale_to_the_model():
    assert [context_bucket(t, 8192) for t in (100, 4095, 4096, 8191, 9000)] == ["0-4k", "0-4k", "4-8k", "4-8k", "8k+"]
    assert [context_bucket(t, 131072) for t in (3000, 5000, 10000)] == ["0-4k", "4-8k", "8k+"]

"""The harness on the real model: `full` reproduces `generate`, metrics and bytes are consistent."""

import copy
import time

import pandas as pd
import pytest
import torch

from kvbench.decode import forward_rows
from kvbench.harness import context_bucket, generate
from kvbench.methods.base import ModelShape
from kvbench.models import load_model, load_tokenizer

PROMPT = (
    "Discharge summary. The patient, Maria Lopez, age 67, was admitted on March 12, 2024 with "
    "community-acquired pneumonia and treated with ceftriaxone 1 g IV daily. "
) * 6 + "Question: which drug was given? Answer:"


@pytest.fixture(scope="module")
def model(model_dir):
    return load_model(model_dir)


@pytest.fixture(scope="module")
def ids(model_dir):
    return load_tokenizer(model_dir)(PROMPT).input_ids


def test_full_reproduces_transformers_generate_exactly(model, ids):
    ours = generate(model, {"kind": "full"}, ids, 24)["tokens"]
    with torch.inference_mode():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids) :].tolist()
    assert ours == ref


def kept_positions(full_keys: torch.Tensor, kept_keys: torch.Tensor) -> torch.Tensor:
    """Per KV head, the prompt position of each kept key, found by matching it to the full cache's
    keys (post-RoPE, so every position's key is distinct): [Hkv, K]. Independent of the method."""
    match = (kept_keys[0][:, :, None, :] == full_keys[0][:, None, :, :]).all(dim=-1)  # [Hkv, K, T]
    assert (match.sum(dim=-1) == 1).all(), "every kept key is exactly one prompt position's key"
    return match.int().argmax(dim=-1)


@pytest.mark.parametrize(
    "spec",
    [
        {"kind": "snapkv", "keep_ratio": 0.25, "window": 32, "kernel": 7, "storage": "fp32"},
        {"kind": "h2o", "keep_ratio": 0.25, "storage": "fp32"},
        {"kind": "streamingllm", "sinks": 4, "window": 32, "storage": "fp32"},
    ],
    ids=lambda spec: spec["kind"],
)
def test_decode_after_eviction_equals_full_attention_with_the_evicted_keys_masked(model, ids, spec):
    # The first decode step through an evicting cache must be exactly full attention (over the
    # full cache) with every evicted position hidden, per layer and per KV head: it catches wrong
    # positions, wrong kept sets handed to attention, and GQA heads reading the wrong KV head.
    from transformers import DynamicCache

    from kvbench.harness import attached
    from kvbench.methods.attention import route_attention
    from kvbench.methods.catalog import build_cache

    shape = ModelShape.of(model.config)
    tokens = len(ids)
    with torch.inference_mode():
        full = DynamicCache()
        token = int(model(input_ids=torch.tensor([ids]), past_key_values=full, use_cache=True).logits[0, -1].argmax())
        cache = build_cache(spec, shape)
        with attached(cache, model):
            model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True, logits_to_keep=1)
            masks = {}
            for index, layer in enumerate(cache.layers):
                kept = kept_positions(full.layers[index].keys, layer.keys)
                assert kept.shape[-1] < tokens  # something was evicted
                visible = torch.zeros(shape.kv_heads, tokens + 1, dtype=torch.bool)
                visible.scatter_(1, kept, True)[:, tokens] = True  # the new token sees itself
                hidden = ~visible.repeat_interleave(shape.q_heads // shape.kv_heads, dim=0)
                masks[index] = torch.zeros(hidden.shape).masked_fill(hidden, float("-inf"))[None, :, None, :]
        ours = forward_rows(model, [cache], torch.tensor([[token]]), torch.tensor([[tokens]]))[0][0]

        def masked(index):
            return lambda original, module, q, k, v, mask, *args, **kwargs: original(
                module, q, k, v, masks[index], *args, **kwargs
            )

        unmasked = model_step(model, copy.deepcopy(full), token, tokens)
        handles = route_attention(model, {i: masked(i) for i in masks})
        try:
            reference = model_step(model, full, token, tokens)
        finally:
            for handle in handles:
                handle.remove()
    assert torch.allclose(ours, reference, atol=1e-4, rtol=0), (ours - reference).abs().max()
    assert (ours - unmasked).abs().max() > 1e-2  # the eviction matters to this step


def model_step(model, cache, token: int, position: int) -> torch.Tensor:
    """One decode step through the model's own path (any transformers Cache): the next-token logits."""
    out = model(
        input_ids=torch.tensor([[token]]),
        past_key_values=cache,
        use_cache=True,
        position_ids=torch.tensor([[position]]),
    )
    return out.logits[0, -1].float()


def test_decode_after_eviction_sees_every_kept_token(model, ids):
    # After eviction the cache is shorter than the true position: the decode mask must still
    # expose every kept key (none hidden, none invented), for SDPA and eager attention.
    from transformers.masking_utils import create_causal_mask

    from kvbench.methods.catalog import build_cache

    cache = build_cache({"kind": "streamingllm", "sinks": 4, "window": 32}, ModelShape.of(model.config))
    with torch.inference_mode():
        model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True)
    embeds = model.model.embed_tokens(torch.tensor([[5]]))
    impl = model.config._attn_implementation
    try:
        for name in ("sdpa", "eager"):
            model.config._attn_implementation = name
            mask = create_causal_mask(
                config=model.config,
                inputs_embeds=embeds,
                attention_mask=None,
                past_key_values=cache,
                position_ids=torch.tensor([[len(ids)]]),
            )
            assert mask is None or (mask.shape[-1] == 37 and (mask == 0).all())
    finally:
        model.config._attn_implementation = impl
    result = generate(model, {"kind": "streamingllm", "sinks": 4, "window": 32}, ids, 8)
    assert 1 <= result["new_tokens"] <= 8
    assert result["kv_bytes_end"] == 2 * ModelShape.of(model.config).layers * 3 * 64 * (4 + 32) * 2


def stamping(stamps: list[float]):
    """A cache factory that records the time each forward pass reaches layer 0's cache update:
    a timer independent of the harness's own."""
    from kvbench.methods.catalog import build_cache

    def make(spec, shape, seed):
        cache = build_cache(spec, shape, seed)
        layer = cache.layers[0]
        update = layer.update

        def stamped(*args, **kwargs):
            stamps.append(time.perf_counter())
            return update(*args, **kwargs)

        layer.update = stamped
        return cache

    return make


def test_timings_cover_what_they_name(model, ids):
    stamps: list[float] = []
    start = time.perf_counter()
    run = generate(
        model, {"kind": "kivi", "bits": 2, "group_size": 32, "residual": 32}, ids, 6, make_cache=stamping(stamps)
    )
    wall = time.perf_counter() - start
    steps = run["new_tokens"] - 1
    assert steps >= 2 and len(stamps) == 1 + steps  # one prefill, one forward per decode step
    assert 0 < run["ttft_s"] < run["e2e_s"] <= wall
    assert run["e2e_s"] >= stamps[-1] - stamps[0]  # the end-to-end time spans every forward pass
    # The decode time spans every step, and leaves out the cache's byte count after the prefill.
    assert run["e2e_s"] - run["ttft_s"] >= run["tpot_s"] * steps >= stamps[-1] - stamps[1]


def test_a_system_job_interleaves_the_methods_and_pairs_each_run_with_the_baseline(model, ids):
    from kvbench.system import paired_ratios, per_prompt, run_job, schedule

    specs = {
        "full": {"kind": "full", "storage": "fp16"},
        "kivi2": {"kind": "kivi", "bits": 2, "group_size": 32, "residual": 32},
    }
    prompts = [
        {
            "input_ids": ids,
            "prompt_id": "a",
            "corpus": "realistic",
            "domain": "medical",
            "doc_id": "d1",
            "question": "q",
            "answer": "x",
            "target_context": len(ids),
        },
        {
            "input_ids": ids[:-12],
            "prompt_id": "b",
            "corpus": "realistic",
            "domain": "legal",
            "doc_id": "d2",
            "question": "q",
            "answer": "y",
            "target_context": len(ids) - 12,
        },
    ]
    runs = run_job(model, specs, prompts, {"repeats": 2, "max_new_tokens": 4}, 0).assign(model="m")
    assert runs.error.isna().all() and len(runs) == 8
    # Rounds over prompts, every method per prompt, the order rotated at each visit.
    assert list(zip(runs.repeat, runs.prompt_id, runs.method)) == [
        (0, "a", "full"),
        (0, "a", "kivi2"),
        (0, "b", "kivi2"),
        (0, "b", "full"),
        (1, "a", "full"),
        (1, "a", "kivi2"),
        (1, "b", "kivi2"),
        (1, "b", "full"),
    ]
    assert schedule(["x", "y", "z"], 1, 3)[3:6] == [(1, 0, "y"), (1, 0, "z"), (1, 0, "x")]
    single = generate(model, specs["kivi2"], ids, 4)
    mine = runs[(runs.method == "kivi2") & (runs.prompt_id == "a")]
    assert all(t == single["tokens"] for t in mine.output_ids) and (mine.kv_bytes_end == single["kv_bytes_end"]).all()
    medians = per_prompt(runs).set_index(["method", "prompt_id"])
    assert medians.loc[("kivi2", "a"), "repeats"] == 2
    assert medians.loc[("kivi2", "a"), "ttft_s"] == pytest.approx(mine.ttft_s.median())
    assert medians.loc[("kivi2", "a"), "ttft_s_std"] > 0  # two timings never coincide to the nanosecond
    paired = paired_ratios(runs, "full")
    assert len(paired) == 8 and (paired[paired.method == "full"].ttft_s_ratio == 1.0).all()
    row = paired[(paired.method == "kivi2") & (paired.prompt_id == "b") & (paired.repeat == 1)].iloc[0]
    base = runs[(runs.method == "full") & (runs.prompt_id == "b") & (runs.repeat == 1)].iloc[0]
    assert row.ttft_s_ratio == pytest.approx(row.ttft_s / base.ttft_s)


def test_median_is_the_true_median_and_spread_the_sample_std():
    from kvbench.harness import median_and_std

    assert median_and_std([3.0, 1.0, 2.0]) == (2.0, 1.0)
    assert median_and_std([1.0, 2.0]) == (1.5, pytest.approx(0.5**0.5))  # torch.median would say 1.0
    assert median_and_std([4.0]) == (4.0, 0.0)


def test_peak_memory_restarts_from_the_baseline():
    # In a fresh process: in this one, memory freed by earlier tests stays resident and a new block
    # can reuse it without raising the resident set, which would make the check depend on test order.
    import subprocess
    import sys
    from pathlib import Path

    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("the peak RSS cannot be reset on this OS")
    probe = """
import torch
from kvbench.harness import peak_memory_mb, reset_peak_memory
cpu = torch.device("cpu")
big = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
del big
baseline = reset_peak_memory(cpu)
after_reset = peak_memory_mb(cpu) - baseline
block = torch.ones(128 * 2**20 // 4)
print(after_reset, peak_memory_mb(cpu) - baseline)
"""
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    after_reset, after_block = map(float, out.stdout.split())
    assert after_reset < 16  # the 64 MiB peak before the reset is forgotten
    assert 120 < after_block < 200  # ... and a 128 MiB one after it is seen


def test_a_method_that_fails_is_a_run_with_its_error_and_the_job_goes_on(model, ids):
    from kvbench.system import per_prompt, run_job

    specs = {"full": {"kind": "full"}, "broken": {"kind": "kivi", "bits": 2, "group_size": 7, "residual": 14}}
    prompt = {
        "input_ids": ids,
        "prompt_id": "a",
        "corpus": "realistic",
        "domain": "medical",
        "doc_id": "d",
        "question": "q",
        "answer": "x",
        "target_context": len(ids),
    }
    runs = run_job(model, specs, [prompt], {"repeats": 2, "max_new_tokens": 3}, 0).assign(model="m")
    broken = runs[runs.method == "broken"]
    assert len(broken) == 2 and (broken.error == "ValueError: kivi: group_size 7 must divide head_dim 64").all()
    assert runs[runs.method == "full"].error.isna().all() and runs[runs.method == "full"].ttft_s.notna().all()
    summary = per_prompt(runs).set_index("method")
    assert summary.loc["broken", "repeats"] == 0 and pd.isna(summary.loc["broken", "ttft_s"])


def test_context_buckets_scale_to_the_model():
    assert [context_bucket(t, 8192) for t in (100, 4095, 4096, 8191, 9000)] == ["0-4k", "0-4k", "4-8k", "4-8k", "8k+"]
    assert [context_bucket(t, 131072) for t in (3000, 5000, 10000)] == ["0-4k", "4-8k", "8k+"]


def test_a_bench_step_picks_what_generate_picks_and_raises_what_the_cache_raised(model, ids):
    from kvbench.decode import step_one
    from kvbench.harness import prefill
    from kvbench.methods.catalog import build_cache

    cache = build_cache({"kind": "full"}, ModelShape.of(model.config))
    with torch.inference_mode():
        logits, _ = prefill(model, cache, ids)
    first = int(logits.reshape(-1, logits.shape[-1])[-1].argmax())
    expected = generate(model, {"kind": "full"}, ids, 2)["tokens"]
    with torch.inference_mode():
        top, seconds = step_one(model, cache, first, len(ids))
    assert [first, top] == expected and seconds > 0

    def broken(*args, **kwargs):
        raise ValueError("layer lost")

    cache.attend = broken
    with pytest.raises(RuntimeError, match="ValueError: layer lost"), torch.inference_mode():
        step_one(model, cache, top, len(ids) + 1)

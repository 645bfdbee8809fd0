"""SnapKV, CaM, H2O on synthetic tensors with known attention, plus the query hook on the real model."""

import pytest
import torch

from kvbench.methods.base import ModelShape, build_cache
from kvbench.methods.cam import merge_evicted
from kvbench.methods.eviction import attention_probs

SHAPE = ModelShape(layers=1, kv_heads=3, q_heads=9, head_dim=16)


def tensors(tokens: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(1, SHAPE.kv_heads, tokens, SHAPE.head_dim, generator=gen) * 0.1
    values = torch.randn(1, SHAPE.kv_heads, tokens, SHAPE.head_dim, generator=gen)
    queries = torch.randn(1, SHAPE.q_heads, tokens, SHAPE.head_dim, generator=gen) * 0.1
    return keys, values, queries


def prefill(spec, tokens=100, plant=()):
    keys, values, queries = tensors(tokens)
    for pos in plant:  # keys every query attends to strongly
        keys[..., pos, 0] = 30.0  # the other coordinates stay random, so planted keys stay distinct
    queries[..., 0] = 1.0
    cache = build_cache(spec, SHAPE)
    layer = cache.layers[0]
    layer.queries = queries
    seen_k, seen_v = layer.update(keys, values)
    assert torch.equal(seen_k, keys) and torch.equal(seen_v, values)  # prefill sees the whole prompt
    return layer, keys, values, queries


def kept_positions(layer, keys):
    # Recover positions by matching stored keys against the originals (per head).
    out = []
    for h in range(SHAPE.kv_heads):
        stored = layer.keys[0, h].float()
        ref = keys[0, h].to(torch.float16).float()
        out.append([int((ref == row).all(-1).nonzero()[0]) for row in stored])
    return out


@pytest.mark.parametrize("spec, count", [({"kind": "snapkv", "keep_ratio": 0.25, "window": 8}, 25),
                                         ({"kind": "snapkv", "capacity": 40, "window": 8}, 40)])
def test_snapkv_keeps_exact_count_per_head_and_always_the_window(spec, count):
    layer, keys, _, _ = prefill(spec, plant=(10, 40))
    assert layer.keys.shape == (1, SHAPE.kv_heads, count, SHAPE.head_dim)
    for positions in kept_positions(layer, keys):
        assert positions == sorted(positions) and len(set(positions)) == count
        assert set(range(92, 100)) <= set(positions)
        # Max-pooling with kernel 7 keeps each planted key's neighbourhood.
        assert set(range(7, 14)) | set(range(37, 44)) <= set(positions)
    assert layer.nbytes() == 2 * SHAPE.kv_heads * count * SHAPE.head_dim * 2


def test_snapkv_decode_appends():
    layer, *_ = prefill({"kind": "snapkv", "keep_ratio": 0.25, "window": 8})
    k, v, q = tensors(1, seed=5)
    layer.queries = q
    seen, _ = layer.update(k, v)
    assert seen.shape[-2] == 26 and layer.keys.shape[-2] == 26


def test_gqa_scores_average_the_group():
    keys, _, queries = tensors(12)
    probs = attention_probs(queries[..., -4:, :], keys, kv_groups=3)
    per_q = attention_probs(queries[..., -4:, :], keys.repeat_interleave(3, dim=1), kv_groups=1)
    assert torch.allclose(probs[1], per_q[3:6].mean(0))
    assert torch.allclose(probs.sum(-1), torch.ones(3, 4))
    assert (probs[:, 0, 9:] == 0).all()  # causal: query at position 8 sees keys 0..8


def test_cam_conserves_the_attention_mass_it_merges():
    _, values, _ = tensors(50)
    weights = torch.rand(SHAPE.kv_heads, 50, generator=torch.Generator().manual_seed(1))
    kept = torch.stack([torch.arange(0, 50, 3)] * SHAPE.kv_heads)
    targets = kept[:, -4:]
    merged = merge_evicted(values, weights, kept, targets)
    before = (weights[..., None] * values[0]).sum(1)
    after = (weights.gather(1, kept)[..., None] * merged[0]).sum(1)
    assert torch.allclose(after, before, atol=1e-4)
    untouched = kept[:, :-4]
    assert torch.equal(merged[0][:, : untouched.shape[1]], values[0].gather(1, untouched[..., None].expand(-1, -1, 16)))


def test_cam_evicts_like_snapkv_and_changes_only_merge_targets():
    spec = {"kind": "cam", "keep_ratio": 0.3, "window": 8, "merge_budget": 4}
    layer, keys, values, _ = prefill(spec, plant=(10, 40))
    assert layer.keys.shape[-2] == 30
    positions = kept_positions(layer, keys)
    for h, pos in enumerate(positions):
        assert {10, 40} <= set(pos) and set(range(92, 100)) <= set(pos)
        stored = layer.values[0, h].float()
        original = values[0, h, pos].to(torch.float16).float()
        changed = (~torch.isclose(stored, original, atol=1e-2)).any(-1).nonzero().flatten().tolist()
        assert set(changed) <= set(range(30 - 8 - 4, 30 - 8))  # only the merge targets


def test_h2o_keeps_heavy_hitters_and_recent_tokens_within_budget():
    spec = {"kind": "h2o", "heavy": 6, "recent": 10}
    layer, keys, _, _ = prefill(spec, plant=(5, 15, 25))
    assert layer.keys.shape[-2] == 16
    for pos in kept_positions(layer, keys):
        assert {5, 15, 25} <= set(pos) and set(range(90, 100)) <= set(pos)
    for step in range(5):
        k, v, q = tensors(1, seed=10 + step)
        q[..., 0] = 1.0
        layer.queries = q
        seen, _ = layer.update(k, v)
        assert seen.shape[-2] == 17 and layer.keys.shape[-2] == 16


def test_hook_feeds_real_queries_and_prefill_matches_full(model_dir):
    from kvbench.models import load_model, load_tokenizer

    model, tok = load_model(model_dir), load_tokenizer(model_dir)
    ids = torch.tensor([tok("The court held that the contract was void. " * 12).input_ids])
    shape = ModelShape.of(model.config)
    cache = build_cache({"kind": "snapkv", "keep_ratio": 0.5, "window": 8}, shape)
    handles = cache.attach(model)
    try:
        with torch.inference_mode():
            out = model(input_ids=ids, past_key_values=cache, use_cache=True)
            ref = model(input_ids=ids, use_cache=True)
    finally:
        for h in handles:
            h.remove()
    assert torch.allclose(out.logits, ref.logits, atol=1e-4)
    assert all(layer.queries.shape == (1, shape.q_heads, 8, shape.head_dim) for layer in cache.layers)  # the window only
    assert cache.layers[0].keys.shape[-2] == -(-ids.shape[1] // 2)

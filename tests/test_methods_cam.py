"""CaM against a straightforward implementation of the reference's update (kvpress
CAMPress.compress, written out with loops), at prefill and on the decode schedule."""

import math

import pytest
import torch

from kvbench.methods.base import ModelShape, layer_seed
from kvbench.methods.cam import cam_compress
from kvbench.methods.catalog import build_cache
from kvbench.methods.eviction import attention_probs, snapkv_scores

SHAPE = ModelShape(layers=1, kv_heads=3, q_heads=9, head_dim=16)


def straightforward_cam(values, scores, attn, keep, new, budget, draws):
    """Per head: keep the `keep` best scores; merge the `new` best-scoring evicted tokens (ties:
    later first), each into the next `budget` kept tokens, if its draw < A_i / mean A(window)."""
    heads, tokens, _ = values.shape
    out = values.clone()
    kept_all = []
    for h in range(heads):
        s, a = scores[h].tolist(), attn[h].tolist()
        kept = sorted(sorted(range(tokens), key=lambda j: -s[j])[:keep])
        evicted = [j for j in range(tokens) if j not in kept]
        merge = sorted(sorted(evicted, key=lambda j: (-s[j], -j))[:new])
        for n, i in enumerate(merge):
            window = [j for j in kept if j > i][:budget]
            if not window:
                continue
            mean = sum(a[j] for j in window) / len(window)
            p = a[i] / mean if mean > 0 else (0.0 if a[i] == 0 else 1.0)
            if draws[h, n] < min(max(p, 0.0), 1.0):
                for j in window:
                    out[h, j] += values[h, i] / len(window)
        kept_all.append(kept)
    return torch.tensor(kept_all), out


def case(tokens=60, seed=0, shared=False, zero_attn=False):
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(SHAPE.kv_heads, tokens, SHAPE.head_dim, generator=gen)
    scores = torch.rand(SHAPE.kv_heads, tokens, generator=gen)
    scores[:, -5:] = float("inf")  # a protected window
    if shared:
        scores = scores.mean(0, keepdim=True).expand_as(scores)
    attn = torch.rand(SHAPE.kv_heads, tokens, generator=gen) ** 3  # some tokens far below their window
    if zero_attn:
        attn[:, ::7] = 0.0
    return values, scores, attn


@pytest.mark.parametrize(
    "keep, new, budget, shared, zero_attn",
    [
        (20, 100, 4, False, False),  # prefill: every evicted token is a candidate
        (20, 7, 4, False, False),  # decode: only the 7 best-scoring evicted tokens
        (30, 100, 32, True, False),  # kvpress's shared selection; windows cut short at the end
        (15, 9, 3, False, True),  # zero attention: 0/0 never merges, x/0 always does
    ],
)
def test_cam_update_equals_the_straightforward_reference(keep, new, budget, shared, zero_attn):
    values, scores, attn = case(shared=shared, zero_attn=zero_attn)
    n = min(new, values.shape[1] - keep)
    draws = torch.rand(SHAPE.kv_heads, n, generator=torch.Generator().manual_seed(7))
    kept, merged = cam_compress(
        values,
        scores,
        attn,
        keep,
        new,
        budget,
        lambda shape: torch.rand(shape, generator=torch.Generator().manual_seed(7)),
    )
    ref_kept, ref_merged = straightforward_cam(values, scores, attn, keep, new, budget, draws)
    assert torch.equal(kept, ref_kept)
    assert torch.allclose(merged, ref_merged, atol=1e-6)
    changed = (merged != values).any(-1)
    assert changed.any()  # some merges happened ...
    for h in range(SHAPE.kv_heads):  # ... into kept tokens only
        assert set(changed[h].nonzero().flatten().tolist()) <= set(kept[h].tolist())
    if shared:
        assert (kept == kept[0]).all()


def test_cam_at_prefill_keeps_snapkvs_positions_and_merges_with_seeded_draws():
    gen = torch.Generator().manual_seed(1)
    keys = torch.randn(1, 3, 90, 16, generator=gen)
    values = torch.randn(1, 3, 90, 16, generator=gen)
    queries = torch.randn(1, 9, 8, 16, generator=gen)
    settings = {"window": 8, "kernel": 5, "keep_ratio": 0.3, "storage": "fp32"}
    snap = build_cache({"kind": "snapkv"} | settings, SHAPE).layers[0]
    snap.queries = queries
    snap.update(keys, values)
    stored = {}
    for seed in (11, 11, 12):
        cam = build_cache({"kind": "cam", "merge_budget": 4, "selection": "per_head"} | settings, SHAPE, seed).layers[0]
        cam.queries = queries
        seen, _ = cam.update(keys, values)
        assert torch.equal(seen, keys)  # the prefill attends to the whole prompt
        assert torch.equal(cam.keys, snap.keys)  # the same kept positions as snapkv: the merge is the difference
        stored.setdefault(seed, []).append(cam.values)
    assert torch.equal(*stored[11]) and not torch.equal(stored[11][0], stored[12][0])  # seeded draws
    # The expected merge: SnapKV scores, A = the window's attention, every evicted token a candidate.
    scores = snapkv_scores(queries, keys, 8, 5, "avg")
    attn = attention_probs(queries, keys).sum(dim=1)
    seed = layer_seed(11, 0, 0)
    draws = torch.rand(3, 90 - 27, generator=torch.Generator().manual_seed(seed))
    kept, merged = straightforward_cam(values[0], scores, attn, 27, 90, 4, draws)
    expected = merged.gather(1, kept[..., None].expand(-1, -1, 16))
    assert torch.allclose(stored[11][0][0], expected, atol=1e-6)
    assert not torch.equal(stored[11][0], snap.values)


def test_cam_decode_schedule_compresses_every_interval_once_over_target():
    spec = {"kind": "cam", "window": 4, "kernel": 3, "interval": 5, "target": 50, "buffer": 16, "merge_budget": 8}
    layer = build_cache(spec, SHAPE, seed=3).layers[0]
    gen = torch.Generator().manual_seed(2)
    keys, values = torch.randn(1, 3, 48, 16, generator=gen), torch.randn(1, 3, 48, 16, generator=gen)
    layer.update(keys, values)  # no prefill budget: the prompt is kept whole
    assert layer.keys.shape[-2] == 48 and layer.attn is None
    lengths = []
    for step in range(12):
        layer.queries = torch.randn(1, 9, 1, 16, generator=gen)
        seen, _ = layer.update(torch.randn(1, 3, 1, 16, generator=gen), torch.randn(1, 3, 1, 16, generator=gen))
        assert layer.queries is None
        lengths.append((seen.shape[-2], layer.keys.shape[-2]))
        assert layer.recent is None or layer.recent.shape[-2] <= 4  # only the scorer's window is buffered
        assert layer.attn.shape[-1] == layer.keys.shape[-2]
    # Steps 1-5 grow to 53 and compress to 50 after step 5 (this step still saw 53); then again at 10.
    assert lengths[:6] == [(49, 49), (50, 50), (51, 51), (52, 52), (53, 50), (51, 51)]
    assert lengths[9] == (55, 50) and layer.compressions == 2


def test_cam_needs_a_schedule():
    with pytest.raises(ValueError, match="cam needs keep_ratio or capacity"):
        build_cache({"kind": "cam", "window": 16}, SHAPE)


def brute_attention(queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Each KV head's attention [H, T] summed over the queries [1, Hq, n, d] (each sees every key),
    averaged over its GQA group's query heads, by explicit loops."""
    hq, hkv, d = queries.shape[1], keys.shape[1], keys.shape[-1]
    out = torch.zeros(hkv, keys.shape[-2])
    for h in range(hq):
        for q in queries[0, h]:
            out[h // (hq // hkv)] += torch.softmax(keys[0, h // (hq // hkv)] @ q / math.sqrt(d), dim=-1) / (hq // hkv)
    return out


def test_cam_decode_schedule_equals_the_straightforward_reference_step_by_step():
    # A accumulated since the last compression, n = steps since then, the scorer's buffered queries,
    # the seeded draws and the merged values: all against a straightforward replay of the schedule.
    spec = {
        "kind": "cam",
        "window": 4,
        "kernel": 3,
        "interval": 5,
        "target": 50,
        "buffer": 16,
        "merge_budget": 8,
        "storage": "fp32",
    }
    seed, gen = 3, torch.Generator().manual_seed(2)
    layer = build_cache(spec, SHAPE, seed=seed).layers[0]
    keys, values = torch.randn(1, 3, 48, 16, generator=gen), torch.randn(1, 3, 48, 16, generator=gen)
    layer.update(keys, values)
    attn, steps, recent, compressions = None, 0, [], 0
    for _ in range(17):  # three compressions
        q = torch.randn(1, 9, 1, 16, generator=gen)
        k, v = torch.randn(1, 3, 1, 16, generator=gen), torch.randn(1, 3, 1, 16, generator=gen)
        layer.queries = q
        layer.update(k, v)
        keys, values = torch.cat([keys, k], dim=-2), torch.cat([values, v], dim=-2)
        step = brute_attention(q, keys)
        attn = step if attn is None else torch.cat([attn, torch.zeros(3, 1)], dim=-1) + step
        recent, steps = (recent + [q])[-4:], steps + 1
        if steps >= 5 and keys.shape[-2] > 50:
            scores = snapkv_scores(torch.cat(recent, dim=-2), keys, 4, 3, "avg").mean(0, keepdim=True).expand(3, -1)
            n = min(steps, keys.shape[-2] - 50)
            draws = torch.rand(3, n, generator=torch.Generator().manual_seed(layer_seed(seed, 0, compressions)))
            kept, merged = straightforward_cam(values[0], scores, attn, 50, steps, 8, draws)
            index = kept[..., None].expand(-1, -1, 16)
            keys, values = keys[0].gather(1, index)[None], merged.gather(1, index)[None]
            attn, steps, recent, compressions = attn.gather(1, kept), 0, [], compressions + 1
        assert torch.equal(layer.keys, keys)
        assert torch.allclose(layer.values, values, atol=1e-5)
        assert torch.allclose(layer.attn, attn, atol=1e-5)
    assert layer.compressions == compressions == 3

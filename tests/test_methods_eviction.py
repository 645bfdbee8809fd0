"""SnapKV, H2O on synthetic tensors against brute-force recomputations, plus the query hook on the
real model against the queries eager attention really used."""

import math

import pytest
import torch

from kvbench.methods.base import ModelShape
from kvbench.methods.catalog import build_cache
from kvbench.methods.eviction import attention_probs, attention_received, snapkv_scores

SHAPE = ModelShape(layers=1, kv_heads=3, q_heads=9, head_dim=16)
GROUP = SHAPE.q_heads // SHAPE.kv_heads


def tensors(tokens: int, seed: int = 0, queries: int | None = None):
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(1, SHAPE.kv_heads, tokens, SHAPE.head_dim, generator=gen)
    values = torch.randn(1, SHAPE.kv_heads, tokens, SHAPE.head_dim, generator=gen)
    q = torch.randn(1, SHAPE.q_heads, queries or tokens, SHAPE.head_dim, generator=gen)
    return keys, values, q


def brute_probs(query: torch.Tensor, keys: torch.Tensor, visible: int) -> list[float]:
    """Softmax attention of one query vector [d] over keys[:visible] [T, d], one score at a time."""
    logits = [float(query @ keys[j]) / math.sqrt(query.shape[0]) for j in range(visible)]
    top = max(logits)
    weights = [math.exp(x - top) for x in logits]
    return [w / sum(weights) for w in weights] + [0.0] * (keys.shape[0] - visible)


def brute_snapkv(queries, keys, window, kernel, pooling):
    """kvpress SnapKVPress.score written out: per query head, the window's attention (causal)
    averaged over the window, prefix only, pooled with zero padding; then the GQA group mean."""
    t = keys.shape[-2]
    out = torch.zeros(SHAPE.kv_heads, t - window)
    for kv_head in range(SHAPE.kv_heads):
        for qh in range(kv_head * GROUP, (kv_head + 1) * GROUP):
            rows = [
                brute_probs(queries[0, qh, -window + i], keys[0, kv_head], t - window + i + 1) for i in range(window)
            ]
            mean = [sum(row[j] for row in rows) / window for j in range(t - window)]
            half = kernel // 2
            for j in range(t - window):
                hood = [mean[k] if 0 <= k < t - window else 0.0 for k in range(j - half, j + half + 1)]
                out[kv_head, j] += (sum(hood) / kernel if pooling == "avg" else max(hood)) / GROUP
    return out


@pytest.mark.parametrize("pooling", ["avg", "max"])
def test_snapkv_scores_equal_brute_force(pooling):
    keys, _, queries = tensors(40)
    scores = snapkv_scores(queries, keys, 6, 5, pooling)
    assert torch.allclose(scores[:, :-6], brute_snapkv(queries, keys, 6, 5, pooling), atol=1e-6)
    assert torch.isinf(scores[:, -6:]).all()  # the window is always kept


@pytest.mark.parametrize(
    "spec, keep",
    [
        ({"kind": "snapkv", "keep_ratio": 0.25, "window": 8, "kernel": 5}, 25),
        ({"kind": "snapkv", "capacity": 40, "window": 8, "kernel": 5, "pooling": "max"}, 40),
    ],
)
def test_snapkv_keeps_the_brute_force_top_positions_and_the_window(spec, keep):
    keys, values, queries = tensors(103)  # int(103 * 0.25) = 25, as kvpress rounds
    layer = build_cache(spec, SHAPE).layers[0]
    layer.queries = queries[..., -8:, :]
    seen_k, seen_v = layer.update(keys, values)
    assert torch.equal(seen_k, keys) and torch.equal(seen_v, values)  # the prefill sees the whole prompt
    assert layer.queries is None  # released once used
    scores = brute_snapkv(queries, keys, 8, 5, spec.get("pooling", "avg"))
    for h in range(SHAPE.kv_heads):
        expected = sorted(scores[h].topk(keep - 8).indices.tolist() + list(range(95, 103)))
        assert torch.equal(layer.keys[0, h], keys[0, h, expected].half())
        assert torch.equal(layer.values[0, h], values[0, h, expected].half())
    k, v, _ = tensors(1, seed=5)
    seen, _ = layer.update(k, v)  # decode appends, no further eviction
    assert seen.shape[-2] == keep + 1 and layer.keys.shape[-2] == keep + 1


def test_gqa_scores_average_the_group():
    keys, _, queries = tensors(12)
    probs = attention_probs(queries[..., -4:, :], keys)
    for kv_head in range(SHAPE.kv_heads):
        for i in range(4):
            expected = [
                sum(x) / GROUP
                for x in zip(
                    *[
                        brute_probs(queries[0, qh, 8 + i], keys[0, kv_head], 9 + i)
                        for qh in range(kv_head * GROUP, (kv_head + 1) * GROUP)
                    ]
                )
            ]
            assert torch.allclose(probs[kv_head, i], torch.tensor(expected), atol=1e-6)


@pytest.mark.parametrize("tokens, window, chunk", [(40, 40, 7), (40, 13, 5), (9, 1, 256), (33, 32, 32)])
def test_attention_received_is_the_summed_group_attention(tokens, window, chunk):
    """H2O's chunked sum equals the per-query probabilities summed, across chunk boundaries that cut
    the causal diagonal (chunk 7 of 40 queries), a window shorter than the keys, and one decode query."""
    keys, _, queries = tensors(tokens, seed=3, queries=window)
    expected = attention_probs(queries, keys).sum(dim=1)
    assert torch.allclose(attention_received(queries, keys, chunk), expected, atol=1e-5)


def test_h2o_scores_and_kept_tokens_equal_brute_force():
    heavy, recent = 6, 10
    layer = build_cache({"kind": "h2o", "heavy": heavy, "recent": recent}, SHAPE).layers[0]
    keys, values, queries = tensors(40)
    steps = [tensors(1, seed=10 + i) for i in range(6)]
    # Brute force: each head's positions and accumulated attention, evicting after every update.
    kept = [list(range(40)) for _ in range(SHAPE.kv_heads)]
    score = [[0.0] * 40 for _ in range(SHAPE.kv_heads)]
    all_keys = torch.cat([keys] + [s[0] for s in steps], dim=-2)

    def attend(h, position, query_rows):
        # Decode attends to the stored (fp16) kept keys plus its own key at compute precision.
        cached = torch.stack(
            [
                all_keys[0, h, p] if p >= position - 1 or position == 40 else all_keys[0, h, p].half().float()
                for p in kept[h]
            ]
        )
        for qh in range(h * GROUP, (h + 1) * GROUP):
            for q, visible in query_rows:
                for j, p in enumerate(brute_probs(q[qh], cached, visible)):
                    score[h][j] += p / GROUP
        n = len(kept[h])
        if n > heavy + recent:
            old = sorted(range(n - recent), key=lambda j: -score[h][j])[:heavy]
            chosen = sorted(old) + list(range(n - recent, n))
            kept[h] = [kept[h][j] for j in chosen]
            score[h] = [score[h][j] for j in chosen]

    layer.queries = queries
    layer.update(keys, values)
    for h in range(SHAPE.kv_heads):
        attend(h, 40, [(queries[0, :, i], i + 1) for i in range(40)])
    for i, (k, v, q) in enumerate(steps):
        layer.queries = q
        seen, _ = layer.update(k, v)
        assert seen.shape[-2] == heavy + recent + 1  # this step sees the kept tokens and itself
        for h in range(SHAPE.kv_heads):
            kept[h] = kept[h] + [40 + i]
            score[h] = score[h] + [0.0]
            attend(h, 41 + i, [(q[0, :, 0], len(kept[h]))])
        for h in range(SHAPE.kv_heads):
            assert torch.equal(layer.keys[0, h], all_keys[0, h, kept[h]].half()), f"step {i} head {h}"
            assert torch.allclose(layer.scores[h], torch.tensor(score[h]), atol=1e-5)


def test_eviction_without_attached_queries_is_an_error():
    layer = build_cache({"kind": "snapkv", "keep_ratio": 0.25, "window": 8}, SHAPE).layers[0]
    keys, values, _ = tensors(50)
    with pytest.raises(RuntimeError, match="snapkv: no queries reached the layer"):
        layer.update(keys, values)


def test_hook_queries_are_the_queries_eager_attention_used(model_dir):
    """The pre-hook recomputes post-RoPE queries; eager attention, wrapped, reports the ones it used."""
    import transformers.models.llama.modeling_llama as llama

    from kvbench.harness import attached
    from kvbench.methods.eviction import EvictionCache, ScoredLayer
    from kvbench.models import load_model, load_tokenizer

    class Recording(ScoredLayer):
        prefill_queries, decode_queries = None, True

        def update(self, key_states, value_states, *args, **kwargs):
            self.seen = getattr(self, "seen", []) + [self.take_queries()]
            return super().update(key_states, value_states)

    model, tok = load_model(model_dir), load_tokenizer(model_dir)
    model.config._attn_implementation = "eager"
    used: dict[int, list[torch.Tensor]] = {}
    original = llama.eager_attention_forward

    def eager(module, query, *args, **kwargs):
        used.setdefault(module.layer_idx, []).append(query.clone())
        return original(module, query, *args, **kwargs)

    shape = ModelShape.of(model.config)
    cache = EvictionCache([Recording(torch.float32, shape.q_heads) for _ in range(shape.layers)])
    ids = torch.tensor([tok("The court held that the contract was void. " * 8).input_ids])
    llama.eager_attention_forward = eager
    try:
        with torch.inference_mode(), attached(cache, model):
            model(input_ids=ids, past_key_values=cache, use_cache=True)
            model(
                input_ids=torch.tensor([[42]]),
                past_key_values=cache,
                use_cache=True,
                position_ids=torch.tensor([[ids.shape[1]]]),
            )
    finally:
        llama.eager_attention_forward = original
        model.config._attn_implementation = "sdpa"
    for index, layer in enumerate(cache.layers):
        assert len(layer.seen) == len(used[index]) == 2
        for ours, real in zip(layer.seen, used[index]):
            assert ours.shape == real.shape and torch.allclose(ours, real, atol=1e-6)


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"kind": "snapkv", "kernel": 6}, r"kernel: 6 must be odd \(a centred pooling window\)"),
        ({"kind": "snapkv", "pooling": "mean"}, r"pooling: 'mean' is not one of \['avg', 'max'\]"),
        (
            {"kind": "cam", "target": 100, "selection": "heads"},
            r"selection: 'heads' is not one of \['shared', 'per_head'\]",
        ),
    ],
)
def test_scoring_settings_that_would_fail_mid_run_are_refused(spec, message):
    with pytest.raises(ValueError, match=message):
        build_cache(spec, SHAPE)


def test_query_hook_refuses_models_that_norm_their_queries():
    # Qwen3 applies q_norm before RoPE; the hook recomputes q_proj + RoPE only, so it would hand the
    # scorer other queries than the model's: refused at attach time (the harness records an error row).
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=32,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
    )
    model = Qwen3ForCausalLM(config)
    cache = build_cache({"kind": "snapkv", "keep_ratio": 0.5}, ModelShape.of(config))
    with pytest.raises(NotImplementedError, match="q_norm"):
        cache.attach(model)

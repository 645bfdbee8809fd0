"""MethodLayer.append (decode tokens written in place into room ahead of them) against torch.cat,
and the eviction methods' query hooks leaving the model once no layer needs queries."""

from __future__ import annotations

import pytest
import torch

from kvbench.methods.base import GROWTH, MethodLayer, tensor_bytes


def prefilled(tokens: int = 10, seed: int = 0) -> MethodLayer:
    layer = MethodLayer()
    layer.keys = torch.randn(1, 3, tokens, 8, generator=torch.Generator().manual_seed(seed))
    return layer


def test_append_equals_concatenation_and_copies_once_per_room():
    layer, gen = prefilled(tokens=640), torch.Generator().manual_seed(1)
    expected, earlier, rooms = layer.keys.clone(), [], set()
    steps = 40
    for step in range(steps):
        new = torch.randn(1, 3, 3 if step == 7 else 1, 8, generator=gen)
        expected = torch.cat([expected, new], dim=-2)
        out = layer.append("keys", new)
        assert out is layer.keys and torch.equal(out, expected)
        earlier.append((out, out.clone()))
        rooms.add(out.untyped_storage().data_ptr())
    # Later appends write past every earlier view: what a step attended to never changes.
    assert all(torch.equal(view, copy) for view, copy in earlier)
    # A room holds T/GROWTH + 1 spare tokens (11 here): one copy per 11 steps or so, not one per step.
    assert 3 <= len(rooms) <= 1 + steps // (640 // GROWTH)


def test_append_never_writes_into_storage_it_did_not_allocate():
    layer = MethodLayer()
    caller = torch.zeros(1, 3, 100, 8)
    layer.keys = caller[:, :, :10]  # a prefix of someone else's tensor, with room-like strides
    layer.append("keys", torch.ones(1, 3, 1, 8))
    assert not caller.any()


def test_a_cropped_view_of_its_own_room_is_copied_not_overwritten():
    layer = prefilled(tokens=640)
    before = layer.append("keys", torch.ones(1, 3, 1, 8))  # 641 tokens in a room of 652
    kept = before.clone()
    layer.keys = before[:, :, :600]  # as DynamicLayer.crop does: a prefix view of the same room
    after = layer.append("keys", torch.full((1, 3, 1, 8), 2.0))
    assert torch.equal(before, kept)  # token 600 of the earlier view is not overwritten
    assert after.shape[-2] == 601 and torch.equal(after[:, :, 600], torch.full((1, 3, 8), 2.0))
    assert after.untyped_storage().data_ptr() != before.untyped_storage().data_ptr()


@pytest.mark.parametrize(
    "shape, dtype", [((2, 1, 5, 4), torch.float16), ((1, 2, 3, 16), torch.uint8), ((3, 4, 1, 2), torch.float32)]
)
def test_append_equals_concatenation_for_batches_single_heads_and_storage_dtypes(shape, dtype):
    layer, gen = MethodLayer(), torch.Generator().manual_seed(2)
    layer.values = (torch.rand(*shape, generator=gen) * 100).to(dtype)
    expected = layer.values.clone()
    for step in range(9):
        new = (torch.rand(shape[0], shape[1], 1 + step % 2, shape[3], generator=gen) * 100).to(dtype)
        expected = torch.cat([expected, new], dim=-2)
        assert torch.equal(layer.append("values", new), expected)


@pytest.mark.parametrize(
    "new", [torch.zeros(1, 2, 1, 8), torch.zeros(1, 3, 1, 4), torch.zeros(1, 3, 1, 8, dtype=torch.float16)]
)
def test_append_refuses_what_concatenation_would(new):
    with pytest.raises(ValueError, match="cannot append"):
        prefilled().append("keys", new)


def test_nbytes_counts_the_room_not_the_view():
    layer = prefilled(tokens=10)
    layer.values = layer.keys.clone()
    for _ in range(3):
        layer.append("keys", torch.zeros(1, 3, 1, 8))
        layer.append("values", torch.zeros(1, 3, 1, 8))
    # 10 tokens + 1 -> a room of 12; the second fits; the third -> a room of 13 + 0 + 1 = 14 tokens.
    room_bytes = 2 * 3 * 14 * 8 * 4
    assert layer.keys.shape[-2] == 13 and layer.nbytes() == room_bytes
    assert tensor_bytes(layer.keys, layer.keys[:, :, :2]) == room_bytes // 2  # one storage, counted once


def pre_hooks(model) -> list[int]:
    return [len(block.self_attn._forward_pre_hooks) for block in model.model.layers]


# After one decode step SnapKV and CaM at prefill hold their 32 kept tokens plus the new one; H2O
# evicts back to 32; CaM's decode schedule keeps scoring (it needs every step's query).
@pytest.mark.parametrize(
    "spec, hooks_in_decode, held",
    [
        ({"kind": "snapkv", "keep_ratio": 0.5}, 0, 33),
        ({"kind": "cam", "keep_ratio": 0.5}, 0, 33),
        ({"kind": "h2o", "keep_ratio": 0.5}, 1, 32),
        ({"kind": "cam", "target": 48, "window": 8}, 1, 65),
    ],
)
def test_query_hooks_stay_only_while_a_layer_needs_queries(model_dir, spec, hooks_in_decode, held):
    from kvbench.harness import attached
    from kvbench.methods.base import ModelShape
    from kvbench.methods.catalog import build_cache
    from kvbench.models import load_model

    model = load_model(model_dir)
    cache = build_cache(spec, ModelShape.of(model.config))
    layers = len(model.model.layers)
    ids = torch.arange(100, 164)[None]
    with torch.inference_mode(), attached(cache, model):
        assert pre_hooks(model) == [1] * layers
        model(input_ids=ids, past_key_values=cache, use_cache=True)
        model(input_ids=torch.tensor([[42]]), past_key_values=cache, use_cache=True, position_ids=torch.tensor([[64]]))
        assert pre_hooks(model) == [hooks_in_decode] * layers
        assert cache.get_seq_length() == held
    assert pre_hooks(model) == [0] * layers
    with attached(cache, model):  # attached after its prefill: hooks only where decode needs queries
        assert pre_hooks(model) == [hooks_in_decode] * layers
